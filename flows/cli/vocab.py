"""CLI of the vocab stage.

    bertpipe vocab --corpus ./bertpipe-data/corpus --output ./bertpipe-data/vocab \
        --preset demo --set vocab.vocab_size=8000
    bertpipe vocab --corpus ./bertpipe-data/corpus --output ./bertpipe-data/vocab \
        --vocab-file samples/models/minilm/vocab.txt       (validate + measure an existing vocab)

Runs the Beam job directly (no Prefect), with progress while it runs (documents counted, words
given to the trainer: ``flows/cli/progress.py``), and prints the vocab report; extra arguments
after the options go to Beam.
"""

from __future__ import annotations

from typing import Annotated

import typer

from bert_core.config import validate
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
    vocab_size: Annotated[
        int | None, typer.Option("--vocab-size", help="Trained vocab size (sets vocab.vocab_size).")
    ] = None,
    cased: Annotated[
        bool, typer.Option("--cased", help="Keep case and accents, for a cased model (vocab.lowercase=false).")
    ] = False,
    workers: opt.WorkersOpt = None,
    runner: opt.RunnerOpt = None,
) -> None:
    """Train a WordPiece vocab on the corpus (Beam word counts + HF tokenizers), or validate one.
    Arguments after `--` go to Beam."""
    cfg = opt.resolve(preset, config, set_)
    updates = {"vocab_file": vocab_file, "vocab_size": vocab_size, "lowercase": False if cased else None}
    updates = {name: value for name, value in updates.items() if value is not None}
    vocab_cfg = validate({**cfg.vocab.model_dump(), **updates}, "vocab options", type(cfg.vocab))
    from beam_jobs import build_vocab
    from bert_core.vocab.training import report_markdown
    from flows.cli.manifests import plain_markdown
    from flows.cli.progress import progress_bars

    with progress_bars() as on_progress:
        manifest = build_vocab.run(vocab_cfg, corpus, output, on_progress=on_progress,
                                   **opt.beam_run(cfg, ctx, workers, runner))
    typer.echo(plain_markdown(report_markdown(manifest)))
