"""Run every benchmark in this folder, each in a bounded time, and print one table: measure,
ours, reference, ratio.

    make bench                      # = python -m benchmarks.run_all --samples samples
    python -m benchmarks.run_all --only clean,instances

Each benchmark runs as a module from the repository root with ``BERTPIPE_SAMPLES`` set, one after
another (they time themselves), and writes ``bench-results/<name>.json``; a failed one is reported
with its exit code and the others still run. The table and the machine go to
``bench-results/all.json``. A few run here at a bounded setting (:data:`SETTINGS`); their full runs
have commands of their own (``make bench-scale``, ``make quality-v3``, ``bench_parity``'s defaults).
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
    """Run one benchmark in its own process from the repository root; return its status and rows
    ("ok" where it wrote what it should: rows, or its file for a check)."""
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
    rows = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    status = "ok" if rows or (not setting.table and out.exists()) else "no results"
    if code:
        status = f"failed (over {limit} s)" if code == -1 else f"failed (exit {code})"
    return {"name": name, "status": status, "seconds": round(time.perf_counter() - start, 1), "rows": rows}


def fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def table(results: list[dict]) -> str:
    lines = ["| benchmark | measure | ours | reference | ratio | unit |", "|---|---|---|---|---|---|"]
    for res in results:
        if not res["rows"]:
            lines.append(f"| {res['name']} | {res['status']} in {res['seconds']:.0f} s | | | | |")
        for row in res["rows"]:
            ratio = "" if row.get("ratio") is None else fmt(row["ratio"]) + "x"
            lines.append(f"| {res['name']} | {row['measure']} | {fmt(row.get('ours'))} | {fmt(row.get('reference'))} "
                         f"| {ratio} | {row.get('unit', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--samples", default="samples", help="Sample data folder (bertpipe samples fetch).")
    parser.add_argument("--only", default="", help="Comma-separated benchmark names.")
    parser.add_argument("--timeout", type=int, default=None,
                        help="Seconds per benchmark (default: each benchmark's own limit in SETTINGS, else 1800).")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    names = discover(only)
    if not names:
        print(f"no benchmarks match {args.only!r}; have: {', '.join(discover(None))}", file=sys.stderr)
        return 2
    results = [run_one(name, args.samples, args.timeout) for name in names]
    info = machine()
    report = table(results)
    print(f"\nMachine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, torch {info['torch']}")
    print(report)
    print("\n" + "\n".join(f"{r['name']:>14}: {r['status']}, {r['seconds']:.0f} s" for r in results))
    (RESULTS / "all.json").write_text(json.dumps({"machine": info, "results": results}, indent=2))
    (RESULTS / "all.md").write_text(f"Machine: {info}\n\n{report}\n")
    print(f"\nSaved {RESULTS / 'all.json'} and {RESULTS / 'all.md'}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
