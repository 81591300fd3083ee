"""The session's Prefect server for tests: ``bertpipe server`` on a free port of 127.0.0.1 (API
and UI, its own PREFECT_HOME and SQLite, the database a copy of a migrated one kept in the cache),
and the one way tests stop a process group.

    with local_prefect_server(tmp_path) as server: ...   # server.api, server.ui, server.home

Not a test module: conftest.py (the session's server) and the tests that start processes or read
the pipeline's runs and artifacts import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
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


def stop_process_group(*procs: subprocess.Popen, timeout: float = 30) -> None:
    """Stop processes started with ``start_new_session=True`` and their children, all at once:
    SIGINT (Prefect's servers and workers and Dask's shut down cleanly on it), SIGTERM, then
    SIGKILL, each with a bounded wait. Never raises: a teardown must not fail a test whose
    assertions passed."""
    left = list(procs)
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        for proc in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        for proc in list(left):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                left.remove(proc)
        if not left:
            return


@dataclass(frozen=True)
class PrefectServer:
    """A running server: its API (``PREFECT_API_URL``), the UI's address, its home and its log."""

    api: str
    ui: str
    home: Path
    log: Path


def database_template() -> Path:
    """Where a just-started server's database (every migration applied, the block types
    registered, nothing else) is kept for this Prefect version, beside the samples."""
    from importlib.metadata import version

    base = Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe"))
    return base / f"prefect-{version('prefect')}-fresh.db"


def save_database(db: Path, to: Path) -> None:
    """A consistent copy of a live SQLite database (the backup API), put in place atomically."""
    import sqlite3

    to.parent.mkdir(parents=True, exist_ok=True)
    part = to.with_name(f"{to.name}.{os.getpid()}.part")
    src, dst = sqlite3.connect(db), sqlite3.connect(part)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    os.replace(part, to)


@contextlib.contextmanager
def local_prefect_server(home: Path, timeout: float = 180) -> Iterator[PrefectServer]:
    """Start ``bertpipe server`` as a user does, wait for /api/health, yield it, stop it (and only it).

    The server starts on a copy of :func:`database_template` when there is one: a new SQLite
    database costs over 100 Alembic migrations (about 12 CPU-s, over half the start)."""
    home.mkdir(parents=True, exist_ok=True)
    template = database_template()
    from_template = template.exists()
    if from_template:
        shutil.copyfile(template, home / "prefect.db")
    port = free_port()
    bertpipe = str(Path(sys.executable).with_name("bertpipe"))
    log_path = home / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([bertpipe, "server", "--port", str(port)], env=server_env(home), cwd=home,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ui = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                if from_template:  # the next start migrates a new database and keeps that instead
                    template.unlink(missing_ok=True)
                raise RuntimeError(f"prefect server exited {proc.returncode}: " + log_path.read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{ui}/api/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                if from_template:
                    template.unlink(missing_ok=True)
                raise TimeoutError(f"prefect server on {ui} not healthy after {timeout}s")
            time.sleep(0.5)
        if not from_template:
            save_database(home / "prefect.db", template)
        yield PrefectServer(api=f"{ui}/api", ui=ui, home=home, log=log_path)
    finally:
        drain_prefect_workers()
        # The CLI runs uvicorn as a child: stop the whole process group this fixture started.
        stop_process_group(proc)
        log.close()


def pipeline_flow_runs(client, tag: str) -> list:
    """(flow name, flow run) of every run that carries ``tag``: the pipeline's and its stages'."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
    names = {f.id: f.name for f in client.read_flows()}
    return [(names[r.flow_id], r) for r in runs]


def pipeline_artifact(client, tag: str, key: str, parsed: bool = True):
    """The newest artifact ``key`` made by one of the runs tagged ``tag``: its data (a table
    parsed), or the artifact itself."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    ids = [r.id for _, r in pipeline_flow_runs(client, tag)]
    found = client.read_artifacts(artifact_filter=ArtifactFilter(
        key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=ids)),
        sort=ArtifactSort.CREATED_DESC)
    assert found, f"no artifact {key!r}"
    if not parsed:
        return found[0]
    data = found[0].data
    return json.loads(data) if found[0].type == "table" and isinstance(data, str) else data


def latest_artifacts() -> dict:
    """The data of the newest artifact of every key on the server this process uses (tables
    parsed), for a test that reads back what the flow it just ran published."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts()
    return {a.key: json.loads(a.data) if a.type == "table" and isinstance(a.data, str) else a.data
            for a in found}
