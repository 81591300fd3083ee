"""What a user sees: the session's `bertpipe server` and the pipeline's runs and results opened
in a real headless Chromium (playwright-core from node, tests/ui/shoot.cjs).

`make browser` installs Chromium and playwright-core; CI (CI=true) fails without them, a
developer's machine skips with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

# The whole pipeline runs once per test process (conftest's pipeline_run): with pytest-xdist
# every module that reads it runs on the same worker.
pytestmark = pytest.mark.xdist_group("pipeline")

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
NODE_MODULES = Path(os.environ.get("BERTPIPE_NODE_MODULES", REPO / ".venv" / "node" / "node_modules"))
SHOOT = REPO / "tests" / "ui" / "shoot.cjs"


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


def _shoot(url: str, shot: Path, expect: str) -> str:
    """The page's text once it shows ``expect``; a screenshot of it lands in ``shot``."""
    seen = subprocess.run(["node", str(SHOOT), url, str(shot), expect, "90"],
                          env={**os.environ, "NODE_PATH": str(NODE_MODULES), "CHROMIUM": CHROMIUM},
                          capture_output=True, text=True, timeout=240)
    assert seen.returncode == 0, seen.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(seen.stdout)["text"]


@pytest.mark.slow
def test_the_pipeline_shows_in_the_ui_by_name_with_scores_on_one_scale(prefect_api, pipeline_run, tmp_path):
    _need_browser()
    from prefect.client.orchestration import get_client
    from prefect_server import pipeline_artifact, pipeline_flow_runs

    with get_client(sync_client=True) as client:
        runs = pipeline_flow_runs(client, pipeline_run.tag)
        results = pipeline_artifact(client, pipeline_run.tag, "pipeline-finetune-results", parsed=False)
    flow_ids = {name: run.flow_id for name, run in runs}
    # each flow's page lists its runs by what they are: demo-<date>, pretrain/<version>
    for flow in ("bert-pipeline", "pretrain"):
        named = sorted(r.name for n, r in runs if n == flow)
        text = _shoot(f"{prefect_api.ui}/flows/flow/{flow_ids[flow]}", tmp_path / f"{flow}.png", named[0])
        assert all(name in text for name in named), (named, text[:2000])

    # the fine-tune results: every mean on the 0-100 scale, no score with more than one decimal
    text = _shoot(f"{prefect_api.ui}/artifacts/artifact/{results.id}", tmp_path / "results.png", "minilm")
    rows = json.loads(results.data) if isinstance(results.data, str) else results.data
    means = [r["mean"] for r in rows if "mean" in r]
    assert means and all(1 < m <= 100 for m in means), rows
    assert all(f"{m:g}" in text for m in means), text[:2000]
    assert not re.search(r"\b0\.\d{3,}\b", text), text[:2000]
