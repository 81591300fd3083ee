"""The recipe choice: which of a protocol version's candidate recipes buys the most few-label
gain for its CPU-minutes. Each candidate trains through ``bertpipe pretrain``, as the test
phase's arm A does. Three steps (:func:`prepare`, :func:`pretrain_all`, :func:`evaluate`), each
resumed from what ``--work`` holds; ``prepare --quick`` runs them on tiny data and settings:

    python -m benchmarks.quality prepare  --protocol v3 --work W                 # corpora, instances, step counts
    python -m benchmarks.quality pretrain --protocol v3 --candidates --work W --seeds 42 --scale 0.25 --keep R
    python -m benchmarks.quality choose   --protocol v3 --work W --checkpoints R --choose FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.quality import build
from benchmarks.quality import choice as qc
from benchmarks.quality import corpus as quality_corpus
from benchmarks.quality.cache import Cache, run_cached, weights_digest
from benchmarks.quality.finetune import encoded, finetune
from benchmarks.quality.spec import CHOSEN, RECIPES, ROOT, Recipe, candidates, protocol, versions
from benchmarks.quality.tasks import load_tasks
from bert_core.finetune.data import subsample
from bert_core.pretrain.metrics import read_metrics
from bert_core.storage import sha256

REFERENCE = "chosen-on-k1"  # the recipe whose step count ``--chosen-steps`` gives
CALIBRATION_STEPS = 40  # as the test phase's calibration run
OPTIMIZER_FIELDS = ("about", "learning_rate", "warmup_fraction", "weight_decay")


def cost_key(recipe: Recipe) -> str:
    """What decides a step's cost: recipes equal in it (they differ in optimizer settings only)
    share one calibration."""
    return json.dumps({k: v for k, v in asdict(recipe).items() if k not in OPTIMIZER_FIELDS}, sort_keys=True)


def as_trained(recipe: Recipe, plan: dict) -> Recipe:
    """``recipe`` as the plan trains it: at the quick mode's batch when the plan is quick."""
    return replace(recipe, global_batch=plan["global_batch"]) if plan["quick"] else recipe


def prepare(work: Path, samples: Path, version: str, corpora: list[str], chosen_steps: int,
            quick: bool = False) -> dict:
    """Per candidate of ``version`` on ``corpora``: its corpus, instances and step count,
    ``chosen_steps`` (the protocol's for :data:`REFERENCE`) scaled by that recipe's CPU seconds a
    step over the candidate's, each cost from a short ``bertpipe pretrain`` run per
    :func:`cost_key` as the test phase calibrates (``quick``: the quick mode's step count for
    both). Writes the plan to ``work/choice/plan.json``."""
    proto = protocol(version, quick)
    chosen_steps, calibration_steps = (proto["steps"], proto["steps"]) if quick else (chosen_steps, CALIBRATION_STEPS)
    plan = {"candidates": version, "quick": quick, "global_batch": proto.get("global_batch"),
            "chosen_steps": chosen_steps, "calibration_steps": calibration_steps}
    names = [n for n, r in candidates(version).items() if r.corpus in corpora]
    if not names:
        raise SystemExit(f"--corpus {','.join(corpora)}: no candidate of {version} trains on it "
                         f"(corpora: {', '.join(quality_corpus.CORPORA)})")
    timed = {n: as_trained(RECIPES[n], plan) for n in [REFERENCE, *names]}
    parts = {n: p for n, (_, p) in load_tasks(samples, proto).items()}
    built = {c: quality_corpus.build(c, RECIPES[CHOSEN], work, samples, parts, quick=quick)
             for c in sorted({r.corpus for r in timed.values()})}
    instances = {n: build.instances_for(r, built[r.corpus].corpus, built[r.corpus].vocab, work / r.corpus)
                 for n, r in timed.items()}
    groups: dict[str, str] = {}  # cost key -> the recipe calibrated for it
    for name, recipe in timed.items():
        groups.setdefault(cost_key(recipe), name)
    per_step = {}
    for name in groups.values():
        run = work / "choice" / f"calibration-{name}{'-quick' if quick else ''}"
        build.pretrain(timed[name], instances[name], run, calibration_steps, ranks=1)
        per_step[name] = build.cpu_per_step(read_metrics(str(run)))
        print(f"calibrated {name}: {per_step[name]:.3f} CPU-s a step", flush=True)
    costs = {n: per_step[groups[cost_key(r)]] for n, r in timed.items()}
    plan |= {"cpu_seconds_per_step": costs,
             "calibrated": {n: [m for m, r in timed.items() if cost_key(r) == key] for key, n in groups.items()},
             "steps": {n: round(chosen_steps * costs[REFERENCE] / costs[n]) for n in names},
             "corpus": {n: timed[n].corpus for n in names}, "instances": {n: str(instances[n]) for n in names}}
    (work / "choice").mkdir(parents=True, exist_ok=True)
    (work / "choice" / "plan.json").write_text(json.dumps(plan, indent=1))
    return plan


def read_plan(work: Path, version: str) -> dict:
    """The plan :func:`prepare` left in ``work/choice``, made for ``version``'s candidates."""
    plan_file = work / "choice" / "plan.json"
    if not plan_file.exists():
        raise SystemExit(f"{plan_file} is missing: run benchmarks.quality prepare --work {work} first")
    plan = json.loads(plan_file.read_text())
    if plan["candidates"] != version:
        raise SystemExit(f"{work} was prepared for {plan['candidates']}'s candidates, not --protocol {version}'s")
    return plan


def pretrain_all(keep: Path, plan: dict, seeds: list[int], scale: float = 1.0) -> int:
    """Every candidate of the plan x seed through ``build.pretrain``, side by side, for the plan's
    step count (times ``scale``), each run a folder ``keep/<recipe>-seed<S>``; a finished run is
    not run again. A run that fails is reported and left out, and the status is 1."""
    runs = [(n, s, keep / f"{n}-seed{s}") for n in plan["steps"] for s in seeds]
    done = [run.name for _, _, run in runs if (run / "done.json").exists()]
    if done:
        print(f"already finished in {keep}, not run again: {', '.join(done)}", flush=True)

    def one(name: str, seed: int, run: Path) -> bool:
        steps = max(2, round(plan["steps"][name] * scale))
        try:
            row = build.pretrain(as_trained(RECIPES[name], plan), Path(plan["instances"][name]), run, steps, 1, seed)
        except RuntimeError as err:  # a run that did not finish is reported; it never replaces one
            print(f"run {run.name} did not finish: {str(err).splitlines()[0]}", flush=True)
            return False
        print(f"pretrained {run.name}: {steps} steps, {row['train_cpu_minutes']:.1f} CPU-min of steps, "
              f"last loss {row['last_loss']}", flush=True)
        return True

    todo = [r for r in runs if r[2].name not in done]
    with ThreadPoolExecutor(max(1, len(todo))) as threads:  # each run is its own bertpipe process
        return 0 if all(list(threads.map(lambda r: one(*r), todo))) else 1


def dev_jobs(label: str, checkpoint: Path, task, parts: dict, sizes: list[int], subsamples: int, grid: list[dict],
             encodings: dict) -> list:
    """One checkpoint's dev jobs on one task: every size x subsample (fine-tuned with seed 1 + k)
    x setting of ``grid``, keyed for the job cache by the arm (``label``), its weights and vocab.
    ``encodings`` keeps each subsample's features by vocab: one corpus's checkpoints share them."""
    vocab = sha256(str(checkpoint / "vocab.txt"))[:16]
    ckpt_key = {"choice": label, "weights": weights_digest(checkpoint), "vocab": vocab}
    jobs = []
    for size in sizes:
        for k in range(subsamples):
            if (vocab, task.name, size, k) not in encodings:
                train = subsample(parts["train"], size, task.name, k)
                encodings[vocab, task.name, size, k] = encoded(str(checkpoint), {"train": train, "dev": parts["dev"]},
                                                               task.labels, 64)
            data, pad = encodings[vocab, task.name, size, k]
            jobs += [(ckpt_key | {"task": task.name, "size": str(size), "subsample": k, "seed": 1 + k,
                                  "setting": setting, "split": "dev"},
                      finetune, (str(checkpoint), data, "dev", len(task.labels), setting, 1 + k, pad))
                     for setting in grid]
    return jobs


def evaluate(work: Path, checkpoints: Path, plan: dict, samples: Path, jobs: int, output: Path,
             sizes: list[int], subsamples: int, choose: Path | None = None) -> dict:
    """The choice on dev: every candidate's run and every B (``build.baseline`` per corpus and seed)
    fine-tuned at every size x subsample x setting (:func:`dev_jobs`, one queue for ``jobs``
    processes, finished jobs read from the cache under ``work/choice``); a candidate's gain in a
    cell is the mean of its runs and subsamples minus the same mean of its corpus's B. Writes
    every score to ``output`` and, with ``choose``, the choice (``choice.choose``)."""
    proto = protocol(plan["candidates"], plan["quick"])
    grid, names = proto["grid"], list(plan["steps"])
    runs: dict[str, list[tuple[int, Path]]] = {}  # per candidate, its finished runs as (seed, folder)
    for folder in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        name, sep, seed = folder.name.rpartition("-seed")
        if sep and name in names and seed.isdigit() and (folder / "done.json").exists():
            runs.setdefault(name, []).append((int(seed), folder))
    if not runs:
        raise SystemExit(f"{checkpoints}: no finished run of a candidate (folders <recipe>-seed<S> that "
                         "benchmarks.quality pretrain --candidates leaves)")
    arms: dict[str, dict] = {}
    for corpus in sorted({plan["corpus"][n] for n in runs}):
        first = next(n for n in names if plan["corpus"][n] == corpus)  # every candidate's model is the same
        for seed in sorted({seed for found in runs.values() for seed, _ in found}):
            folder = work / "choice" / f"random-init-{corpus}-seed{seed}{'-quick' if plan['quick'] else ''}"
            build.baseline(as_trained(RECIPES[first], plan), Path(plan["instances"][first]), folder, seed)
            arms[f"B-{corpus}-seed{seed}"] = {"arm": "B", "corpus": corpus, "seed": seed, "checkpoint": folder}
    for name, found in runs.items():
        for seed, folder in found:
            arms[folder.name] = {"arm": name, "corpus": plan["corpus"][name], "seed": seed, "checkpoint": folder / "hf",
                                 "pretrain": json.loads((folder / "done.json").read_text())}
    tasks = load_tasks(samples, proto)
    encodings: dict = {}
    work_list = [job for label, arm in arms.items() for task, parts in tasks.values()
                 for job in dev_jobs(label, arm["checkpoint"], task, parts, sizes, subsamples, grid, encodings)]
    work_list.sort(key=lambda job: -int(job[0]["size"]))  # the longest jobs first
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        values = run_cached(Cache(work / "choice" / "cache", reuse=True), pool, work_list, "choice", max(1, jobs))
    for (key, _, _), value in zip(work_list, values, strict=True):
        c = qc.cell(key["task"], key["size"], grid.index(key["setting"]) + 1)
        arms[key["choice"]].setdefault("dev_macro_f1", {}).setdefault(c, []).append(value["macro_f1"])
    pooled: dict[str, dict[str, list[float]]] = {}
    for label, arm in arms.items():
        scores = arm["dev_macro_f1"]
        print(f"  {label}: dev macro-F1 {statistics.fmean(v for s in scores.values() for v in s):.1f} "
              f"(mean of {len(scores)} cells)", flush=True)
        for c, cell_scores in scores.items():
            pooled.setdefault(f"B-{arm['corpus']}" if arm["arm"] == "B" else arm["arm"], {}).setdefault(
                c, []).extend(cell_scores)
    gains = {n: qc.gains(pooled[n], pooled[f"B-{plan['corpus'][n]}"]) for n in names if n in runs}
    choice = qc.choose(gains, plan["corpus"], qc.cells(list(tasks), tuple(str(s) for s in sizes), len(grid)))
    choice["not_run"] = [n for n in names if n not in runs]
    choice["runs"] = {n: [seed for seed, _ in runs[n]] for n in runs}
    result = {"what": f"protocol {plan['candidates']}'s recipe choice: each candidate's dev macro-F1 at every "
                      "size x subsample x setting, its gain per cell over random init with its corpus's vocab, "
                      "and the choice",
              "sizes": [str(s) for s in sizes], "subsamples": subsamples, "grid": grid,
              "plan": plan, "arms": {label: {k: str(v) if k == "checkpoint" else v for k, v in arm.items()}
                                     for label, arm in arms.items()},
              "choice": choice}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    if choose:
        qc.write_choice(choice, choose)
    for row in choice["candidates"]:
        print(f"{row['name']:<10} {row['corpus']}  {len(choice['runs'][row['name']])} run(s)  "
              f"minimum gain {row['minimum']:+.1f}  mean gain {row['mean']:+.1f}")
    if choice["not_run"]:
        print(f"not run: {', '.join(choice['not_run'])}")
    print(f"chosen: {choice['name']} (corpus {choice['corpus']})" + (f"; written to {choose}" if choose else ""))
    return result


def numbers(flag: str, text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} {text}: give integers, comma-separated") from None


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import samples as default_samples

    parser = argparse.ArgumentParser(prog="benchmarks.quality", description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["prepare", "pretrain", "choose"])
    parser.add_argument("--protocol", default="v3", choices=versions(), help="the version whose candidates compete")
    parser.add_argument("--work", default="/work/quality-runs", help="the test phase's --work")
    parser.add_argument("--samples", default=None, help="the samples folder")
    parser.add_argument("--chosen-steps", type=int, default=14533, help="prepare: the protocol's 60-minute step count")
    parser.add_argument("--corpus", default="k1,k2", help="prepare: only the candidates on these")
    parser.add_argument("--quick", action="store_true", help="prepare: tiny data and settings (the bookkeeping)")
    parser.add_argument("--seeds", default="42", help="pretrain: each candidate once per seed")
    parser.add_argument("--keep", default=None, help="pretrain: the runs' folder (<recipe>-seed<S> in it)")
    parser.add_argument("--scale", type=float, default=1.0, help="pretrain: a share of each step count")
    parser.add_argument("--checkpoints", default=None, help="choose: the folder of the runs")
    parser.add_argument("--jobs", type=int, default=1, help="choose: fine-tuning jobs at a time (processes)")
    parser.add_argument("--sizes", default="300,1000", help="choose: label counts")
    parser.add_argument("--subsamples", type=int, default=3, help="choose: subsamples a size")
    parser.add_argument("--choose", default=None, help="choose: write the choice here")
    parser.add_argument("--output", default=None, help="choose: every score (default: "
                        "bench-results/quality-<protocol>-search.json)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    samples = Path(args.samples) if args.samples else default_samples()
    if args.step == "prepare":
        corpora = [c.strip() for c in args.corpus.split(",")]
        print(json.dumps(prepare(work, samples, args.protocol, corpora, args.chosen_steps, args.quick), indent=1))
        return 0
    if args.step == "pretrain":
        if not args.keep:
            raise SystemExit("pretrain --candidates needs --keep, the folder its runs go to")
        return pretrain_all(Path(args.keep), read_plan(work, args.protocol), numbers("--seeds", args.seeds), args.scale)
    if not args.checkpoints:
        raise SystemExit("choose needs --checkpoints, the folder of the runs")
    output = Path(args.output) if args.output else ROOT / "bench-results" / f"quality-{args.protocol}-search.json"
    evaluate(work, Path(args.checkpoints), read_plan(work, args.protocol), samples, args.jobs, output,
             numbers("--sizes", args.sizes), args.subsamples, Path(args.choose) if args.choose else None)
    return 0
