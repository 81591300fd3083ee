"""Many fine-tuning jobs (tasks x settings x seeds) -> the selected setting per task, its best
seed's model published, the grid table, one manifest per task folder and an index over them.

    bertpipe finetune --task mrpc --task rte --seeds 1,2,3 --data glue_data         --checkpoint runs/demo/hf --output finetune/demo
    bertpipe stats finetune/demo          (the index: every task's selected setting and score)
    bertpipe stats finetune/demo/mrpc     (one task: the whole grid)
"""

from __future__ import annotations

import contextlib
import statistics
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from bert_core import lease, storage
from bert_core.config import FinetuneConfig
from bert_core.finetune import get_task
from bert_core.finetune.errors import AllJobsFailed
from bert_core.progress import OnProgress, Update

# The paper's protocol: every setting of the grid runs every seed; per task, the setting with the
# best mean dev score over seeds is selected, and that setting's mean ± sd over seeds is reported on
# the task's final split (its labelled test split, or dev itself, then labelled "dev (also used for
# selection)"). Every seed's value is kept beside mean and sd, and a failed job is listed, never
# hidden or fatal to the rest. Scores are stored as the metric returns them and put on one 0-100
# scale when reported (accuracy, F1, EM, Matthews corr. and correlations x100).
# :func:`run_many` is the plain sequential loop (the CLI); ``flows/finetune.py`` runs the same jobs
# as Prefect tasks and calls :func:`write_results` the same way. Both hold each task folder's lease
# (``bert_core.lease``) and pass its attempt id: a task's clearing, its model and its manifest are
# written only while the lease is that attempt's; the index, which several runs write, takes a
# lease of its own for its write.

# Counts, not scores: left out of the mean ± sd table.
_NOT_SCORES = ("total", "tokens", "phrases", "found", "correct", "null_score_diff_threshold")
SUBMISSION_DIR = "submission"  # a task folder's leaderboard files
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


def best(scores: Mapping[Any, float]) -> Any:
    """The key with the highest score (the first of equals, in the mapping's order); None when empty."""
    if not scores:
        return None
    top = max(scores.values())
    return next(name for name, score in scores.items() if score == top)


def select(task: str, settings: dict[str, dict[str, Any]], metric: str | None = None) -> str | None:
    """The setting with the best mean dev ``metric`` over seeds (by default the task's selection
    metric), the first of equals in grid order; None when no setting has a score."""
    metric = metric or get_task(task).selection_metric
    return best({name: e["metrics"][metric]["mean"] for name, e in settings.items() if metric in e["metrics"]})


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
    return "\n".join(x.rstrip() for x in out)


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


def clear_task(folder: str, attempt: str | None = None) -> None:
    """Before a task's jobs run into ``folder``: an older run's results there (vouched for as
    ours by a fine-tuning manifest) are removed, so the folder holds this run alone and a run
    whose every job fails leaves no manifest behind. With ``attempt`` (the folder's lease) each
    removal is fenced: an attempt that lost the lease removes nothing (:class:`LeaseLostError`)."""
    if storage.has_manifest(folder) and storage.read_manifest(folder).get("stage") == "finetune":
        if attempt is None:
            storage.remove(storage.join(folder, storage.MANIFEST))  # first: nothing vouches for the rest
            storage.remove(folder)
        elif not lease.clear_if_held(folder, attempt):
            lease.check(folder, attempt, lost=True)


def write_results(
    output: str, cfg: FinetuneConfig, checkpoint: str, data_dir: str, results: list[dict[str, Any]],
    checkpoint_name: str | None = None, versions: dict[str, str] | None = None,
    attempts: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Per task with a finished job, ``<output>/<task>/report.md`` then its ``_MANIFEST.json``
    (stage "finetune": the task's grid, selection, jobs and ``versions[task]``); then the index
    ``<output>/_MANIFEST.json`` (:func:`write_index`). A task whose every job failed gets no
    manifest (nothing finished to vouch for) and shows in the index as failed; with every job of
    every task failed this raises instead. ``attempts`` maps a task to the attempt holding its
    folder's lease: its model and manifest are committed only while it still does. Returns the index.

    Folders, for a checkpoint's folder ``<output>`` (in the pipeline ``finetune/<checkpoint name>``)::

        <output>/_MANIFEST.json                             index (stage "finetune-index")
        <output>/<task>/_MANIFEST.json, report.md           the task (stage "finetune", its version)
        <output>/<task>/model/                              the selected setting's best seed (publish_chosen)
        <output>/<task>/<setting>/seed=<s>/metrics.json     one job (``grid.job_dir``); its model/
                                                            is kept with ``finetune.save_every_job``
    """
    from bert_core.finetune.grid import checkpoint_name as name_of

    if not any(r["ok"] for r in results):
        raise AllJobsFailed("every fine-tuning job failed: " + "; ".join(failure_lines(_failures(results))))
    name = checkpoint_name or name_of(checkpoint)
    failed: dict[str, dict[str, Any]] = {}
    for task in dict.fromkeys(r["task"] for r in results):
        mine = [r for r in results if r["task"] == task]
        if any(r["ok"] for r in mine):
            write_task_manifest(storage.join(output, task), task, cfg, checkpoint, name, data_dir, mine,
                                (versions or {}).get(task), (attempts or {}).get(task))
        else:
            failed[task] = index_entry(task, name, storage.to_uri(checkpoint), None, summarize(mine),
                                       _counts(mine))
    return write_index(output, failed=failed, failures=_failures(results))


def _counts(results: list[dict[str, Any]]) -> dict[str, int]:
    return {"jobs": len(results), "succeeded": sum(r["ok"] for r in results),
            "failed": sum(not r["ok"] for r in results)}


def _failures(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"task": r["task"], "setting": r["setting"]["name"], "seed": r["seed"], "error": r["error"]}
            for r in results if not r["ok"]]


def failure_lines(failures: list[dict[str, Any]], stage: str = "finetune") -> list[str]:
    """One line per distinct error of failed jobs (``task``, ``error`` and ``setting`` / ``seed``
    or ``checkpoint``): a job alone as ``<job>: <error>``, an error shared by several as
    ``<stage>: N jobs failed with the same error: <error> (<first job>, ...)``."""
    by_error: dict[str, list[str]] = {}
    for f in failures:
        job = " ".join(str(part) for part in (f.get("task"), f.get("setting") or f.get("checkpoint")) if part)
        job += f" seed={f['seed']}" if f.get("seed") is not None else ""
        by_error.setdefault(" ".join(str(f.get("error")).split()), []).append(job)
    lines = []
    for error, jobs in by_error.items():
        if len(jobs) == 1:
            lines.append(f"{jobs[0]}: {error}")
        else:
            named = ", ".join(jobs[:3]) + (f", and {len(jobs) - 3} more" if len(jobs) > 3 else "")
            lines.append(f"{stage}: {len(jobs)} jobs failed with the same error: {error} ({named})")
    return lines


def write_task_manifest(
    folder: str, task: str, cfg: FinetuneConfig, checkpoint: str, checkpoint_name: str, data_dir: str,
    results: list[dict[str, Any]], version: str | None, attempt: str | None = None,
) -> dict[str, Any]:
    """``<folder>/report.md``, the chosen model (:func:`publish_chosen`: ``<folder>/model``) and its
    leaderboard files (``<folder>/submission/``, with ``finetune.submission``), then
    ``<folder>/_MANIFEST.json`` for one task's jobs on one checkpoint. The manifest lists their
    files and names the model in ``stats.model``: ``{setting, seed, path}``. With ``attempt`` (the
    folder's lease) the removals and the manifest's commit are fenced (``bert_core.lease``)."""
    from bert_core.finetune.submission import write_submission
    from bert_core.finetune.task_model import job_model_dir

    stats = summarize(results)
    published = publish_chosen(folder, task, results, stats, keep_jobs=cfg.save_every_job, attempt=attempt)
    stats["model"] = None if published is None else {k: published[k] for k in ("setting", "seed", "path")}
    submission = storage.join(folder, SUBMISSION_DIR)
    lease.remove_held(folder, attempt, submission)  # what an earlier, unfinished attempt left
    if published and cfg.submission:
        written = write_submission(task, storage.join(folder, published["path"]), data_dir, submission)
        published["files"] += [f"{SUBMISSION_DIR}/{uri.rsplit('/', 1)[-1]}" for uri in written]
    report_uri = storage.join(folder, "report.md")
    storage.write_text(report_uri, markdown(stats, f"Fine-tuning {storage.to_uri(checkpoint)} "
                                                   f"({checkpoint_name}) on {task}"))
    shards = [storage.shard_entry(report_uri) | {"path": "report.md"}]
    shards += [storage.shard_entry(storage.join(folder, path)) | {"path": path}
               for path in (published or {}).get("files", [])]
    for r in results:
        if r["ok"]:
            job = f"{r['setting']['name']}/seed={r['seed']}"
            shards.append(storage.shard_entry(storage.join(folder, job, "metrics.json"), task=task,
                                              setting=r["setting"]["name"], seed=r["seed"])
                          | {"path": f"{job}/metrics.json"})
            kept = job_model_dir(storage.join(folder, job))  # with finetune.save_every_job
            shards += [storage.shard_entry(uri) | {"path": f"{job}/model/{uri.rsplit('/', 1)[-1]}"}
                       for uri in storage.list_files(kept)]
    inputs = [storage.read_manifest(checkpoint)] if storage.has_manifest(checkpoint) else []
    return storage.write_manifest(
        folder, stage="finetune", config=cfg.model_copy(update={"tasks": [task]}), inputs=inputs,
        shards=shards, counts=_counts(results), stats=stats, task=task, version=version,
        checkpoint=storage.to_uri(checkpoint), checkpoint_name=checkpoint_name,
        data_dir=storage.to_uri(data_dir), failures=_failures(results), model=stats["model"],
        fence=lease.fence(folder, attempt),
    )


def publish_chosen(folder: str, task: str, results: list[dict[str, Any]], stats: dict[str, Any],
                   keep_jobs: bool = False, attempt: str | None = None) -> dict[str, Any] | None:
    """``<folder>/model`` (``folder`` = ``<output>/<task>``): a copy of the model of the selected
    setting's best seed on the selection metric, its card rewritten with that setting's dev and
    final-split scores over seeds, ``config.json`` copied last. Then, unless ``keep_jobs``, the
    jobs' model folders are removed. Returns ``{setting, seed, path, files}`` (``files`` relative
    to ``folder``), or None when no setting was selected or its job saved no model (a
    feature-based task). With ``attempt`` (the folder's lease) nothing is removed or copied once
    the lease is another attempt's."""
    import json

    from bert_core.finetune.grid import Setting, job_dir
    from bert_core.finetune.task_model import MODEL_DIR, job_model_dir, task_card

    spec, summary = get_task(task), stats["summary"][task]
    chosen = summary["selected"]
    folder = storage.to_uri(folder).rstrip("/")
    output = folder.rsplit("/", 1)[0]

    def model_of(r: dict[str, Any]) -> str:
        return job_model_dir(job_dir(output, task, Setting.from_dict(r["setting"]), r["seed"]))

    published = storage.join(folder, MODEL_DIR)
    lease.remove_held(folder, attempt, published)  # what an earlier, unfinished attempt left
    jobs = [r for r in results if r["ok"] and r["task"] == task]
    runs = {r["seed"]: r for r in jobs if r["setting"]["name"] == chosen}
    seed = best({s: r["metrics"]["flat"][spec.selection_metric] for s, r in runs.items()
                 if r["metrics"]["flat"].get(spec.selection_metric) is not None})
    src = model_of(runs[seed]) if seed is not None else None
    out = None
    if src and storage.exists(storage.join(src, "config.json")):
        if attempt is not None:
            lease.check(folder, attempt)
        storage.makedirs(published)
        for uri in storage.list_files(src):
            if uri.rsplit("/", 1)[-1] not in ("config.json", "README.md"):
                storage.copy_file(uri, storage.join(published, uri.rsplit("/", 1)[-1]))
        scores = [f"- the setting chosen on {spec.selection_metric} (the best mean over seeds "
                  f"{', '.join(map(str, sorted(runs)))}); this model is its best seed there, {seed}"]
        splits = [(spec.splits[0], spec.selection_metric)]
        if spec.final_metric != spec.selection_metric:
            splits.append((spec.final_label, spec.final_metric))
        for label, name in splits:
            if name in summary["metrics"]:
                s = summary["metrics"][name]
                scores.append(f"- {label} {spec.metric}: {_mean_sd(task, s)} over {s['n']} seeds; this seed "
                              f"{percent(task, s['values'][str(seed)]):.1f}")
        scores.append(f"- {SCALE_NOTE}")
        hf = json.loads(storage.read_text(storage.join(src, "config.json")))
        storage.write_text(storage.join(published, "README.md"), task_card(hf, scores))
        storage.copy_file(storage.join(src, "config.json"), storage.join(published, "config.json"))  # last: finished
        out = {"setting": chosen, "seed": seed, "path": MODEL_DIR,
               "files": [f"{MODEL_DIR}/{u.rsplit('/', 1)[-1]}" for u in storage.list_files(published)]}
    if not keep_jobs:
        for r in jobs:
            lease.remove_held(folder, attempt, model_of(r))
    return out


def index_entry(task: str, checkpoint_name: str, checkpoint: str, version: str | None,
                stats: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """One task folder as an index lists it: where it came from and the selected setting's score."""
    s = stats["summary"][task]
    return {"checkpoint_name": checkpoint_name, "checkpoint": checkpoint, "task": task,
            "version": version, "selected": s["selected"], "metric": get_task(task).metric,
            "final_label": s["final_label"], "final": s["final"], "failed_seeds": s["failed_seeds"],
            "counts": counts}


def write_index(folder: str, failed: dict[str, dict[str, Any]] | None = None,
                failures: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """``<folder>/_MANIFEST.json`` (stage "finetune-index") over the task folders below it: one
    level down for a checkpoint's folder (``<task>``), two for the fine-tuning root
    (``<checkpoint>/<task>``). Its stats map each task folder's relative path to
    :func:`index_entry`; ``failed`` adds the entries of task folders whose every job failed in
    this run. ``bertpipe stats <folder>`` prints it. Several runs write one index (each
    checkpoint's fine-tuning, the pipeline's fan-out): each reads the task folders and commits
    under the index folder's own lease, so the last to commit has read every task committed
    before it."""
    with lease.hold(folder, "finetune-index") as held:
        return _write_index(folder, held.attempt, failed, failures)


def _write_index(folder: str, attempt: str, failed: dict[str, dict[str, Any]] | None,
                 failures: Iterable[dict[str, Any]]) -> dict[str, Any]:
    entries: dict[str, dict[str, Any]] = {}
    inputs = []
    for depth, pattern in ((1, "*"), (2, "*/*")):
        for uri in storage.glob(storage.join(folder, pattern, storage.MANIFEST)):
            rel = "/".join(uri.split("/")[-1 - depth:-1])
            m = storage.read_manifest(storage.join(folder, rel))
            if m.get("stage") != "finetune" or "task" not in m:
                continue  # a checkpoint folder's own index, or a folder this index does not know
            inputs.append(m)
            checkpoint = storage.relocated(m, m["checkpoint"]) if m.get("checkpoint") else None
            entries[rel] = index_entry(m["task"], m.get("checkpoint_name") or rel.split("/")[0],
                                       checkpoint, m.get("version"), m["stats"], m["counts"])
    entries.update(failed or {})
    counts = {"checkpoints": len({e["checkpoint_name"] for e in entries.values()}), "tasks": len(entries)}
    for key in ("jobs", "succeeded", "failed"):
        counts[key] = sum(e["counts"][key] for e in entries.values())
    return storage.write_manifest(folder, stage="finetune-index", config={}, inputs=inputs,
                                  counts=counts, stats=dict(sorted(entries.items())),
                                  failures=list(failures), fence=lease.fence(folder, attempt))


def task_stats(folder: str, tasks: Iterable[str]) -> dict[str, Any]:
    """``{"grid", "summary"}`` of ``tasks`` read from their folders under ``folder`` (a task
    whose every job failed has no manifest and is left out)."""
    out: dict[str, Any] = {"grid": {}, "summary": {}}
    for task in tasks:
        sub = storage.join(folder, task)
        if storage.has_manifest(sub):
            stats = storage.read_manifest(sub)["stats"]
            out["grid"].update(stats["grid"])
            out["summary"].update(stats["summary"])
    return out


def index_rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task folder of an index: the selected setting's final score (0-100)."""
    rows = []
    for e in manifest["stats"].values():
        final = e["final"]
        rows.append({
            "checkpoint": e["checkpoint_name"], "task": e["task"], "metric": e["metric"],
            "selected": e["selected"] or "none (all failed)", "final split": e["final_label"],
            "final (0-100)": "-" if final is None else
            f"{final['mean']:.1f} ± {final['sd']:.1f} (n={final['n']})",
            "jobs ok/failed": f"{e['counts']['succeeded']}/{e['counts']['failed']}",
            "version": e["version"] or "-",
        })
    return rows


def format_manifest(manifest: dict[str, Any]) -> str:
    """What ``bertpipe stats`` prints for a fine-tuning folder: an index lists every task folder
    below it, a task folder its whole grid."""
    order = ("checkpoints", "tasks", "jobs", "succeeded", "failed")  # JSON brings keys back sorted
    counts = ", ".join(f"{k} {v}" for k, v in sorted(
        manifest.get("counts", {}).items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    head = f"{manifest['stage']} at {manifest['uri']} ({manifest['created']}): {counts}"
    if manifest["stage"] == "finetune-index":
        return "\n".join([head, format_table(index_rows(manifest)), SCALE_NOTE])
    lines = [head, f"checkpoint {manifest.get('checkpoint_name')}: {manifest.get('checkpoint')}, "
                   f"version {manifest.get('version') or '-'}", format_table(table_rows(manifest["stats"]))]
    lines += [f"FAILED {line}" for line in failure_lines(manifest.get("failures", []))]
    return "\n".join(lines)


def run_many(
    tasks: list[str], seeds: list[int], data_dir: str, checkpoint: str, cfg: FinetuneConfig,
    output: str, log: Callable[[str], None] | None = None, checkpoint_name: str | None = None,
    versions: dict[str, str] | None = None, on_progress: OnProgress | None = None,
) -> dict[str, Any]:
    """Every (task, setting, seed) one after another in this process; returns the index of
    ``output`` (:func:`write_results`). ``on_progress`` is told the jobs done of all (phase
    "jobs", a failed one counted done) and each job's training steps."""
    from bert_core.finetune.grid import settings
    from bert_core.finetune.train import run_job

    results = []
    total = len(tasks) * len(settings(cfg)) * len(seeds)

    def jobs_done() -> None:
        if on_progress:
            on_progress(Update("finetune", "jobs", len(results), total, "jobs"))

    jobs_done()
    with contextlib.ExitStack() as stack:  # one attempt at a time writes a task's folder
        attempts = {t: stack.enter_context(lease.hold(storage.join(output, t), "finetune")).attempt
                    for t in sorted(tasks)}
        for task in tasks:
            clear_task(storage.join(output, task), attempts[task])
            for setting in settings(cfg):
                job_cfg = setting.job_config(cfg)
                for seed in seeds:
                    what = f"finetune {task} {setting.name} seed={seed}"
                    if log:
                        log(what)
                    r = job_result(task, setting.as_dict(), seed, lambda t=task, c=job_cfg, s=seed:
                                   run_job(t, data_dir, checkpoint, c, s, output, log=log, on_progress=on_progress,
                                           attempt=attempts[t]))
                    if log and not r["ok"]:
                        log(f"{what} FAILED: {r['error']}")
                    results.append(r)
                    jobs_done()
        return write_results(output, cfg, checkpoint, data_dir, results, checkpoint_name, versions, attempts)
