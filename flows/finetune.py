"""Prefect flow of the fine-tuning stage: tasks x seeds from one checkpoint, mean ± sd per task.

    bertpipe run --preset demo                      (as part of the whole DAG, flows/pipeline.py)
    bertpipe finetune --task mrpc --seeds 1,2,3 --data D --checkpoint C --output O --prefect

Each (task, seed) is one Prefect task run (``finetune_one.map`` over the pairs). A failing job
does not stop the others: states are collected with ``return_state``-style waiting, failures
land in the summary and the manifest. The table artifact ``finetune-results`` shows every
task's metrics as mean ± sd with the per-seed values and the failed seeds. The work itself is
``bert_core.finetune.train.run_job``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from bert_core import storage
from bert_core.config import FinetuneConfig, PipelineConfig


@task(cache_policy=NO_CACHE, task_run_name="finetune-{task_name}-seed{seed}")
def finetune_one(task_name: str, seed: int, data_dir: str, checkpoint: str, cfg: FinetuneConfig,
                 output: str) -> dict[str, Any]:
    """One job; returns its metrics.json content."""
    from bert_core.finetune.train import run_job

    logger = get_run_logger()
    return run_job(task_name, data_dir, checkpoint, cfg, seed, output, log=logger.info)


# One job at a time: each job already uses `finetune.threads` cores, and the CPU is shared.
@flow(name="finetune", log_prints=True, timeout_seconds=24 * 3600,
      task_runner=ThreadPoolTaskRunner(max_workers=1))
def finetune(config: PipelineConfig, checkpoint: str, output: str) -> str:
    """Fine-tune ``checkpoint`` on every ``finetune.tasks`` x ``finetune.seeds``; write ``output``."""
    from bert_core.finetune import get_task
    from bert_core.finetune.report import table_rows, write_run_manifest
    from flows.artifacts import publish_table

    logger = get_run_logger()
    cfg = config.finetune
    if not cfg.data_dir:
        raise ValueError("finetune.data_dir is not set; point it at a folder with one sub-folder per task")
    tasks = [get_task(t).name for t in cfg.tasks]  # unknown names fail before any work
    pairs = [(t, s) for t in tasks for s in cfg.seeds]
    futures = finetune_one.map(
        [t for t, _ in pairs], [s for _, s in pairs], unmapped(cfg.data_dir), unmapped(checkpoint),
        unmapped(cfg), unmapped(output),
    )
    results = []
    for (task_name, seed), future in zip(pairs, futures, strict=True):
        future.wait()
        state = future.state
        if state.is_completed():
            results.append({"task": task_name, "seed": seed, "ok": True, "metrics": future.result()})
        else:
            message = state.message or state.name
            logger.warning("finetune %s seed=%s failed: %s", task_name, seed, message)
            results.append({"task": task_name, "seed": seed, "ok": False, "error": message})
    manifest = write_run_manifest(output, cfg, checkpoint, cfg.data_dir, results)
    publish_table("finetune-results", table_rows(manifest["stats"]["summary"]),
                  f"Fine-tuning {storage.to_uri(checkpoint)}: mean ± sd over seeds {cfg.seeds}")
    logger.info("finetune: %s", manifest["counts"])
    return output
