"""benchmarks/run_all.py: each benchmark runs as a module of our package, under a time limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import run_all

ROOT = Path(__file__).resolve().parent.parent


def test_every_benchmark_runs_as_a_module_of_ours():
    names = run_all.discover(None)
    assert {"clean", "loader_resume", "parity", "quality", "scale", "sentences"} <= set(names)
    assert set(run_all.SETTINGS) <= set(names)
    for name in names:
        module = "benchmarks.quality" if name == "quality" else f"benchmarks.speed.bench_{name}"
        assert run_all.command(name)[:3] == [sys.executable, "-m", module]
    # The long protocols are bounded here; their full runs are left to their own targets.
    assert "--quick" in run_all.command("quality")
    assert run_all.command("scale")[3:5] == ["--sizes", "1"]


def test_every_bench_module_imports_from_the_repository_root():
    # As run_all runs them: from the repository root, where an installed distribution's own
    # top-level `benchmarks` package (pysbd ships one) must not shadow ours.
    modules = [run_all.command(name)[2] for name in run_all.discover(None)]
    code = ("import importlib, json, sys\n"
            f"mods = [importlib.import_module(m) for m in {modules!r}]\n"
            "print(json.dumps([m.__file__ for m in mods]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(Path(f).resolve().is_relative_to(ROOT / "benchmarks") for f in files)


def test_status_from_the_exit_code_the_rows_and_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    monkeypatch.setitem(run_all.SETTINGS, "check", run_all.Setting(table=False, timeout=60))

    def fake(script: str):
        monkeypatch.setattr(run_all, "command", lambda name: [sys.executable, "-c", script])

    rows = [{"measure": "m", "ours": 2.0, "reference": 1.0, "ratio": 2.0, "unit": "x"}]
    fake(f"import json, pathlib; pathlib.Path({str(tmp_path / 'fine.json')!r}).write_text(json.dumps({{'rows': {rows!r}}}))")
    assert run_all.run_one("fine", "samples")["status"] == "ok"
    fake("pass")
    assert run_all.run_one("fine", "samples")["status"] == "no results"
    fake("import sys; sys.exit(3)")
    assert run_all.run_one("fine", "samples")["status"] == "failed (exit 3)"
    # A check without table rows is ok once it has written its file.
    fake(f"import pathlib; pathlib.Path({str(tmp_path / 'check.json')!r}).write_text('{{}}')")
    assert run_all.run_one("check", "samples")["status"] == "ok"
    fake("import time; time.sleep(30)")
    result = run_all.run_one("slow", "samples", timeout=1)
    assert result["status"] == "failed (over 1 s)" and result["seconds"] < 20
