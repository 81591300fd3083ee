"""CLI of the instance stage.

    bertpipe instances --corpus ./bertpipe-data/corpus --vocab ./bertpipe-data/vocab \
        --output ./bertpipe-data/instances --preset demo --set instances.dupe_factor=5

``instances`` runs the Beam job directly (no Prefect), with progress while it runs (documents
read, pools, shards written: ``flows/cli/progress.py``); ``--vocab`` is a vocab stage folder or a
``vocab.txt`` (then ``vocab.lowercase`` says the casing); extra arguments after the options go
to Beam.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli import options as opt
from flows.cli.manifests import format_stats


def instances(
    ctx: typer.Context,
    corpus: Annotated[str, typer.Option(help="Documents folder (corpus stage output).")],
    vocab: Annotated[str, typer.Option(help="Vocab stage folder, or a vocab.txt file.")],
    output: Annotated[str, typer.Option(help="Output folder or URI (gs://...) for seq{L}/ shards.")],
    workers: opt.WorkersOpt = None,
    runner: opt.RunnerOpt = None,
    preset: opt.PresetOpt = "demo",
    config: opt.ConfigOpt = None,
    set_: opt.SetOpt = None,
) -> None:
    """Create masked-LM instances (+ next-sentence pairs when instances.next_sentence_prediction
    is on; the demo preset has it off) in balanced Parquet shards (Beam). Arguments after `--` go
    to Beam."""
    cfg = opt.resolve(preset, config, set_)
    from beam_jobs import create_instances
    from flows.cli.progress import progress_bars

    with progress_bars() as on_progress:
        manifest = create_instances.run(cfg.instances, corpus, vocab, output, lowercase=cfg.vocab.lowercase,
                                        on_progress=on_progress, **opt.beam_run(cfg, ctx, workers, runner))
    typer.echo(format_stats(manifest))
