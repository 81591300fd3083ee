"""The deployments of infra/prefect.yaml as runner deployments, for ``bertpipe serve``.

    bertpipe serve --only refresh/monthly

``serve`` runs process-pool deployments from this process, schedules included, with no work pool;
``prefect deploy --prefect-file infra/prefect.yaml`` registers the same ones for workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.tools.render import PROCESS_POOL, load_prefect_yaml


def _flow(entrypoint: str):
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(entrypoint)


def deployment_specs(prefect_yaml: str | Path) -> list[dict[str, Any]]:
    """Each deployment with its full name ``<flow name>/<deployment name>``."""
    specs = []
    for spec in load_prefect_yaml(prefect_yaml)["deployments"]:
        flow = _flow(spec["entrypoint"])
        specs.append({**spec, "flow": flow, "full_name": f"{flow.name}/{spec['name']}"})
    return specs


def runner_deployments(prefect_yaml: str | Path = "infra/prefect.yaml", only: list[str] | None = None):
    """``RunnerDeployment`` objects for the process-pool deployments (filtered by full name)."""
    from prefect.schedules import Cron

    chosen = []
    for spec in deployment_specs(prefect_yaml):
        if spec["work_pool"]["name"] != PROCESS_POOL or (only and spec["full_name"] not in only):
            continue
        schedules = [Cron(s["cron"], timezone=s.get("timezone", "UTC"), active=s.get("active", True))
                     for s in spec.get("schedules", []) or []]
        chosen.append(spec["flow"].to_deployment(
            name=spec["name"], description=spec.get("description"), tags=spec.get("tags"),
            parameters=spec.get("parameters") or {}, schedules=schedules or None))
    if not chosen:
        raise ValueError(f"{prefect_yaml}: no process-pool deployment matches {only}")
    return chosen
