"""Which failures a retry can fix: the machine or the network, never the config, the data or a
full disk. The command line, the launcher, the per-rank loop, the download and the Prefect retry
condition all ask this module.

An error says its kind by its type: the config, data and checkpoint errors of every stage derive
from :class:`Refusal` (fix the input; a retry fails the same way) and a failed launch of the
infrastructure from :class:`InfrastructureError`. Errors of other libraries are told by their
type (``ConnectionError``, ``TimeoutError``, an ``OSError``'s errno) and, for the runtime errors
that torch.distributed, gloo, NCCL and HTTP clients raise, by their message.
"""

from __future__ import annotations

import errno
import http.client
import re
import subprocess
import urllib.error
from typing import Any

from pydantic import ValidationError


class Refusal(Exception):
    """Base of the errors of the config, the data or a checkpoint: fix the input, do not retry."""


class InfrastructureError(Exception):
    """Base of the errors of the machine, the network or the launcher: a retry may succeed."""


# Refused whatever their message says; a KeyError, TypeError or a failed validation is a bug
# or a bad input that fails the same way again.
REFUSED = (Refusal, FileNotFoundError)
NEVER_RETRIED = (*REFUSED, ValidationError, KeyError, TypeError)
# A full, read-only or forbidden disk stays so on a second try.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
INFRA_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRINUSE}
# Messages of launcher, collective and network failures (DeepSpeed, torch.distributed, gloo,
# NCCL, gcsfs, HTTP) that say "the machine or the network", not "the job". (DeepSpeed logs
# "sigkill_handler" on every failure, so signal names in the text say nothing.)
INFRA_MESSAGE = re.compile(
    r"rendezvous|DistNetworkError|timed out|Socket Timeout|"
    r"connection (reset|refused|aborted|closed by peer)|broken pipe|remote worker crash|"
    r"NCCL (error|WARN)|gloo.*(timeout|connect)|address already in use|EADDRINUSE|"
    r"no route to host|temporar(y|ily) (failure|unavailable)|HTTP 5\d\d|503 Service|preempt|"
    r"cannot connect to host|name or service not known|name resolution|nodename nor servname",
    re.IGNORECASE,
)
# Inside a rank, any error of the collectives means a peer died or the network broke.
_COMM_MESSAGE = re.compile(INFRA_MESSAGE.pattern + r"|gloo|NCCL|DistBackendError", re.IGNORECASE)


def refusal(err: BaseException) -> str | None:
    """The one-line message of an error a retry cannot fix (config, data, checkpoint, a full or
    read-only disk anywhere in its causes); None for anything else."""
    if isinstance(err, REFUSED):
        return " ".join(str(err).split())
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in DISK_ERRNOS:
            where = cause.filename or "the run folder"
            return (f"{where}: {cause.strerror}; free space or make it writable, then run again "
                    "(it resumes where it stopped)")
        cause = cause.__cause__ if cause.__cause__ is not cause else None
    return None


def says_infrastructure(text: str) -> bool:
    """A failed process's output names a failure of the machine or the network."""
    return bool(INFRA_MESSAGE.search(text))


def is_infrastructure_error(err: BaseException | None) -> bool:
    """True for failures of the machine, network or launcher; False for config and data errors."""
    if err is None or isinstance(err, NEVER_RETRIED) or refusal(err) is not None:
        return False
    if isinstance(err, urllib.error.HTTPError):  # the server's fault may pass; the request's will not
        return err.code >= 500 or err.code == 429
    if isinstance(err, (InfrastructureError, ConnectionError, TimeoutError, http.client.HTTPException)):
        return True
    if isinstance(err, OSError) and err.errno in INFRA_ERRNOS:
        return True
    text = str(err)
    if isinstance(err, subprocess.CalledProcessError):
        text += " " + _as_text(err.stderr) + " " + _as_text(err.output)
    if says_infrastructure(text):
        return True
    return is_infrastructure_error(err.__cause__) if err.__cause__ is not err else False


def is_infrastructure_exit(code: int, output: str) -> bool:
    """A process that failed with ``code`` was killed (a signal, the OOM killer) or says in its
    ``output`` that the machine or the network failed."""
    return code < 0 or code >= 128 or says_infrastructure(output)


def is_comm_error(err: BaseException) -> bool:
    """A collective failed on this rank: a peer rank died or the network broke (the peer has its
    own story)."""
    import torch.distributed as dist

    return isinstance(err, getattr(dist, "DistError", ())) or bool(_COMM_MESSAGE.search(str(err)))


def _as_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")[-4000:]
    return str(value or "")[-4000:]
