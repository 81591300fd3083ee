"""The Prefect retry condition: retry a task only when its failure is the infrastructure's.

    @task(retries=2, retry_condition_fn=retry_on_infrastructure)

The rule itself is ``bert_core.failures``, which the launcher and the per-rank loop follow too.
"""

from __future__ import annotations

from typing import Any

from bert_core.failures import is_infrastructure_error


def retry_on_infrastructure(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn`` for Prefect tasks: retry only infrastructure errors."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            result = state.result(raise_on_failure=False)
        except Exception as err:  # the result itself could not be read: treat as its error
            result = err
        exc = result if isinstance(result, BaseException) else None
    return is_infrastructure_error(exc)
