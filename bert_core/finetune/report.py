"""Many fine-tuning jobs (tasks x seeds) -> a summary with mean ± sd and the run's manifest.

    bertpipe finetune --task mrpc --task rte --seeds 1,2,3 --data glue_data \
        --checkpoint runs/demo/hf --output finetune/demo

Fine-tuning variance is the point here (MRPC moves by points between seeds), so every seed's
value is kept beside mean and sd, and a failed job is listed, never hidden or fatal to the rest.
:func:`run_many` is the plain sequential loop (the CLI); ``flows/finetune.py`` runs the same jobs
as Prefect tasks and calls :func:`summarize` / :func:`write_run_manifest` the same way.
"""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from bert_core import storage
from bert_core.config import FinetuneConfig

# Counts, not scores: left out of the mean ± sd table.
_NOT_SCORES = ("total", "tokens", "phrases", "found", "correct", "null_score_diff_threshold")


def is_score(name: str) -> bool:
    return not any(name.endswith(s) for s in _NOT_SCORES)


def summarize(results: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``results``: one dict per job, ``{task, seed, ok, metrics|error}`` -> task -> metric -> stats."""
    summary: dict[str, dict[str, Any]] = {}
    for r in results:
        entry = summary.setdefault(r["task"], {"metrics": {}, "failed_seeds": [], "errors": {},
                                               "main_metric": None})
        if not r["ok"]:
            entry["failed_seeds"].append(r["seed"])
            entry["errors"][str(r["seed"])] = r["error"]
            continue
        m = r["metrics"]
        entry["main_metric"] = m["main_metric"]
        for name, value in m["flat"].items():
            if is_score(name) and value is not None:
                entry["metrics"].setdefault(name, {})[r["seed"]] = float(value)
    for entry in summary.values():
        for name, per_seed in entry["metrics"].items():
            values = [per_seed[s] for s in sorted(per_seed)]
            entry["metrics"][name] = {
                "mean": statistics.fmean(values),
                "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                "n": len(values),
                "values": {str(s): per_seed[s] for s in sorted(per_seed)},
            }
    return summary


def table_rows(summary: dict[str, dict[str, Any]], main_only: bool = False) -> list[dict[str, Any]]:
    """One row per (task, metric): the table artifact and the CLI print these."""
    rows = []
    for task, entry in sorted(summary.items()):
        failed = ",".join(map(str, entry["failed_seeds"]))
        names = [entry["main_metric"]] if main_only and entry["main_metric"] else sorted(entry["metrics"])
        if not entry["metrics"]:
            rows.append({"task": task, "metric": "-", "mean ± sd": "all seeds failed", "n": 0,
                         "per seed": "", "failed seeds": failed})
        for name in names:
            s = entry["metrics"].get(name)
            if s is None:
                continue
            rows.append({
                "task": task, "metric": name + (" (main)" if name == entry["main_metric"] else ""),
                "mean ± sd": f"{s['mean']:.4f} ± {s['sd']:.4f}", "n": s["n"],
                "per seed": ", ".join(f"{k}: {v:.4f}" for k, v in s["values"].items()),
                "failed seeds": failed,
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


def job_result(task: str, seed: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one job; a failure becomes a result row (with the error), not an exception."""
    try:
        return {"task": task, "seed": seed, "ok": True, "metrics": fn()}
    except Exception as err:  # one bad job must not stop the others
        return {"task": task, "seed": seed, "ok": False,
                "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def write_run_manifest(
    output: str, cfg: FinetuneConfig, checkpoint: str, data_dir: str, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """``<output>/_MANIFEST.json`` (stage="finetune"): every job's metrics.json + the summary table.
    With every job failed there is no finished work to vouch for: that raises instead."""
    if not any(r["ok"] for r in results):
        raise RuntimeError("every fine-tuning job failed: " + "; ".join(
            f"{r['task']} seed={r['seed']}: {r['error']}" for r in results))
    summary = summarize(results)
    shards = []
    for r in results:
        if r["ok"]:
            uri = storage.join(output, r["task"], f"seed={r['seed']}", "metrics.json")
            shards.append(storage.shard_entry(uri, task=r["task"], seed=r["seed"])
                          | {"path": f"{r['task']}/seed={r['seed']}/metrics.json"})
    inputs = []
    if storage.has_manifest(checkpoint):
        inputs.append(storage.read_manifest(checkpoint))
    counts = {"jobs": len(results), "succeeded": sum(r["ok"] for r in results),
              "failed": sum(not r["ok"] for r in results)}
    return storage.write_manifest(
        output, stage="finetune", config=cfg, inputs=inputs, shards=shards, counts=counts,
        stats={"summary": summary}, checkpoint=storage.to_uri(checkpoint),
        data_dir=storage.to_uri(data_dir),
        failures=[{k: r[k] for k in ("task", "seed", "error")} for r in results if not r["ok"]],
    )


def run_many(
    tasks: list[str], seeds: list[int], data_dir: str, checkpoint: str, cfg: FinetuneConfig,
    output: str, log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every (task, seed) one after another in this process; returns the manifest."""
    from bert_core.finetune.train import run_job

    results = []
    for task in tasks:
        for seed in seeds:
            if log:
                log(f"finetune {task} seed={seed}")
            r = job_result(task, seed, lambda t=task, s=seed: run_job(t, data_dir, checkpoint, cfg, s, output, log=log))
            if log and not r["ok"]:
                log(f"finetune {task} seed={seed} FAILED: {r['error']}")
            results.append(r)
    return write_run_manifest(output, cfg, checkpoint, data_dir, results)
