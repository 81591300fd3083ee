"""CLI of the vocab stage.

    bertpipe vocab --corpus ./bertpipe-data/corpus --output ./bertpipe-data/vocab \
        --preset demo --set vocab.vocab_size=8000
    bertpipe vocab --corpus ./bertpipe-data/corpus --output ./bertpipe-data/vocab \
        --vocab-file samples/models/minilm/vocab.txt       (validate + measure an existing vocab)

Runs the Beam job directly (no Prefect) and prints the vocab report; extra arguments after the
options go to Beam.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.options import (
    ConfigOpt,
    PresetOpt,
    RunnerOpt,
    SetOpt,
    WorkersOpt,
    resolve,
    user_errors,
)


def vocab(
    ctx: typer.Context,
    output: Annotated[str, typer.Option(help="Output folder or URI (gs://...) for vocab.txt etc.")],
    corpus: Annotated[
        str | None, typer.Option(help="Documents folder (corpus stage output); optional with --vocab-file.")
    ] = None,
    vocab_file: Annotated[
        str | None, typer.Option("--vocab-file", help="Use and validate this vocab.txt instead of training.")
    ] = None,
    workers: WorkersOpt = None,
    runner: RunnerOpt = None,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Train a WordPiece vocab on the corpus (Beam word counts + HF tokenizers), or validate one."""
    from beam_jobs.job import EmptyResultError
    from bert_core.storage import UnfinishedWriteError

    cfg = resolve(preset, config, set_)
    vocab_cfg = cfg.vocab
    if vocab_file:
        vocab_cfg = vocab_cfg.model_copy(update={"vocab_file": vocab_file})
    from beam_jobs.build_vocab import build_vocab as run_job
    from bert_core.vocab.training import report_markdown

    with user_errors(UnfinishedWriteError, ValueError, EmptyResultError):
        manifest = run_job(corpus, output, vocab_cfg, workers=workers or cfg.workers,
                           runner=runner or cfg.beam_runner, beam_args=[*cfg.beam_args, *ctx.args],
                           shared_storage=cfg.shared_storage)
    typer.echo(report_markdown(manifest))


def register(app: typer.Typer) -> None:
    app.command("vocab", context_settings={"allow_extra_args": True})(vocab)
