"""``bertpipe refresh``: refresh the model on a newer Wikipedia dump, as the Prefect flow ``refresh``.

    bertpipe refresh                      (the newest finished dump)
    bertpipe refresh --date 20261201 --set refresh.init=scratch

Prints the new version, the gate's decision and why, and the current model after it. What it
reads besides the dump is checked before the download (``bert_core.preflight``).
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve


def refresh(
    date: Annotated[str | None, typer.Option(help="Dump date, YYYYMMDD (default: the newest finished dump).")] = None,
    base_url: Annotated[
        str | None, typer.Option(help="Dump site or mirror (default $BERTPIPE_DUMPS_URL or Wikimedia).")
    ] = None,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Dump -> corpus -> continued pre-training -> suite -> gate -> promotion (finished parts skipped)."""
    cfg = resolve(preset, config, set_)
    from bert_core.preflight import check_refresh

    check_refresh(cfg, date)
    from flows.cli.run import run_flow
    from flows.refresh import refresh as refresh_flow

    out = run_flow(refresh_flow, cfg, date=date, base_url=base_url)
    typer.echo(f"{out['version']} (dump {out['dump_date']}, parent {out['parent'] or '-'}): "
               f"{out['outcome']}: {out['gate']['why']}")
    typer.echo(f"current: {out['current']}")
