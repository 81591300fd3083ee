"""Prefect flow of the fine-tuning stage: tasks x settings x seeds on one checkpoint, the best
setting per task chosen on dev and reported on the final split.

    bertpipe finetune --task mrpc --seeds 1,2,3 --data D --checkpoint C --output O --prefect

Each (task, setting, seed) is a task run named by what it is, here or, with
``finetune.deployment`` set, as a child flow run on that deployment's work pool. The work is
``bert_core.finetune.train.run_job``; the ``finetune-progress`` artifact counts the jobs done
while they run, and the ``finetune-results`` artifact shows the grid on 0-100. Each job saves its
model; ``write_results`` publishes the selected setting's best seed as ``<output>/<task>/model``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from bert_core import lease, storage
from bert_core.config import FinetuneConfig, PipelineConfig


def _run_here(job: dict[str, Any], data_dir: str, checkpoint: str, cfg: FinetuneConfig, output: str,
              log) -> dict[str, Any]:
    from bert_core.finetune.grid import Setting
    from bert_core.finetune.train import run_job

    job_cfg = Setting.from_dict(job["setting"]).job_config(cfg)
    return run_job(job["task"], data_dir, checkpoint, job_cfg, job["seed"], output, log=log,
                   attempt=job.get("attempt"))


@task(cache_policy=NO_CACHE, task_run_name="{name}")
def finetune_one(name: str, job: dict[str, Any], config: PipelineConfig, checkpoint: str,
                 output: str, checkpoint_name: str) -> dict[str, Any]:
    """One job, here or on the deployment's work pool; returns its metrics.json content."""
    cfg = config.finetune
    if not cfg.deployment:
        return _run_here(job, cfg.data_dir, checkpoint, cfg, output, get_run_logger().info)
    from bert_core.finetune.grid import Setting, job_dir
    from flows.dispatch import run_on_deployment

    run_on_deployment(cfg.deployment, name, {"config": config.model_dump(mode="json"), "checkpoint": checkpoint,
                                             "output": output, "checkpoint_name": checkpoint_name, "job": job},
                      key=f"{output}#{name}")
    folder = job_dir(output, job["task"], Setting.from_dict(job["setting"]), job["seed"])
    return json.loads(storage.read_text(storage.join(folder, "metrics.json")))


def run_name() -> str:
    """``finetune-sst2-minilm`` for a checkpoint's tasks, the job's own name for one job."""
    from prefect.runtime import flow_run

    from bert_core.finetune.grid import Setting, checkpoint_name, job_name

    p = flow_run.parameters
    config = p["config"]
    tasks = config.finetune.tasks if hasattr(config, "finetune") else config["finetune"]["tasks"]
    label = p.get("checkpoint_name") or checkpoint_name(p["checkpoint"])
    job = p.get("job")
    if job:
        return job_name(job["task"], label, Setting.from_dict(job["setting"]), job["seed"])
    return f"finetune-{'+'.join(tasks)}-{label}"


@flow(name="finetune", flow_run_name=run_name, log_prints=True, timeout_seconds=24 * 3600)
def finetune(config: PipelineConfig, checkpoint: str, output: str, checkpoint_name: str | None = None,
             job: dict[str, Any] | None = None) -> Any:
    """Fine-tune ``checkpoint`` (a folder, or ``models:current``) on every ``finetune.tasks`` x
    setting x seed; select per task; write ``output`` (the checkpoint's folder) and return it.
    Given ``job`` (``{task, setting, seed}``, as the fan-out sends it to a deployment), run that
    one job into its folder under ``output`` and return its metrics."""
    from bert_core.finetune import get_task
    from bert_core.finetune.grid import checkpoint_name as name_of
    from bert_core.refresh.registry import (
        Registry,
        registered_version,
        registry_root,
        resolve_checkpoint,
        task_models,
    )
    from flows.versions import checkpoint_identity, finetune_version, is_done

    logger = get_run_logger()
    registered = registered_version(checkpoint, config.storage_root)
    checkpoint = resolve_checkpoint(checkpoint, config.storage_root)
    cfg = config.finetune
    if not cfg.data_dir:
        raise ValueError("finetune.data_dir is not set; point it at a folder with one sub-folder per task")
    if job is not None:
        return _run_here(job, cfg.data_dir, checkpoint, cfg, output, logger.info)
    label = checkpoint_name or name_of(checkpoint)
    tasks = [get_task(t).name for t in cfg.tasks]  # unknown names fail before any work
    ident = checkpoint_identity(checkpoint, config.storage_root)  # so does a missing checkpoint
    versions = {t: finetune_version(config, t, ident) for t in tasks}
    with contextlib.ExitStack() as held:
        # One attempt at a time writes a task's folder (a schedule beside a manual run). Work
        # finished at these versions, by another run while this one waited or before it took the
        # leases, is never redone: the other run is reading it.
        attempts = {t: held.enter_context(lease.hold(storage.join(output, t), "finetune")).attempt
                    for t in sorted(tasks)}
        if all(is_done(storage.join(output, t), versions[t]) for t in tasks):
            logger.info("finetune: %s, finished at these versions; not redone", output)
            return output
        _fine_tune(config, checkpoint, output, label, tasks, versions, logger, attempts)
    if registered:  # a registered model: the registry lists the task models fine-tuned from it
        Registry(registry_root(config.storage_root)).add_task_models(registered, task_models(output, tasks))
    return output


def _fine_tune(config: PipelineConfig, checkpoint: str, output: str, label: str, tasks: list[str],
               versions: dict[str, str], logger: Any, attempts: dict[str, str]) -> str:
    """Every job of ``tasks`` into ``output``, the selection per task and the index (the task
    folders' leases held by ``attempts``, which fence each task's clearing and commit)."""
    from bert_core.finetune.grid import job_name, settings
    from bert_core.finetune.report import clear_task, summarize, table_rows, write_results
    from bert_core.progress import Update
    from flows.artifacts import publish_table, stage_progress

    cfg = config.finetune
    for t in tasks:
        clear_task(storage.join(output, t), attempts[t])
    jobs = {job_name(t, label, s, seed): {"task": t, "setting": s.as_dict(), "seed": seed}
            for t in tasks for s in settings(cfg) for seed in cfg.seeds}
    # The runner's workers are the concurrency limit: jobs beyond it wait for a free one.
    with ThreadPoolTaskRunner(max_workers=cfg.max_parallel_jobs) as runner, \
            stage_progress("finetune") as on_progress:
        futures = [runner.submit(finetune_one, parameters={
            "name": name, "job": {**j, "attempt": attempts[j["task"]]},  # it writes under its task's attempt
            "config": config, "checkpoint": checkpoint, "output": output, "checkpoint_name": label})
            for name, j in jobs.items()]
        results = []
        on_progress(Update("finetune", "jobs", 0, len(jobs), "jobs"))
        for (name, j), future in zip(jobs.items(), futures, strict=True):
            future.wait()
            on_progress(Update("finetune", "jobs", len(results) + 1, len(jobs), "jobs"))
            state = future.state
            if state.is_completed():
                results.append({**j, "ok": True, "metrics": future.result()})
            else:
                message = state.message or state.name
                logger.warning("%s failed: %s", name, message)
                results.append({**j, "ok": False, "error": message})
    index = write_results(output, cfg, checkpoint, cfg.data_dir, results, label, versions, attempts)
    publish_table("finetune-results", table_rows(summarize(results)),
                  f"Fine-tuning {storage.to_uri(checkpoint)} ({label}): dev mean ± sd over seeds "
                  f"{cfg.seeds} for every setting, the selected one (✓) on its final split; "
                  "scores on 0-100")
    logger.info("finetune: %s; results in %s (bertpipe stats %s)", index["counts"], output, output)
    return output
