"""Prefect's own output off the terminal: its warnings and its temporary server's log go to a file.

    with prefect_messages_to_log() as log: bert_pipeline(cfg)

Where no ``PREFECT_API_URL`` is set, Prefect starts a temporary server on its first API call and
lets it write to the terminal, its own tracebacks included. Started here first, with its output in
``$PREFECT_HOME/logs/bertpipe-<UTC time>-<pid>.log``, it is the one Prefect then uses; one log line
names the file. Warnings raised inside Prefect's package go to the same file; everything else
(our lines, the flow and task runs' log lines) stays where it was.

The server runs detached from the terminal (setsid) and ends with this process; a stop signal stops it once
the stopped runs are recorded (:func:`stop_temporary_server`, ``bert_core.stopping``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


class _OwnSession:
    """``subprocess`` as Prefect's server module sees it while it starts the temporary server:
    the server runs detached from the terminal (setsid), so a terminal's Ctrl-C reaches this process first,
    and it ends if this process is killed (bert_core.stopping)."""

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 (subprocess's name)
        from bert_core.stopping import end_with_parent

        return subprocess.Popen(*args, start_new_session=True,
                                preexec_fn=functools.partial(end_with_parent, os.getpid()), **kwargs)


def stop_temporary_server(drain_s: float = 10.0) -> None:
    """Send the run's logs and events (for up to ``drain_s`` seconds each), then stop the
    temporary server this process started; nothing when there is none."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if not server.running:
        return
    APILogWorker.drain_all(timeout=drain_s)
    EventsWorker.drain_all(timeout=drain_s)
    server.stop()


def _start_temporary_server(log: Path) -> None:
    import prefect.server.api.server as server_module
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    from bert_core import stopping

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return
    server = server_module.SubprocessASGIServer()
    if server.running:
        return
    with _fds_to(log):
        server_module.subprocess = _OwnSession  # type: ignore[assignment]
        try:
            server.start()
        finally:
            server_module.subprocess = subprocess
    # A stop signal ends it after the run's crash is recorded (Prefect's own atexit hook does
    # not run on a signal, and would log after the command's last line).
    stopping.at_last(functools.partial(stop_temporary_server, 3.0))
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
