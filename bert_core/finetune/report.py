"""Many fine-tuning jobs (tasks x settings x seeds) -> the selected setting per task, the grid
table and the run's manifest.

    bertpipe finetune --task mrpc --task rte --seeds 1,2,3 --data glue_data \
        --checkpoint runs/demo/hf --output finetune/demo

The paper's protocol: every setting of the grid runs every seed; per task, the setting with the
best mean dev score over seeds is selected, and that setting's mean ± sd over seeds is reported on
the task's final split (its labelled test split, or dev itself, then labelled "dev (also used for
selection)"). Every seed's value is kept beside mean and sd, and a failed job is listed, never
hidden or fatal to the rest. Scores are stored as the metric returns them and put on one 0-100
scale when reported (accuracy, F1, EM, Matthews corr. and correlations x100).
:func:`run_many` is the plain sequential loop (the CLI); ``flows/finetune.py`` runs the same jobs
as Prefect tasks and calls :func:`write_run_manifest` the same way.
"""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from bert_core import storage
from bert_core.config import FinetuneConfig
from bert_core.finetune import get_task

# Counts, not scores: left out of the mean ± sd table.
_NOT_SCORES = ("total", "tokens", "phrases", "found", "correct", "null_score_diff_threshold")
SCALE_NOTE = ("Scores on a 0-100 scale: accuracy, F1, EM, Matthews corr. and Pearson/Spearman "
              "correlations x100.")


def is_score(name: str) -> bool:
    return not any(name.endswith(s) for s in _NOT_SCORES)


def percent(task: str, value: float) -> float:
    """A score of ``task`` on the 0-100 scale of the report."""
    return value if get_task(task).percent_scale else 100.0 * value


def _stats(per_seed: dict[int, float]) -> dict[str, Any]:
    values = [per_seed[s] for s in sorted(per_seed)]
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": {str(s): per_seed[s] for s in sorted(per_seed)}}


def seed_stats(results: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``results``: one dict per job, ``{task, setting, seed, ok, metrics|error}`` ->
    task -> setting name -> ``{setting, metrics: {name: mean/sd/n/values}, failed_seeds, errors}``."""
    grid: dict[str, dict[str, dict[str, Any]]] = {}
    values: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in results:
        name = r["setting"]["name"]
        entry = grid.setdefault(r["task"], {}).setdefault(
            name, {"setting": r["setting"], "metrics": {}, "failed_seeds": [], "errors": {}})
        if not r["ok"]:
            entry["failed_seeds"].append(r["seed"])
            entry["errors"][str(r["seed"])] = r["error"]
            continue
        for metric, value in r["metrics"]["flat"].items():
            if is_score(metric) and value is not None:
                values.setdefault((r["task"], name, metric), {})[r["seed"]] = float(value)
    for (task, name, metric), per_seed in values.items():
        grid[task][name]["metrics"][metric] = _stats(per_seed)
    return grid


def select(task: str, settings: dict[str, dict[str, Any]]) -> str | None:
    """The setting with the best mean dev score over seeds (the first of equals, in grid order);
    None when no setting has a score."""
    metric = get_task(task).selection_metric
    scored = [(e["metrics"][metric]["mean"], name) for name, e in settings.items() if metric in e["metrics"]]
    if not scored:
        return None
    best = max(score for score, _ in scored)
    return next(name for score, name in scored if score == best)


def summarize(results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``{"grid": seed_stats, "summary": task -> the selected setting's entry}``. A summary entry
    keeps every metric of the selected setting over seeds, its ``main_metric`` (the final split's
    headline metric) and ``final``: that metric's mean ± sd on the 0-100 scale."""
    grid = seed_stats(results)
    summary: dict[str, dict[str, Any]] = {}
    for task, settings in grid.items():
        spec = get_task(task)
        chosen = select(task, settings)
        entry = settings[chosen] if chosen else {
            "setting": None, "metrics": {},
            "failed_seeds": sorted({s for e in settings.values() for s in e["failed_seeds"]}),
            "errors": {k: v for e in settings.values() for k, v in e["errors"].items()}}
        final = entry["metrics"].get(spec.final_metric)
        summary[task] = {
            **entry, "selected": chosen, "selection_metric": spec.selection_metric,
            "main_metric": spec.final_metric, "final_split": spec.final_split or spec.splits[0],
            "final_label": spec.final_label,
            "final": None if final is None else {
                "mean": percent(task, final["mean"]), "sd": percent(task, final["sd"]), "n": final["n"]},
        }
    return {"grid": grid, "summary": summary}


def _mean_sd(task: str, s: dict[str, Any] | None) -> str:
    return "-" if s is None else f"{percent(task, s['mean']):.1f} ± {percent(task, s['sd']):.1f}"


def table_rows(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (task, setting): dev mean ± sd for every setting (the seeds' values listed),
    the selected one marked and reported on the final split. The table artifact, the CLI and
    report.md show these; nine columns fit the Prefect UI."""
    rows = []
    for task, settings in sorted(stats["grid"].items()):
        spec, chosen = get_task(task), stats["summary"][task]["selected"]
        for name, e in settings.items():
            dev = e["metrics"].get(spec.selection_metric)
            final = e["metrics"].get(spec.final_metric) if name == chosen else None
            rows.append({
                "task": task, "setting": name, "selected": "✓" if name == chosen else "",
                "metric": spec.metric,
                "dev mean ± sd (0-100)": _mean_sd(task, dev) if dev else "all seeds failed",
                "final split": spec.final_label if name == chosen else "",
                "final mean ± sd (0-100)": _mean_sd(task, final) if name == chosen else "",
                "dev per seed (0-100)": ", ".join(f"{k}: {percent(task, v):.1f}"
                                                  for k, v in (dev or {"values": {}})["values"].items()),
                "failed seeds": ",".join(map(str, e["failed_seeds"])),
            })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no results)"
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    out = [line, "  ".join("-" * widths[c] for c in cols)]
    out += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(out)


def markdown(stats: dict[str, Any], title: str) -> str:
    """report.md: the selected settings on their final split, then the whole grid."""
    lines = [f"# {title}", "", SCALE_NOTE + " Per task, the setting with the best mean dev score "
             "over seeds is selected (✓) and reported on the final split.", "",
             "| task | metric | selected setting | final split | final mean ± sd (0-100) |",
             "|---|---|---|---|---|"]
    for task, s in sorted(stats["summary"].items()):
        final = "-" if s["final"] is None else f"{s['final']['mean']:.1f} ± {s['final']['sd']:.1f} (n={s['final']['n']})"
        lines.append(f"| {task} | {get_task(task).metric} | {s['selected'] or 'none (all failed)'} "
                     f"| {s['final_label']} | {final} |")
    rows = table_rows(stats)
    lines += ["", "## Grid", ""]
    if rows:
        cols = list(rows[0])
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def job_result(task: str, setting: dict[str, Any], seed: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one job; a failure becomes a result row (with the error), not an exception."""
    base = {"task": task, "setting": setting, "seed": seed}
    try:
        return {**base, "ok": True, "metrics": fn()}
    except Exception as err:  # one bad job must not stop the others
        return {**base, "ok": False, "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()}


def write_run_manifest(
    output: str, cfg: FinetuneConfig, checkpoint: str, data_dir: str, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """``<output>/report.md`` then ``<output>/_MANIFEST.json`` (stage="finetune"): every job's
    metrics.json, the grid and the selection. With every job failed there is no finished work
    to vouch for: that raises instead."""
    if not any(r["ok"] for r in results):
        raise RuntimeError("every fine-tuning job failed: " + "; ".join(
            f"{r['task']} {r['setting']['name']} seed={r['seed']}: {r['error']}" for r in results))
    stats = summarize(results)
    report_uri = storage.join(output, "report.md")
    storage.write_text(report_uri, markdown(stats, f"Fine-tuning {storage.to_uri(checkpoint)}"))
    shards = [storage.shard_entry(report_uri) | {"path": "report.md"}]
    for r in results:
        if r["ok"]:
            path = f"{r['task']}/{r['setting']['name']}/seed={r['seed']}/metrics.json"
            shards.append(storage.shard_entry(storage.join(output, path), task=r["task"],
                                              setting=r["setting"]["name"], seed=r["seed"])
                          | {"path": path})
    inputs = []
    if storage.has_manifest(checkpoint):
        inputs.append(storage.read_manifest(checkpoint))
    counts = {"jobs": len(results), "succeeded": sum(r["ok"] for r in results),
              "failed": sum(not r["ok"] for r in results)}
    return storage.write_manifest(
        output, stage="finetune", config=cfg, inputs=inputs, shards=shards, counts=counts,
        stats=stats, checkpoint=storage.to_uri(checkpoint), data_dir=storage.to_uri(data_dir),
        failures=[{"task": r["task"], "setting": r["setting"]["name"], "seed": r["seed"],
                   "error": r["error"]} for r in results if not r["ok"]],
    )


def run_many(
    tasks: list[str], seeds: list[int], data_dir: str, checkpoint: str, cfg: FinetuneConfig,
    output: str, log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every (task, setting, seed) one after another in this process; returns the manifest."""
    from bert_core.finetune.grid import settings
    from bert_core.finetune.train import run_job

    results = []
    for task in tasks:
        for setting in settings(cfg):
            job_cfg = cfg.at(setting.learning_rate, setting.batch_size, setting.num_train_epochs)
            for seed in seeds:
                what = f"finetune {task} {setting.name} seed={seed}"
                if log:
                    log(what)
                r = job_result(task, setting.as_dict(), seed, lambda t=task, c=job_cfg, s=seed:
                               run_job(t, data_dir, checkpoint, c, s, output, log=log))
                if log and not r["ok"]:
                    log(f"{what} FAILED: {r['error']}")
                results.append(r)
    return write_run_manifest(output, cfg, checkpoint, data_dir, results)
