"""``bertpipe infra render``: Kubernetes, work pool, Beam runner and Prefect files from the config.

    bertpipe infra render --preset bert-base-128 --set pretrain.nodes=4 --out build/infra
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve


def infra_render(
    out: Annotated[str, typer.Option(help="Folder for the rendered files.")] = "build/infra",
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    image: Annotated[str, typer.Option(help="Container image for every pod and Beam worker.")] = "bertpipe:latest",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace.")] = "bertpipe",
    instances: Annotated[str | None, typer.Option(help="Instances folder the training pods read.")] = None,
    run_dir: Annotated[str | None, typer.Option("--run", help="Run folder the training pods write.")] = None,
) -> None:
    """Render Kubernetes pods, the GPU work pool template, Beam runner overlays and prefect.yaml."""
    from flows.tools.render import InfraSettings, render_all

    cfg = resolve(preset, config, set_)
    settings = InfraSettings(image=image, namespace=namespace, instances=instances, run=run_dir)
    for path in render_all(cfg, settings, out):
        typer.echo(path)
