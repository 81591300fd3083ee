"""Sending one job to a deployment: a child flow run on its work pool, waited for."""

from __future__ import annotations

from typing import Any


def run_on_deployment(deployment: str, name: str, parameters: dict[str, Any], key: str) -> Any:
    """Run ``deployment`` as the child flow run ``name`` and wait; raise unless it completed.

    ``key`` names the job; with the task run's id and attempt it makes the idempotency key, so a
    re-sent request returns the same child run and a retry makes a new one.
    """
    from prefect.context import TaskRunContext
    from prefect.deployments import run_deployment

    ctx = TaskRunContext.get()
    if ctx:
        key = f"{key}#{ctx.task_run.id}#{ctx.task_run.run_count}"
    child = run_deployment(deployment, parameters=parameters, flow_run_name=name, idempotency_key=key,
                           poll_interval=2)
    if not child.state or not child.state.is_completed():
        raise RuntimeError(f"{name}: deployment run {child.name} ended "
                           f"{child.state.name if child.state else 'without a state'}")
    return child
