"""A check beside the quality protocol, not part of it: each arm of ``bench_quality`` fine-tuned
at the *other* arm's chosen setting, on the protocol's subsamples and seeds, so that a gain can be
told apart from one arm's setting failing at few labels.

    python -m benchmarks.quality_crossover --work /work/quality-runs --task sentiment --sizes 100,300

Reads the arms, settings and checkpoints from ``bench-results/quality.json``; jobs go to the
protocol's cache under keys of their own; prints macro-F1 per run and size.
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks.bench_quality import CACHE_ARCHIVE, RESULTS, Cache, finetune_jobs, load_tasks
from benchmarks.common import samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--sizes", default="100,300")
    parser.add_argument("--result", default=str(RESULTS / "quality.json"))
    parser.add_argument("--output", default=str(RESULTS / "quality-crossover.json"))
    args = parser.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    task, parts = load_tasks(samples(), False)[args.task]
    sizes = [int(s) for s in args.sizes.split(",")]
    arms = {a["arm"]: a for a in result["arms"] if a["arm"] == "B" or a["arm"].startswith("A ")}
    a_names = [n for n in arms if n.startswith("A ")]
    if len(a_names) != 1 or "B" not in arms or any(args.task not in a["settings"] for a in arms.values()):
        raise SystemExit(f"{args.result}: needs arm B and one arm A with a setting for {args.task}; "
                         "run bench_quality until both have finished a run")
    (a_name,) = a_names
    swap = {"B": arms[a_name]["settings"][args.task]["selected"], a_name: arms["B"]["settings"][args.task]["selected"]}
    cache = Cache(Path(args.work) / "cache", reuse=True, archive=CACHE_ARCHIVE)
    out = {"task": args.task, "sizes": sizes, "runs": []}
    with ProcessPoolExecutor(1) as pool:
        for name, arm in arms.items():
            for run in (r for r in arm["runs"] if args.task in r.get("curve", {})):
                key = {"crossover": name, "seed": run["seed"], "checkpoint": run["checkpoint"]}
                jobs = finetune_jobs(Path(run["checkpoint"]), key, task, parts, swap[name], [(s, 5) for s in sizes])
                values = cache.run(pool, jobs, f"{name} seed {run['seed']} at the other arm's setting")
                by_size = {s: statistics.fmean(v["macro_f1"] for (k, _, _), v in zip(jobs, values, strict=True)
                                               if k["size"] == str(s)) for s in sizes}
                own = {s: statistics.fmean(j["macro_f1"] for j in run["curve"][args.task][str(s)]) for s in sizes}
                out["runs"].append({"arm": name, "seed": run["seed"], "setting": swap[name], "macro_f1": by_size,
                                    "own_setting_macro_f1": own})
                print(f"{name} seed {run['seed']}: at {swap[name]} {by_size}; at its own {own}", flush=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
