"""Run every benchmark in this folder, each in a bounded time, and print one table: measure,
ours, reference, ratio.

    make bench                      # = python -m benchmarks.run_all --samples samples
    python -m benchmarks.run_all --only clean,instances

Each `benchmarks/speed/bench_<name>.py` measures ours and its reference side by side in one run and
writes `bench-results/<name>.json` = {"rows": [{"measure", "ours", "reference", "ratio", "unit"}]}.
This script runs each as a module (`python -m benchmarks.speed.bench_<name>`, from the repository root,
with `BERTPIPE_SAMPLES` set to the sample folder), one after another (never in parallel: they
time themselves), gathers the JSON files, adds the machine they ran on, prints the table and
writes `bench-results/all.json`. A benchmark that fails or runs past its time limit is reported
as failed with its exit code; the others still run.

Most benchmarks run at their own defaults. Three run here at a bounded setting (:data:`SETTINGS`);
their full runs (the quality protocol and the full scale run take hours) have commands of their own:

    bench_parity    60 steps, 2 seeds         full: python -m benchmarks.speed.bench_parity
    quality         score --quick (bookkeeping)  full: make quality-v3
    bench_scale     x1 of the sample only     full: make bench-scale (x1, x10, x30)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "bench-results"


@dataclass(frozen=True)
class Setting:
    """How `make bench` runs one benchmark: its arguments, its time limit in seconds, and the
    JSON file it writes, with or without rows for the table."""

    args: tuple[str, ...] = ()
    timeout: int = 1800
    result: str | None = None  # default: <name>.json
    table: bool = True  # False: the file records a check, not figures (status from the exit code)


# The benchmarks that are not run at their own defaults, with why.
SETTINGS: dict[str, Setting] = {
    # The learning-parity checks on a short run: the dropout-0 gap and a Welch test over 2 seeds
    # (its own 300 steps and 3 seeds cost about seven times as much).
    "parity": Setting(("--steps", "60", "--warmup", "6", "--eval-every", "20", "--seeds", "2",
                       "--eval-rows", "256"), timeout=1200),
    # The protocol's bookkeeping on tiny data; the protocol itself is `make quality-v3` (hours).
    "quality": Setting(("score", "--protocol", "v2", "--quick", "--work", str(RESULTS / "quality-quick"), "--output",
                        str(RESULTS / "quality-quick.json"), "--plot", ""),
                       timeout=1200, result="quality-quick.json", table=False),
    # Every Beam stage at x1 of the sample (which needs no distinct text); x10 and x30 are
    # `make bench-scale`.
    "scale": Setting(("--sizes", "1", "--no-distinct"), timeout=1800),
}


# Benchmarks that are a package rather than a speed/bench_<name>.py module.
MODULES = {"quality": "benchmarks.quality"}


def discover(only: set[str] | None) -> list[str]:
    names = sorted([*(p.stem.removeprefix("bench_") for p in (HERE / "speed").glob("bench_*.py")), *MODULES])
    return [n for n in names if only is None or n in only]


def command(name: str) -> list[str]:
    """The command that runs one benchmark: as a module of this package, so that
    ``benchmarks`` is ours even where an installed distribution ships a package of that name."""
    module = MODULES.get(name, f"benchmarks.speed.bench_{name}")
    return [sys.executable, "-m", module, *SETTINGS.get(name, Setting()).args]


def run_one(name: str, samples: str, timeout: int | None = None) -> dict:
    """Run one benchmark in its own process from the repository root; return its status and rows."""
    setting = SETTINGS.get(name, Setting())
    out = RESULTS / (setting.result or f"{name}.json")
    out.unlink(missing_ok=True)
    cmd = command(name)
    limit = timeout or setting.timeout
    print(f"\n=== bench_{name} (at most {limit} s): {' '.join(cmd)}", flush=True)
    env = {**os.environ, "BERTPIPE_SAMPLES": str(Path(samples).resolve())}
    start = time.perf_counter()
    # Its own session, so that a benchmark over its limit is stopped with every process it
    # started (Beam workers, a Dask cluster, a reference in its own venv), not only the first.
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = -1
    seconds = round(time.perf_counter() - start, 1)
    rows = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    written = bool(rows) or (not setting.table and out.exists())
    if code == -1:
        status = f"failed (over {limit} s)"
    else:
        status = "ok" if code == 0 and written else (f"failed (exit {code})" if code else "no results")
    return {"name": name, "status": status, "seconds": seconds, "rows": rows}


def collect(name: str) -> dict:
    """A saved run's results, as run_one would have returned them."""
    setting = SETTINGS.get(name, Setting())
    out = RESULTS / (setting.result or f"{name}.json")
    rows = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    written = bool(rows) or (not setting.table and out.exists())
    return {"name": name, "status": "ok" if written else "no results", "seconds": None, "rows": rows}


def fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def table(results: list[dict]) -> str:
    lines = ["| benchmark | measure | ours | reference | ratio | unit |", "|---|---|---|---|---|---|"]
    for res in results:
        if not res["rows"]:
            seconds = f" in {res['seconds']:.0f} s" if res.get("seconds") is not None else ""
            lines.append(f"| {res['name']} | {res['status']}{seconds} | | | | |")
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
    parser.add_argument("--timeout", type=int, default=None,
                        help="Seconds per benchmark (default: each benchmark's own limit in SETTINGS, else 1800).")
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
    print("\n" + "\n".join(f"{r['name']:>14}: {r['status']}"
                             + (f", {r['seconds']:.0f} s" if r["seconds"] is not None else "") for r in results))
    (RESULTS / "all.json").write_text(json.dumps({"machine": info, "results": results}, indent=2))
    (RESULTS / "all.md").write_text(f"Machine: {info}\n\n{report}\n")
    print(f"\nSaved {RESULTS / 'all.json'} and {RESULTS / 'all.md'}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
