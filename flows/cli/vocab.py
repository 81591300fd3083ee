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

from flows.cli import options as opt


def vocab(
    ctx: typer.Context,
    output: Annotated[str, typer.Option(help="Output folder or URI (gs://...) for vocab.txt etc.")],
    corpus: Annotated[
        str | None, typer.Option(help="Documents folder (corpus stage output); optional with --vocab-file.")
    ] = None,
    vocab_file: Annotated[
        str | None, typer.Option("--vocab-file", help="Use and validate this vocab.txt instead of training.")
    ] = None,
    preset: opt.PresetOpt = "demo",
    config: opt.ConfigOpt = None,
    set_: opt.SetOpt = None,
    workers: opt.WorkersOpt = None,
    runner: opt.RunnerOpt = None,
) -> None:
    """Train a WordPiece vocab on the corpus (Beam word counts + HF tokenizers), or validate one."""
    from beam_jobs.job import EmptyResultError
    from bert_core.storage import UnfinishedWriteError

    cfg = opt.resolve(preset, config, set_)
    vocab_cfg = cfg.vocab
    if vocab_file:
        vocab_cfg = vocab_cfg.model_copy(update={"vocab_file": vocab_file})
    from beam_jobs.build_vocab import build_vocab as run_job
    from bert_core.vocab.training import report_markdown

    with opt.user_errors(UnfinishedWriteError, ValueError, EmptyResultError):
        manifest = run_job(corpus, output, vocab_cfg, **opt.beam_run(cfg, ctx, workers, runner))
    typer.echo(report_markdown(manifest))


def register(app: typer.Typer) -> None:
    app.command("vocab", context_settings={"allow_extra_args": True})(vocab)
