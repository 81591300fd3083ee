"""The test phase: does our pre-training pay, and most when labels are few? A pre-registered
learning-curve protocol (``docs/quality.md``), its draws from ``protocols/v<N>.json``.

    nice -n 19 python -m benchmarks.quality score --protocol v3 --work /work/quality-runs --reuse
    python -m benchmarks.quality score --quick --work /tmp/q      # bookkeeping on tiny data

Arms: A, ``--recipe`` pre-trained through ``bertpipe`` for each of ``--budgets`` CPU-minutes,
three runs; B, the same model from random init; TF-IDF + logistic regression; C, the sample
MiniLM. Each arm's setting is chosen once per task on dev by the product's choice; the learning
curve fine-tunes stratified subsamples at each size; the endpoints are A - B with Welch
intervals over runs, and the data's goals (:func:`goals`). Every run and job is cached under
``--work`` by a hash of what decides it (``--reuse`` resumes; ``--pack-cache`` packs the jobs
into the protocol's ``cache_archive``, from which a new machine's ``--reuse`` starts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from benchmarks.common import machine, samples, welch
from benchmarks.quality.build import (
    baseline,
    cpu_per_step,
    instances_digest,
    pretrain,
    steps_in_budget,
)
from benchmarks.quality.cache import Cache, pack_cache
from benchmarks.quality.choice import cell, every_setting_cells, frozen_choice, goal_every_setting
from benchmarks.quality.finetune import finetune_examples, product_setting
from benchmarks.quality.measures import heldout_mlm_accuracy, linear_probe, tfidf_scores
from benchmarks.quality.spec import (
    CHOSEN,
    PRETRAIN_SEED,
    RECIPES,
    ROOT,
    candidates,
    protocol,
    versions,
)
from benchmarks.quality.tasks import load_tasks
from bert_core.finetune.report import best, seed_stats, select
from bert_core.pretrain.metrics import read_metrics

RESULTS = ROOT / "bench-results"


def size_name(size: int | None) -> str:
    return "all" if size is None else str(size)


def run_value(run: dict, tasks: list[str], size: str, metric: str = "macro_f1") -> float | None:
    """A run's value at a size: the mean over tasks of its mean over subsamples (None if missing)."""
    per_task = []
    for task in tasks:
        jobs = run.get("curve", {}).get(task, {}).get(size)
        if not jobs:
            return None
        per_task.append(statistics.fmean(j[metric] for j in jobs))
    return statistics.fmean(per_task)


def endpoints(arms: list[dict], tasks: list[str], sizes: list[str]) -> list[dict]:
    """For each pre-trained arm and size: the gain over arm B in macro-F1 (mean over tasks), with
    its Welch interval over pre-training runs, and per task (the regression check at 300)."""
    base = next(a for a in arms if a["arm"] == "B")
    out = []
    for arm in (a for a in arms if a["arm"].startswith("A")):
        for size in sizes:
            a = [v for r in arm["runs"] if (v := run_value(r, tasks, size)) is not None]
            b = [v for r in base["runs"] if (v := run_value(r, tasks, size)) is not None]
            if not a or not b:
                continue
            per_task = {}
            for task in tasks:
                ta = [v for r in arm["runs"] if (v := run_value(r, [task], size)) is not None]
                tb = [v for r in base["runs"] if (v := run_value(r, [task], size)) is not None]
                per_task[task] = welch(ta, tb) | {"runs": [len(ta), len(tb)]}
            out.append({"arm": arm["arm"], "budget_cpu_minutes": arm["budget_cpu_minutes"], "size": size,
                        "runs": [len(a), len(b)], **welch(a, b), "per_task": per_task,
                        "regression": sorted(t for t, g in per_task.items() if g["gain"] < 0) if size == "300" else []})
    return out


def curve_draws(plan: dict) -> list[tuple[int | None, int]]:
    """The curve's (size, subsamples): the plan's subsamples at each size, its pool's at the whole pool."""
    return [(size, plan["pool_subsamples"] if size is None else plan["subsamples"]) for size in plan["sizes"]]


def finetune_jobs(checkpoint: Path, ckpt_key: dict, task, parts: dict, setting: dict,
                  draws: list[tuple[int | None, int]]) -> list:
    """The jobs of one checkpoint on one task at each (size, subsamples) of ``draws``: (cache key,
    function, arguments); subsample k is fine-tuned with seed 1 + k."""
    from bert_core.finetune.data import subsample

    return [(ckpt_key | {"task": task.name, "size": size_name(size), "subsample": k, "seed": 1 + k,
                         "setting": setting, "split": "test"}, finetune_examples,
             (str(checkpoint), {"train": subsample(parts["train"], size, task.name, k), "test": parts["test"]},
              "test", task.labels, setting, 1 + k))
            for size, subsamples in draws for k in range(subsamples)]


def chosen_on_dev(task: str, grid: list[dict], scored: list[dict]) -> dict:
    """The setting of ``grid`` the product's choice on dev (``report.select``) takes by macro-F1."""
    names = [product_setting(s).name for s in grid]
    results = [{"task": task, "setting": {"name": n}, "seed": 1, "ok": True, "metrics": {"flat": r}}
               for n, r in zip(names, scored, strict=True)]
    return grid[names.index(select(task, seed_stats(results)[task], metric="macro_f1"))]


def choose_setting(cache: Cache, pool, checkpoint: Path, ckpt_key: dict, task, parts: dict, grid: list[dict],
                   label: str) -> dict:
    """The arm's setting for a task: the grid on the full pool, one seed, scored on dev, and the
    setting :func:`chosen_on_dev` selects."""
    data = {"train": parts["train"], "dev": parts["dev"]}
    jobs = [(ckpt_key | {"task": task.name, "size": "all", "setting": s, "seed": 1, "split": "dev"},
             finetune_examples, (str(checkpoint), data, "dev", task.labels, s, 1)) for s in grid]
    scored = cache.run(pool, jobs, f"{label} {task.name} dev grid")
    grid_rows = [s | {"dev": r} for s, r in zip(grid, scored, strict=True)]
    chosen = chosen_on_dev(task.name, grid, scored)
    print(f"  {label} {task.name}: chose {chosen} (dev macro-F1 "
          f"{max(r['macro_f1'] for r in scored):.1f})", flush=True)
    return {"selected": chosen, "grid": grid_rows}


def curve_of(values: list[dict], jobs: list) -> dict[str, list[dict]]:
    curve: dict[str, list[dict]] = {}
    for (key, _, _), v in zip(jobs, values, strict=True):
        curve.setdefault(key["size"], []).append({"subsample": key["subsample"], "seed": key["seed"], **v})
    return curve


def evaluate_run(cache, pool, arm: dict, run: dict, checkpoint: Path, ckpt_key: dict, tasks: dict, plan: dict) -> None:
    """Setting (first run of the arm), learning curve, probe and held-out MLM accuracy of one run."""
    from bert_core.finetune.data import subsample

    label = f"{arm['arm']} seed {run['seed']}"
    for name, (task, parts) in tasks.items():
        if name not in arm["settings"]:
            arm["settings"][name] = choose_setting(cache, pool, checkpoint, ckpt_key, task, parts, plan["grid"], label)
        setting = arm["settings"][name]["selected"]
        jobs = finetune_jobs(checkpoint, ckpt_key, task, parts, setting, curve_draws(plan))
        run.setdefault("curve", {})[name] = curve_of(cache.run(pool, jobs, f"{label} {name} curve"), jobs)
        probe_train = subsample(parts["train"], plan["probe_size"], name)
        extra = [(ckpt_key | {"task": name, "measure": "probe", "size": plan["probe_size"]}, linear_probe,
                  (str(checkpoint), probe_train, parts["test"], task.labels)),
                 (ckpt_key | {"task": name, "measure": "heldout-mlm"}, heldout_mlm_accuracy,
                  (str(checkpoint), parts["test"]))]
        run.setdefault("probe", {})[name], run.setdefault("heldout_mlm_acc", {})[name] = cache.run(
            pool, extra, f"{label} {name} probe and MLM")
        summary = ", ".join(f"{s} {statistics.fmean(j['macro_f1'] for j in js):.1f}"
                            for s, js in run["curve"][name].items())
        print(f"  {label} {name}: macro-F1 by size: {summary}", flush=True)


def tfidf_arm(cache, pool, tasks: dict, plan: dict) -> dict:
    from bert_core.finetune.data import subsample

    arm: dict = {"arm": "TF-IDF + LR", "budget_cpu_minutes": None, "settings": {}, "runs": [{"seed": None}]}
    for name, (task, parts) in tasks.items():
        jobs = [({"arm": "tfidf", "task": name, "C": c, "split": "dev", "quick": plan["quick"]}, tfidf_scores,
                 (parts["train"], parts["dev"], task.labels, c)) for c in plan["tfidf_c"]]
        dev = cache.run(pool, jobs, f"TF-IDF {name} dev")
        c = best({c: d["macro_f1"] for c, d in zip(plan["tfidf_c"], dev, strict=True)})
        arm["settings"][name] = {"selected": {"C": c}}
        jobs = [({"arm": "tfidf", "task": name, "C": c, "size": size_name(size), "subsample": k, "split": "test",
                  "quick": plan["quick"], "seed": None}, tfidf_scores,
                 (subsample(parts["train"], size, name, k), parts["test"], task.labels, c))
                for size, subsamples in curve_draws(plan) for k in range(subsamples)]
        arm["runs"][0].setdefault("curve", {})[name] = curve_of(cache.run(pool, jobs, f"TF-IDF {name}"), jobs)
    return arm


def every_setting_run(cache, pool, arm: dict, run: dict, checkpoint: Path, ckpt_key: dict, tasks: dict,
                      plan: dict) -> None:
    """``run["every_setting"]["task/size/setting"]``: test scores at every grid setting (numbered
    from 1) at the every-setting sizes and subsamples; the arm's own setting's cells are its curve's jobs."""
    draws = [(size, plan["every_setting_subsamples"]) for size in plan["every_setting_sizes"]]
    out = run.setdefault("every_setting", {})
    for name, (task, parts) in tasks.items():
        own = arm["settings"][name]["selected"]
        jobs = [job for setting in plan["grid"] if setting != own
                for job in finetune_jobs(checkpoint, ckpt_key, task, parts, setting, draws)]
        values = cache.run(pool, jobs, f"{arm['arm']} seed {run['seed']} {name} every setting")
        for (key, _, _), v in zip(jobs, values, strict=True):
            c = cell(name, key["size"], plan["grid"].index(key["setting"]) + 1)
            out.setdefault(c, []).append({"subsample": key["subsample"], "seed": key["seed"], **v})
        for size, subsamples in draws:
            out[cell(name, size_name(size), plan["grid"].index(own) + 1)] = [
                j for j in run["curve"][name][size_name(size)] if j["subsample"] < subsamples]


def every_setting_endpoint(arms: list[dict], tasks: list[str], plan: dict) -> dict[str, list[dict]]:
    """Per A arm, the secondary endpoint's cells against B (``choice.every_setting_cells``)."""
    def scores(arm: dict) -> list[dict[str, list[float]]]:
        return [{c: [j["macro_f1"] for j in jobs] for c, jobs in r.get("every_setting", {}).items()}
                for r in arm["runs"]]

    base = next(a for a in arms if a["arm"] == "B")
    sizes = tuple(size_name(s) for s in plan["every_setting_sizes"])
    return {a["arm"]: every_setting_cells(scores(a), scores(base), tasks, sizes, len(plan["grid"]))
            for a in arms if a["arm"].startswith("A")}


def goals(arms: list[dict], endpoint_rows: list[dict], every_setting: dict[str, list[dict]], tasks: list[str],
          plan: dict, genres: list[str] | None) -> dict[str, list[dict]]:
    """The goals per A arm, each met or not with its figures: 1, every setting's interval above 0
    at the goal sizes; 2, A above TF-IDF + LR at the last goal size on every task; 3, the primary
    gain at least +3 with its interval above 0; 4, held-out MLM accuracy of every run on each task
    and on each of ``genres``' set-aside documents (None: not measured)."""
    sizes = plan["goal_sizes"]
    base = next(a for a in arms if a["arm"] == "B")
    tfidf = next(a for a in arms if a["arm"] == "TF-IDF + LR")["runs"][0]["curve"]
    out = {}
    for arm in (a for a in arms if a["arm"].startswith("A")):
        one = goal_every_setting(every_setting.get(arm["arm"], []), tasks, sizes, len(plan["grid"]))
        against = {}
        for task in tasks:
            a = [j["macro_f1"] for r in arm["runs"] for j in r.get("curve", {}).get(task, {}).get(sizes[-1], [])]
            t = [j["macro_f1"] for j in tfidf.get(task, {}).get(sizes[-1], [])]
            against[task] = {"a": statistics.fmean(a) if a else math.nan, "tfidf": statistics.fmean(t) if t else math.nan,
                             "jobs": [len(a), len(t)]}
            against[task]["pass"] = bool(a and t and against[task]["a"] > against[task]["tfidf"])
        primary = {e["size"]: {k: e[k] for k in ("gain", "ci_low", "ci_high", "runs")}
                   for e in endpoint_rows if e["arm"] == arm["arm"] and e["size"] in sizes}
        for row in primary.values():
            row["pass"] = row["gain"] >= 3 and row["ci_low"] > 0  # a NaN bound fails
        missing = []
        for label, r in [(arm["arm"], r) for r in arm["runs"]] + [("B", r) for r in base["runs"]]:
            missing += [f"{label} seed {r['seed']} {t}" for t in tasks
                        if not _number(r.get("heldout_mlm_acc", {}).get(t))]
            missing += [f"{label} seed {r['seed']} {g}" for g in genres or []
                        if not _number(r.get("genres", {}).get(g, {}).get("heldout_mlm_acc"))]
        expected = (len(arm["runs"]) + len(base["runs"])) * (len(tasks) + len(genres or []))
        out[arm["arm"]] = [
            {"goal": 1, "name": "every setting", "met": one["pass"]} | {k: v for k, v in one.items() if k not in ("goal", "pass")},
            {"goal": 2, "name": "against TF-IDF + LR", "met": all(v["pass"] for v in against.values()),
             "size": sizes[-1], "per_task": against},
            {"goal": 3, "name": "primary", "met": len(primary) == len(sizes) and all(v["pass"] for v in primary.values()),
             "per_size": primary},
            {"goal": 4, "name": "held-out MLM accuracy reported", "met": genres is not None and not missing,
             "numbers": expected - len(missing), "expected": expected, "missing": missing}
            | ({} if genres is not None else {"why": "per-genre accuracy not measured (--heldout-genres)"})]
    return out


def _number(value) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)


def freeze_check(recipe: str, choice: str | None, quick: bool, version: str = "v2") -> dict | None:
    """A candidate's test phase starts only on its frozen choice (``--choice``, else the version's):
    the choice, or a one-line refusal; None for another recipe or ``--quick`` without ``--choice``."""
    if recipe not in candidates("v2") or (quick and choice is None):
        return None
    path = Path(choice) if choice else ROOT / protocol(version)["choice"]
    return {"file": str(path)} | frozen_choice(path, recipe)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    sizes = result["protocol"]["sizes"]
    for arm in dict.fromkeys(e["arm"] for e in result["endpoints"]):
        rows = [e for e in result["endpoints"] if e["arm"] == arm]
        budget = rows[0]["budget_cpu_minutes"]
        xs = [sizes.index(e["size"]) for e in rows]
        ys = [e["gain"] for e in rows]
        lo = [e["gain"] - e["ci_low"] if not math.isnan(e["ci_low"]) else 0 for e in rows]
        hi = [e["ci_high"] - e["gain"] if not math.isnan(e["ci_high"]) else 0 for e in rows]
        runs = max(e["runs"][0] for e in rows)
        name = f"{budget:g} CPU-min" if budget is not None else arm
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, label=f"{name} ({runs} run(s))")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_xlabel("labelled training examples")
    ax.set_ylabel("macro-F1 gain over random init\n(mean over tasks, 95% Welch CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality import corpus as qc

    parser = argparse.ArgumentParser(prog="benchmarks.quality", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", default=None, help="sample folder (default: benchmarks.common.samples())")
    parser.add_argument("--work", default=str(RESULTS / "quality-data"), help="corpus, runs and the job cache")
    parser.add_argument("--recipe", default=CHOSEN, choices=list(RECIPES), help="pre-training recipe of arm A")
    parser.add_argument("--budgets", type=floats, default=None, help="CPU-minutes of pre-training for arm A")
    parser.add_argument("--ranks", type=int, default=1, help="pre-training ranks (CPU processes)")
    parser.add_argument("--calibration-steps", type=int, default=40)
    parser.add_argument("--jobs", type=int, default=1, help="fine-tuning jobs side by side (one thread each); "
                        "with --pretrain-only, pre-training runs side by side")
    parser.add_argument("--reuse", action="store_true", help="read finished runs and jobs from --work")
    parser.add_argument("--cache-archive", default=None, help="finished jobs as one file, which --reuse starts a "
                        "missing cache from and --pack-cache writes (default: the protocol's; none with --quick)")
    parser.add_argument("--cache-only", action="store_true",
                        help="--reuse, and a job or pre-training run not in the cache stops the run (a reproduction)")
    parser.add_argument("--pack-cache", action="store_true", help="write --work's finished jobs to --cache-archive")
    parser.add_argument("--pretrain-only", action="store_true", help="only pre-train arm A's runs, then stop")
    parser.add_argument("--corpus", default=None, choices=["v1", "k1", "k2"], help="v1: the sample tweets "
                        "(--quick only); k1, k2: built under --work/<corpus> (default: the recipe's own, else v1)")
    parser.add_argument("--choice", default=None, help="the frozen choice a candidate recipe's test phase needs "
                        "(default: the --protocol's; none with --quick)")
    parser.add_argument("--protocol", default="v2", choices=versions(),
                        help="the version's draws, frozen choice and arms (docs/quality-protocol-v<N>.md)")
    parser.add_argument("--every-setting", action="store_true", help="A and B at every grid setting at each size "
                        "but the whole pool: the every-setting cells of A - B")
    parser.add_argument("--distinct-text", default=None, help="k2's distinct text (default: benchmarks.text."
                        "distinct_text's, fetched once; none with --quick)")
    parser.add_argument("--heldout-genres", action="store_true",
                        help="per genre and run: word pieces, epochs seen and MLM accuracy on the set-aside documents")
    parser.add_argument("--quick", action="store_true", help="tiny data and settings: checks the bookkeeping only")
    parser.add_argument("--output", default=str(RESULTS / "quality.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "quality.png"))
    args = parser.parse_args(argv)
    own_corpus = RECIPES[args.recipe].corpus
    if own_corpus and args.corpus not in (None, own_corpus):
        raise SystemExit(f"--recipe {args.recipe} pre-trains on {own_corpus}, not --corpus {args.corpus}")
    args.corpus = args.corpus or own_corpus or "v1"
    choice = None if args.pretrain_only or args.pack_cache else freeze_check(args.recipe, args.choice, args.quick,
                                                                                  args.protocol)
    if args.heldout_genres and args.corpus == "v1":
        parser.error("--heldout-genres needs --corpus k1 or k2 (version 1's corpus sets no text aside)")
    plan = protocol(args.protocol, args.quick)
    args.budgets = args.budgets or plan["budgets"]
    if not plan["runs_here"] and not args.quick:
        print(f"protocol {args.protocol} needs {plan['needs']}", flush=True)
    archive = Path(args.cache_archive) if args.cache_archive else None if args.quick else ROOT / plan["cache_archive"]
    work = Path(args.work)
    if args.pack_cache:
        if archive is None:
            parser.error("--pack-cache with --quick needs --cache-archive")
        print(f"wrote {pack_cache(work / 'cache', archive)} finished jobs to {archive}")
        return 0
    if args.cache_only and not (work / "cache").exists() and not (archive and archive.exists()):
        parser.error(f"--cache-only: neither {work / 'cache'} nor {archive} is there to read the jobs from")
    if args.corpus == "v1" and not args.quick:
        raise SystemExit("--corpus v1 (version 1's, the sample tweets) runs with --quick only: give k1 or k2")
    sample_dir = Path(args.samples) if args.samples else samples()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}", flush=True)

    tasks = load_tasks(sample_dir, plan)
    for name, (_, parts) in tasks.items():
        print(f"{name}: " + " / ".join(f"{len(v)} {k}" for k, v in parts.items()), flush=True)
    recipe = replace(RECIPES[args.recipe], global_batch=plan["global_batch"]) if args.quick else RECIPES[args.recipe]
    distinct = Path(args.distinct_text) if args.distinct_text else None
    built = qc.build(args.corpus, recipe, work, sample_dir, {n: p for n, (_, p) in tasks.items()}, distinct, args.quick)
    instances = built.instances
    runs = instances.parent  # the runs of arms A and B live beside the instances
    print(f"pre-training corpus {args.corpus}: {', '.join(p for _, p in built.prepared.inputs)}; no dev/test text in it",
          flush=True)
    cache = Cache(work / "cache", args.reuse or args.cache_only, archive, only=args.cache_only)
    base_key = {"recipe": recipe.key(), "instances": instances_digest(instances), "quick": args.quick,
                "tasks": {n: [t.files, t.dev_size, t.test_size, t.pool_size] for n, (t, _) in tasks.items()}}

    steps: dict[float, int] = dict.fromkeys(args.budgets, plan["steps"]) if args.quick else {}
    for budget in [] if args.quick else args.budgets:  # the steps that fit each budget on this machine
        calibration = {"calibration": recipe.key(), "ranks": args.ranks, "steps": args.calibration_steps}
        calibration |= {} if args.corpus == "v1" else {"corpus": args.corpus}
        per_step = cache.lookup(calibration)
        if per_step is None:
            calibration_run = runs / f"calibration-{args.recipe}"
            pretrain(recipe, instances, calibration_run, args.calibration_steps, args.ranks)
            per_step = cpu_per_step(read_metrics(str(calibration_run)))
            cache.store(calibration, per_step)
        steps[budget] = steps_in_budget(budget, per_step)
        print(f"budget {budget:g} CPU-min: {steps[budget]} steps ({per_step:.3f} CPU-s a step)", flush=True)

    seeds = range(PRETRAIN_SEED, PRETRAIN_SEED + plan["runs"])  # run k of an arm: seed 42 + k

    def pretrained(budget: float | None, seed: int) -> tuple[Path, dict, dict | None]:
        """Arm B's random init (``budget`` None) or arm A's run at ``budget``, with ``seed``: its
        checkpoint, cache key and pre-training record."""
        quick = "-quick" if args.quick else ""
        if budget is None:
            folder = baseline(recipe, instances, runs / f"random-init-{args.recipe}-seed{seed}{quick}", seed)
            return folder, base_key | {"arm": "B", "pretrain_seed": seed}, None
        folder = runs / f"pretrain-{args.recipe}-{budget:g}-r{args.ranks}-seed{seed}{quick}"
        key = base_key | {"arm": "A", "budget": budget, "steps": steps[budget], "ranks": args.ranks,
                          "pretrain_seed": seed}
        done = cache.lookup(key | {"pretrained": True})  # with it, jobs read from the cache need no checkpoint
        if done is None and cache.only:
            raise SystemExit(f"A {budget:g} seed {seed}: its pre-training run is not in {cache.folder}: the cache is incomplete")
        if done is None:
            done = pretrain(recipe, instances, folder, steps[budget], args.ranks, seed)
            cache.store(key | {"pretrained": True}, done)
        print(f"  A {budget:g} seed {seed}: {steps[budget]} steps, {done['train_cpu_minutes']:.1f} CPU-min of steps; "
              f"eval MLM accuracy {done['eval']['mlm_acc'] if done['eval'] else float('nan'):.3f}", flush=True)
        return folder / "hf", key, done

    if args.pretrain_only:  # --jobs runs side by side, each its own bertpipe process
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, args.jobs)) as threads:
            list(threads.map(lambda r: pretrained(*r), [(b, s) for b in args.budgets for s in seeds]))
        return 0

    arms: list[dict] = []
    result = {"machine": info, "protocol": {"sizes": [size_name(s) for s in plan["sizes"]],
                                            "subsamples": plan["subsamples"], "runs": plan["runs"],
                                            "grid": plan["grid"], "recipe": args.recipe,
                                            "budgets": args.budgets, "steps": steps,
                                            "quick": args.quick, "ranks": args.ranks, "choice": choice,
                                            "every_setting": args.every_setting, "goal_sizes": plan["goal_sizes"],
                                            "version": args.protocol, "pool_subsamples": plan["pool_subsamples"],
                                            "every_setting_sizes": [size_name(s) for s in plan["every_setting_sizes"]],
                                            "every_setting_subsamples": plan["every_setting_subsamples"]},
              "tasks": {n: {"labels": t.labels, "files": t.files, "counts": {k: len(v) for k, v in p.items()}}
                        for n, (t, p) in tasks.items()},
              "corpus_inputs": [p for _, p in built.prepared.inputs], "arms": arms}
    task_names = list(tasks)
    if args.corpus != "v1":
        result["protocol"]["corpus"] = args.corpus
        result["genres"] = built.prepared.sizes

    def genre_measures(pool, run: dict, checkpoint: Path, key: dict, sequences_drawn: int) -> None:
        """The run's word pieces, epochs seen and set-aside MLM accuracy per genre."""
        heldout = built.prepared.heldout
        count = plan["heldout_sequences"] if args.quick else qc.HELDOUT_SEQUENCES
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(heldout.glob("*.jsonl")))).hexdigest()[:16]
        job = (key | {"measure": "heldout-genres", "heldout": digest, "sequences": count}, qc.genre_mlm_accuracy,
               (str(checkpoint), heldout, count))
        accuracy = cache.run(pool, [job], f"seed {run['seed']} genres")[0]
        epochs = qc.epochs_seen(pieces, instances, sequences_drawn)
        run["genres"] = {g: {"instance_pieces": pieces.get(g, {}).get("instance_pieces", 0),
                             "epochs_seen": epochs.get(g, 0.0), "heldout_mlm_acc": accuracy.get(g)}
                         for g in sorted(set(pieces) | set(accuracy))}

    pieces = qc.genre_pieces(built.corpus, built.vocab, instances, built.prepared.genres) if args.heldout_genres else {}

    def write(final: bool = False) -> None:
        sizes = result["protocol"]["sizes"]
        with_b = any(a["arm"] == "B" for a in arms)
        result["endpoints"] = endpoints(arms, task_names, sizes) if with_b else []
        result["primary"] = [e for e in result["endpoints"] if e["size"] in protocol(args.protocol)["goal_sizes"]]
        result["every_setting"] = every_setting_endpoint(arms, task_names, plan) if with_b and args.every_setting else {}
        if with_b:
            genres = [g for g, n in result["genres"].items() if n.get("set_aside")] if args.heldout_genres else None
            result["goals"] = goals(arms, result["endpoints"], result.get("every_setting", {}), task_names, plan,
                                    genres)
        result["minutes"] = (time.perf_counter() - started) / 60
        result["cache"] = {"reused": cache.hits, "computed": cache.misses}
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        if final and result["endpoints"] and args.plot:
            plot(result, Path(args.plot))

    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        arms.append(tfidf_arm(cache, pool, tasks, plan))
        write()
        for budget in [None, *args.budgets]:  # arm B, then arm A at each budget
            arm = ({"arm": "B", "budget_cpu_minutes": 0.0} if budget is None else
                   {"arm": f"A {budget:g}", "budget_cpu_minutes": budget, "steps": steps[budget]})
            arm |= {"settings": {}, "runs": []}
            arms.append(arm)
            for seed in seeds:
                checkpoint, key, done = pretrained(budget, seed)
                run = {"seed": seed, "checkpoint": str(checkpoint)} | ({} if done is None else {"pretrain": done})
                arm["runs"].append(run)
                evaluate_run(cache, pool, arm, run, checkpoint, key, tasks, plan)
                if args.every_setting:
                    every_setting_run(cache, pool, arm, run, checkpoint, key, tasks, plan)
                if args.heldout_genres:
                    genre_measures(pool, run, checkpoint, key, 0 if budget is None else steps[budget] * recipe.global_batch)
                write()
        if plan["reference"] and not args.quick:
            minilm = sample_dir / "models" / "minilm"
            c: dict = {"arm": "C (MiniLM)", "budget_cpu_minutes": None,
                       "settings": {n: {"selected": plan["reference_setting"]} for n in tasks}, "runs": [{"seed": None}]}
            arms.append(c)
            for name, (task, parts) in tasks.items():
                jobs = finetune_jobs(minilm, {"arm": "C", "tasks": base_key["tasks"]}, task, parts, plan["reference_setting"],
                                     curve_draws(plan))
                c["runs"][0].setdefault("curve", {})[name] = curve_of(cache.run(pool, jobs, f"C {name}"), jobs)
                write()
    write(final=True)
    print_report(result)
    print(f"wrote {args.output}" + (f" and {args.plot}" if result["endpoints"] else ""))
    return 0


def print_report(result: dict) -> None:
    info, sizes = result["machine"], result["protocol"]["sizes"]
    print(f"\nmachine: {info['cpu']} ({info['cores']} cores, torch {info['torch']})")
    print("test macro-F1 (0-100), mean over subsamples and runs:")
    print(f"{'arm':>14} | {'task':>9} | " + " | ".join(f"{s:>6}" for s in sizes))
    for arm in result["arms"]:
        for task in result["tasks"]:
            runs = {s: [statistics.fmean(j["macro_f1"] for j in r["curve"][task][s]) for r in arm["runs"]
                        if s in r.get("curve", {}).get(task, {})] for s in sizes}
            print(f"{arm['arm']:>14} | {task:>9} | "
                  + " | ".join(f"{statistics.fmean(v):6.1f}" if v else f"{'-':>6}" for v in runs.values()))
    for e in result["endpoints"]:
        flag = f"  REGRESSION at 300 labels on {', '.join(e['regression'])}" if e["regression"] else ""
        name = f"A {e['budget_cpu_minutes']:g} CPU-min" if e["budget_cpu_minutes"] is not None else e["arm"]
        print(f"{name} - B at {e['size']:>4}: {e['gain']:+.1f} "
              f"[{e['ci_low']:+.1f}, {e['ci_high']:+.1f}] ({e['runs'][0]} vs {e['runs'][1]} runs){flag}")
    for arm, rows in result.get("every_setting", {}).items():
        print(f"{arm} - B at every setting (gain [95% interval]; ! = REGRESSION, ? = not run):")
        for task in result["tasks"]:
            for size in dict.fromkeys(r["size"] for r in rows):
                cells = [r for r in rows if r["task"] == task and r["size"] == size]
                print(f"  {task:>9} {size:>5}: " + "  ".join(
                    f"{r['setting']} {r['gain']:+.1f} [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}]"
                    + {"REGRESSION": "!", "not run": "?"}.get(r["flag"], "") for r in cells))
    for arm, rows in result.get("goals", {}).items():
        print(f"goals of {arm}:")
        for g in rows:
            print(f"  {g['goal']} {g['name']}: {'met' if g['met'] else 'NOT MET'} ({goal_figures(g)})")


def goal_figures(goal: dict) -> str:
    """A goal's figures in one line."""
    if goal["goal"] == 1:
        failing = goal["failing"]
        return (f"{goal['passed_cells']} of {goal['cells']} cells with the interval above 0"
                + (f"; failing: {', '.join(failing[:8])}{' ...' if len(failing) > 8 else ''}" if failing else ""))
    if goal["goal"] == 2:
        return f"at {goal['size']}: " + ", ".join(f"{t} A {v['a']:.1f} vs TF-IDF {v['tfidf']:.1f}"
                                                  for t, v in goal["per_task"].items())
    if goal["goal"] == 3:
        return ", ".join(f"{s}: {v['gain']:+.1f} [{v['ci_low']:+.1f}, {v['ci_high']:+.1f}]"
                         for s, v in goal["per_size"].items()) or "no endpoint"
    return (f"{goal['numbers']} of {goal['expected']} numbers" + (f"; {goal['why']}" if "why" in goal else "")
            + (f"; missing: {', '.join(goal['missing'][:6])}" if goal["missing"] else ""))


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]

