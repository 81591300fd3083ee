"""Prefect's own output off the terminal: its warnings and its temporary server's log go to a file.

    with prefect_messages_to_log() as log: bert_pipeline(cfg)

Where no ``PREFECT_API_URL`` is set, Prefect starts a temporary server on its first API call and
lets it write to the terminal, its own tracebacks included. Started here first, with its output in
``$PREFECT_HOME/logs/bertpipe-<UTC time>-<pid>.log``, it is the one Prefect then uses; one log line
names the file. Warnings raised inside Prefect's package go to the same file; everything else
(our lines, the flow and task runs' log lines) stays where it was.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path


def prefect_log_file() -> Path:
    """Where this command's Prefect warnings and temporary server output go."""
    from prefect.settings import PREFECT_HOME

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(PREFECT_HOME.value()).expanduser() / "logs" / f"bertpipe-{stamp}-{os.getpid()}.log"


@contextlib.contextmanager
def _fds_to(log: Path) -> Iterator[None]:
    # A process started in here writes its stdout and stderr to ``log``.
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "ab") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _start_temporary_server(log: Path) -> None:
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return
    server = SubprocessASGIServer()
    if server.running:
        return
    with _fds_to(log):
        server.start()
    logging.getLogger("prefect").info(
        "Started a temporary Prefect server on %s (`bertpipe server` keeps one with its UI); its "
        "log and Prefect's warnings: %s", server.address, log)


@contextlib.contextmanager
def prefect_messages_to_log() -> Iterator[Path]:
    """Prefect's own warnings and its temporary server's output go to :func:`prefect_log_file`;
    our lines and the runs' log lines stay on the terminal."""
    import prefect

    log = prefect_log_file()
    log.parent.mkdir(parents=True, exist_ok=True)
    shown = warnings.showwarning
    prefect_dir = str(Path(prefect.__file__).parent)

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if str(filename).startswith(prefect_dir):
            with open(log, "a", encoding="utf-8") as out:
                out.write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        _start_temporary_server(log)
        yield log
    finally:
        warnings.showwarning = shown
