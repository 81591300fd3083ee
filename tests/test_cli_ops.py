"""`bertpipe server` and `bertpipe serve` as a user runs them: a real server on 127.0.0.1, then the
deployments of infra/prefect.yaml served from a process with their schedules."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if result := check():
                return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout}s")
        time.sleep(1)


@pytest.mark.slow
def test_server_prints_its_address_and_serve_registers_the_monthly_refresh(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_server import free_port, server_env

    from flows.render import REFRESH_CRON

    bertpipe = str(Path(sys.executable).with_name("bertpipe"))
    port = free_port()
    env = server_env(tmp_path / "prefect")
    server = subprocess.Popen([bertpipe, "server", "--port", str(port)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    serve = None
    try:
        first = server.stdout.readline().decode()
        assert first.strip() == f"Prefect UI:  http://127.0.0.1:{port}"
        api = f"http://127.0.0.1:{port}/api"
        _wait(lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 180, "server")

        serve = subprocess.Popen([bertpipe, "serve", "--only", "refresh-corpus/monthly"], cwd=REPO,
                                 env={**env, "PREFECT_API_URL": api}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            (deployment,) = _wait(client.read_deployments, 120, "served deployment")
            assert deployment.name == "monthly"
            assert deployment.entrypoint.endswith("flows/refresh.py:refresh_corpus")
            (schedule,) = deployment.schedules
            assert schedule.schedule.cron == REFRESH_CRON and schedule.active
            assert deployment.parameters["lang"] == "en" and "config" in deployment.parameters
    finally:
        if serve is not None:
            _stop(serve)
        _stop(server)
