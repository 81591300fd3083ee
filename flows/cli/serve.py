"""``bertpipe serve``: the deployments of ``infra/prefect.yaml`` served from this process.

    bertpipe serve                       # every deployment, with its schedule
    bertpipe serve --only refresh
"""

from __future__ import annotations

from typing import Annotated

import typer


def serve(
    prefect_yaml: Annotated[str, typer.Option(help="Deployment definitions.")] = "infra/prefect.yaml",
    only: Annotated[list[str] | None, typer.Option(help="Serve only these deployment names.")] = None,
) -> None:
    """Serve the deployments of prefect.yaml from this process, schedules included (Ctrl-C stops)."""
    from prefect import serve as prefect_serve

    from flows.tools.deployments import runner_deployments

    deployments = runner_deployments(prefect_yaml, only=only)
    typer.echo("serving: " + ", ".join(d.name for d in deployments), err=True)
    prefect_serve(*deployments)
