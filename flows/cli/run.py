"""``bertpipe run``: the whole pipeline once, as the Prefect flow ``bert_pipeline``.

    bertpipe run --preset demo
"""

from __future__ import annotations

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve


def run(preset: PresetOpt = "demo", config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Run the whole pipeline once (stages already finished for this config are skipped)."""
    cfg = resolve(preset, config, set_)
    from flows.pipeline import bert_pipeline

    summary = bert_pipeline(cfg)
    for stage, info in summary["stages"].items():
        typer.echo(f"{stage:10s} {info['status']:16s} {info['output']}")
