"""Run every benchmark in this folder and print one table: measure, ours, reference, ratio.

    make bench                      # = python -m benchmarks.run_all --samples samples

Each script runs as `python benchmarks/bench_<name>.py` with `BERTPIPE_SAMPLES` set to the
sample folder.
    python -m benchmarks.run_all --only clean,instances

Each `benchmarks/bench_<name>.py` measures ours and its reference side by side in one run and
writes `bench-results/<name>.json` = {"rows": [{"measure", "ours", "reference", "ratio", "unit"}]}.
This script runs them one after another (never in parallel: they time themselves), gathers the
JSON files, adds the machine they ran on, prints the table and writes `bench-results/all.json`.
A benchmark that fails is reported as failed with its exit code; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine

HERE = Path(__file__).resolve().parent
RESULTS = Path("bench-results")
# Benchmarks that take hours at their own defaults run here at a budget that fits one `make bench`
# (run them alone for the full protocol), with the time they need.
SETTINGS: dict[str, tuple[list[str], int]] = {
    "quality": (["--budgets", "60", "--reuse"], 4 * 3600),  # the protocol at 60 CPU-minutes (resumes with --reuse)
    "scale": ([], 3 * 3600),  # every Beam stage at x1, x10, x30 of the sample
}


def discover(only: set[str] | None) -> list[str]:
    names = sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    return [n for n in names if only is None or n in only]


def run_one(name: str, samples: str, timeout: int) -> dict:
    """Run one benchmark script in its own process; return its status and rows."""
    out = RESULTS / f"{name}.json"
    out.unlink(missing_ok=True)
    extra, timeout = SETTINGS.get(name, ([], timeout))
    cmd = [sys.executable, str(HERE / f"bench_{name}.py"), *extra]
    print(f"\n=== bench_{name}: {' '.join(cmd)}", flush=True)
    env = {**os.environ, "BERTPIPE_SAMPLES": str(Path(samples).resolve())}
    start = time.perf_counter()
    try:
        code = subprocess.run(cmd, timeout=timeout, env=env).returncode
    except subprocess.TimeoutExpired:
        code = -1
    seconds = round(time.perf_counter() - start, 1)
    rows = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    status = "ok" if code == 0 and rows else (f"failed (exit {code})" if code else "no results")
    return {"name": name, "status": status, "seconds": seconds, "rows": rows}


def collect(name: str) -> dict:
    """A saved run's results, as run_one would have returned them."""
    out = RESULTS / f"{name}.json"
    rows = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    return {"name": name, "status": "ok" if rows else "no results", "seconds": None, "rows": rows}


def fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def table(results: list[dict]) -> str:
    lines = ["| benchmark | measure | ours | reference | ratio | unit |", "|---|---|---|---|---|---|"]
    for res in results:
        if not res["rows"]:
            lines.append(f"| {res['name']} | {res['status']} | | | | |")
        for row in res["rows"]:
            ratio = row.get("ratio")
            lines.append(
                f"| {res['name']} | {row['measure']} | {fmt(row.get('ours'))} | "
                f"{fmt(row.get('reference'))} | {fmt(ratio) + 'x' if ratio is not None else ''} "
                f"| {row.get('unit', '')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--samples", default="samples", help="Sample data folder (bertpipe samples fetch).")
    parser.add_argument("--only", default="", help="Comma-separated benchmark names.")
    parser.add_argument("--timeout", type=int, default=1800, help="Seconds per benchmark.")
    parser.add_argument("--report-only", action="store_true",
                        help="Tabulate the bench-results/*.json already there; run nothing.")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    names = discover(only)
    if not names:
        print(f"no benchmarks match {args.only!r}; have: {', '.join(discover(None))}", file=sys.stderr)
        return 2
    if args.report_only:
        results = [collect(name) for name in names]
    else:
        results = [run_one(name, args.samples, args.timeout) for name in names]
    info = machine()
    report = table(results)
    print(f"\nMachine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, torch {info['torch']}")
    print(report)
    (RESULTS / "all.json").write_text(json.dumps({"machine": info, "results": results}, indent=2))
    (RESULTS / "all.md").write_text(f"Machine: {info}\n\n{report}\n")
    print(f"\nSaved {RESULTS / 'all.json'} and {RESULTS / 'all.md'}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
