"""A real ``prefect server start`` on 127.0.0.1 (free port, own PREFECT_HOME and SQLite) for slow tests.

    with local_prefect_server(tmp_path) as api_url: ...

Not a test module: test_pipeline.py and test_deployments.py import it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


def drain_prefect_workers() -> None:
    """Flush and stop this process's Prefect log and event workers while their server still runs.

    They are process-wide singletons holding a client for the server they started with; left
    running after that server stops, a later ``prefect_test_harness`` waits forever draining them.
    """
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        for result in (APILogWorker.drain_all(), EventsWorker.drain_all()):
            if inspect.isawaitable(result):
                await result

    run_coro_as_sync(drain())


def stop_process_group(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Stop a process started with ``start_new_session=True`` and its children the way Prefect's
    servers and workers expect (SIGTERM, a bounded wait, then SIGKILL). Never raises: a teardown
    must not fail a test whose assertions passed."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 30)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def local_prefect_server(home: Path, timeout: float = 180) -> Iterator[str]:
    """Start the server, wait for /api/health, yield the API URL, stop it (and only it)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    prefect = str(Path(sys.executable).with_name("prefect"))
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"],
        env=server_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited {proc.returncode}: "
                                   + (home / "server.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefect server on {url} not healthy after {timeout}s")
            time.sleep(0.5)
        yield url
    finally:
        drain_prefect_workers()
        # The CLI runs uvicorn as a child: stop the whole process group this fixture started.
        stop_process_group(proc)
        log.close()
