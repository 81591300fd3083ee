"""Which failures are worth a retry: infrastructure hiccups yes, bad config or bad data never.

    @task(retries=2, retry_condition_fn=retry_on_infrastructure)

A rendezvous timeout, a dropped connection or a preempted node can go away on a second try; a
validation error, a missing input or a checksum mismatch fails the same way every time, so
retrying it only hides the message for longer.
"""

from __future__ import annotations

import errno
import re
import subprocess
from typing import Any

# Messages of launcher / collective / network failures (DeepSpeed, torch.distributed, gloo, NCCL,
# gcsfs, HTTP) that say "the machine or the network", not "the job".
_INFRA_MESSAGE = re.compile(
    r"rendezvous|DistNetworkError|timed? ?out|connection (reset|refused|aborted)|broken pipe|"
    r"NCCL (error|WARN)|gloo.*(timeout|connect)|address already in use|"
    r"no route to host|temporar(y|ily) (failure|unavailable)|HTTP 5\d\d|503 Service|preempt",
    re.IGNORECASE,
)
# A full, read-only or forbidden disk stays so on a second try.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
_INFRA_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                 errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRINUSE}


def is_infrastructure_error(exc: BaseException | None) -> bool:
    """True for failures of the machine, network or launcher; False for config and data errors."""
    if exc is None:
        return False
    # Config, validation and data errors are never retried, whatever their message says.
    from pydantic import ValidationError

    from bert_core.config import ConfigError
    from bert_core.storage import UnfinishedWriteError

    if isinstance(exc, (ConfigError, ValidationError, UnfinishedWriteError, FileNotFoundError,
                        KeyError, TypeError)):
        return False
    if type(exc).__name__ in {"ChecksumError"}:
        return False
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return False
    # The launcher already told a killed rank or a failed rendezvous from a config error.
    from bert_core.pretrain.launch import LaunchConfigError, LaunchInfraError

    if isinstance(exc, LaunchInfraError):
        return True
    if isinstance(exc, LaunchConfigError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _INFRA_ERRNOS:
        return True
    text = str(exc)
    if isinstance(exc, subprocess.CalledProcessError):
        text += " " + _as_text(exc.stderr) + " " + _as_text(exc.output)
    if _INFRA_MESSAGE.search(text):
        return True
    return is_infrastructure_error(exc.__cause__) if exc.__cause__ is not exc else False


def _as_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")[-4000:]
    return str(value or "")[-4000:]


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
