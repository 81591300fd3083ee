"""``bertpipe export``: a pre-training checkpoint -> a folder transformers opens.

    bertpipe export runs/demo/checkpoints --output runs/demo/hf --preset demo
    bertpipe export runs/demo/hf --output /tmp/copy            # re-export / validate a folder

The source is a DeepSpeed checkpoint folder or a transformers folder; the work is
``bert_core.model.export.export_checkpoint``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve


def export(
    source: Annotated[str, typer.Argument(help="DeepSpeed checkpoint folder or transformers folder.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Destination folder or URI (gs://...).")],
    vocab: Annotated[
        str | None, typer.Option(help="vocab.txt to ship (default: one beside the checkpoint).")
    ] = None,
    tag: Annotated[
        str | None, typer.Option(help="DeepSpeed checkpoint tag (default: the `latest` file).")
    ] = None,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Export a checkpoint to the transformers layout (config.json + model.safetensors + vocab)."""
    from bert_core.model.export import export_checkpoint

    cfg = resolve(preset, config, set_)
    out = export_checkpoint(source, output, like=cfg.model, vocab_file=vocab, tag=tag, lowercase=cfg.vocab.lowercase)
    typer.echo(f"exported {source} -> {out}")
