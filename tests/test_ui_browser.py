"""What a user sees: `bertpipe server --port N` on a free port, a flow run against it, and the
flow runs page opened in a real headless Chromium (playwright-core from node, tests/ui/shoot.cjs).

`make browser` installs Chromium and playwright-core; CI (CI=true) fails without them, a
developer's machine skips with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
NODE_MODULES = Path(os.environ.get("BERTPIPE_NODE_MODULES", REPO / ".venv" / "node" / "node_modules"))
SHOOT = REPO / "tests" / "ui" / "shoot.cjs"

FLOW = """
import sys
from prefect import flow

@flow(name="ui-check", flow_run_name=sys.argv[1])
def ui_check() -> int:
    return 1

ui_check()
"""


def _need_browser() -> None:
    missing = [what for what, ok in (
        (f"chromium at {CHROMIUM}", Path(CHROMIUM).exists()),
        ("node", shutil.which("node") is not None),
        (f"playwright-core in {NODE_MODULES}", (NODE_MODULES / "playwright-core").is_dir()),
    ) if not ok]
    if missing:
        reason = "browser test needs " + ", ".join(missing) + ": run `make browser`"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (Prefect's server shuts down cleanly on it), a bounded wait, then SIGKILL the
    group. Never raises: teardown must not fail a test whose assertions passed."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


def _get(url: str) -> bytes | None:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
        return resp.read() if resp.status == 200 else None
    return None


@pytest.mark.slow
def test_flow_run_shows_in_the_ui_of_a_server_on_any_port(tmp_path):
    _need_browser()
    from prefect_server import free_port, server_env

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = server_env(tmp_path / "prefect")
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([str(Path(sys.executable).with_name("bertpipe")), "server", "--port", str(port)],
                              env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while _get(f"{base}/api/health") is None:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"no server on {base} after 180 s"
            time.sleep(1)
        # The UI in the browser calls the API on this port, not on 4200.
        assert json.loads(_get(f"{base}/ui-settings"))["api_url"] == f"{base}/api"

        run_name = f"ui-check-{uuid.uuid4().hex[:8]}"
        subprocess.run([sys.executable, "-c", FLOW, run_name], env={**env, "PREFECT_API_URL": f"{base}/api"},
                       check=True, timeout=180, capture_output=True)

        shot = tmp_path / "runs.png"
        seen = subprocess.run(["node", str(SHOOT), f"{base}/runs", str(shot), run_name, "90"],
                              env={**os.environ, "NODE_PATH": str(NODE_MODULES), "CHROMIUM": CHROMIUM},
                              capture_output=True, text=True, timeout=240)
        assert seen.returncode == 0, seen.stderr[-2000:]
        page = json.loads(seen.stdout)
        assert run_name in page["text"], page["text"][:2000]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        _stop(server)
        log.close()
