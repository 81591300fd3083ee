"""`bertpipe server` and `bertpipe serve` as a user runs them: a real server on 127.0.0.1, then the
deployments of infra/prefect.yaml served from a process with their schedules."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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
def test_server_prints_its_address_and_serve_registers_the_monthly_refresh(prefect_api):
    """The session's server is ``bertpipe server --port N`` (tests/prefect_server.py)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect_server import server_env, stop_process_group

    from flows.tools.render import REFRESH_CRON

    assert prefect_api.log.read_text().splitlines()[0] == f"Prefect UI:  {prefect_api.ui}"
    # the UI in the browser calls the API on this port, not on 4200
    with urllib.request.urlopen(f"{prefect_api.ui}/ui-settings", timeout=10) as resp:
        assert json.loads(resp.read())["api_url"] == prefect_api.api

    bertpipe = str(Path(sys.executable).with_name("bertpipe"))
    serve = subprocess.Popen([bertpipe, "serve", "--only", "refresh/monthly"], cwd=REPO,
                             env=server_env(prefect_api.home, prefect_api.api), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with get_client(sync_client=True) as client:
            only_monthly = DeploymentFilter(name=DeploymentFilterName(any_=["monthly"]))
            (deployment,) = _wait(lambda: client.read_deployments(deployment_filter=only_monthly), 120,
                                  "served deployment")
            assert deployment.entrypoint.endswith("flows/refresh.py:refresh")
            (schedule,) = deployment.schedules
            assert schedule.schedule.cron == REFRESH_CRON and schedule.active
            assert deployment.parameters["config"]["refresh"]["lang"] == "en"
    finally:
        stop_process_group(serve)


CHATTER = ("Python sdk harness starting", "State channel established", "No semi_persistent_directory",
           "Creating insecure control channel", "Done consuming work")


def test_harness_chatter_is_dropped_and_other_lines_pass(capfd):
    """Worker processes write to the inherited stderr, as Beam's do: only the chatter goes."""
    from beam_jobs.job import harness_chatter_dropped

    worker = ("import sys\n"
              "for line in ['INFO:__main__:Python sdk harness starting.',\n"
              "             'INFO:apache_beam.runners.worker.sdk_worker:State channel established.',\n"
              "             'WARNING:__main__:No semi_persistent_directory found',\n"
              "             'WARNING:bert_core.corpus.books:book.txt: no sentences',\n"
              "             'Traceback (most recent call last):', 'ValueError: bad page']:\n"
              "    print(line, file=sys.stderr)\n")
    with harness_chatter_dropped():
        subprocess.run([sys.executable, "-c", worker], check=True)
        os.write(2, b"ours\n")  # through fd 2, as our stderr is outside pytest (its capfd bypasses it)
    err = capfd.readouterr().err.splitlines()
    assert err == ["WARNING:bert_core.corpus.books:book.txt: no sentences",
                   "Traceback (most recent call last):", "ValueError: bad page", "ours"]


@pytest.mark.slow
def test_corpus_command_with_worker_processes_prints_no_harness_chatter(samples_dir, tmp_path):
    bertpipe = str(Path(sys.executable).with_name("bertpipe"))
    done = subprocess.run([bertpipe, "corpus", "--books", str(samples_dir / "books" / "*"), "--wikipedia",
                           str(samples_dir / "wikipedia" / "*"), "--output", str(tmp_path / "corpus"),
                           "--workers", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "documents" in done.stdout
    noise = [line for line in done.stderr.splitlines() if any(c in line for c in CHATTER)]
    assert noise == []


def test_server_env_points_the_ui_at_its_own_port(monkeypatch):
    from flows.cli.server import server_env

    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")
    monkeypatch.delenv("PREFECT_UI_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_SERVER_UI_API_URL", raising=False)
    assert server_env("127.0.0.1", 4321)["PREFECT_UI_API_URL"] == "http://127.0.0.1:4321/api"
    assert server_env("0.0.0.0", 4321)["PREFECT_UI_API_URL"] == "http://127.0.0.1:4321/api"
    monkeypatch.setenv("PREFECT_UI_API_URL", "https://prefect.example.org/api")
    assert server_env("0.0.0.0", 4321)["PREFECT_UI_API_URL"] == "https://prefect.example.org/api"
