"""Prefect flow of the pre-training stage: instances -> DeepSpeed run folder (all phases).

    bertpipe pretrain --preset demo --instances I --output RUN    (the same launch without Prefect)

Launches ``bert_core.pretrain.launch.launch_pretraining`` and mirrors the run's
``metrics.jsonl`` into live artifacts (``pretrain-progress``, ``pretrain-metrics``), then the
curves and each phase's eval (``pretrain-report``). The launch alone is retried, and only after
an infrastructure failure; each retry resumes from the last checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task

from bert_core import storage
from bert_core.config import PipelineConfig
from bert_core.pretrain.extend import describe, extend_run, read_extended
from bert_core.pretrain.run_folder import check_run_config, steps_done, total_steps
from flows.retry import retry_on_infrastructure
from flows.versions import SKIPPED, is_done, output_run_name, stage_paths

TABLE_EVERY_S = 30.0
METRIC_COLUMNS = ("kind", "phase", "step", "loss", "mlm_loss", "mlm_acc", "nsp_loss", "nsp_acc", "lr",
                  "seq_per_s", "tokens_per_s", "mfu")
NSP_COLUMNS = ("nsp_loss", "nsp_acc")


def metric_columns(config: PipelineConfig) -> list[str]:
    """The metrics table's columns: the next-sentence ones only where NSP is trained."""
    nsp = config.instances.next_sentence_prediction
    return [c for c in METRIC_COLUMNS if nsp or c not in NSP_COLUMNS]


class MetricsWatcher:
    """Follows ``RUN/metrics.jsonl`` and mirrors it into Prefect artifacts."""

    def __init__(self, config: PipelineConfig, run: str) -> None:
        from bert_core.pretrain.metrics import MetricsTail

        self.config, self.run = config, run
        self.columns = metric_columns(config)
        self.tail = MetricsTail(run)
        self.seen = -1
        self.table_at = 0.0

    def poll(self, final: bool = False) -> list[dict[str, Any]]:
        from bert_core.pretrain.metrics import kind, train_rows
        from flows.artifacts import progress, publish_table

        rows = self.tail.poll()
        if len(rows) != self.seen or final:
            self.seen = len(rows)
            done, total = steps_done(self.config, rows), total_steps(self.config)
            train = train_rows(rows)
            loss = f", loss {train[-1]['loss']:.4f}" if train else ""
            progress("pretrain-progress", done / total, f"pre-training: step {done}/{total}{loss}")
            if rows and (final or time.monotonic() - self.table_at > TABLE_EVERY_S):
                self.table_at = time.monotonic()
                publish_table("pretrain-metrics", [{k: r.get(k) for k in self.columns} | {"kind": kind(r)}
                                                   for r in rows],
                              f"Pre-training metrics of {self.run}")
        return rows


@task(name="launch-deepspeed", retry_delay_seconds=15, retry_condition_fn=retry_on_infrastructure)
def launch(config: PipelineConfig, instances: str, output: str, init_checkpoint: str | None,
           node_rank: int | None) -> str:
    from bert_core.pretrain.launch import launch_pretraining

    logger = get_run_logger()
    watcher = MetricsWatcher(config, output)

    def on_line(line: str) -> None:
        # DeepSpeed's own timestamped launcher chatter goes to debug; rank 0's lines to info.
        (logger.debug if line.startswith("[20") else logger.info)(line)
        watcher.poll()

    launch_pretraining(config, instances, output, init_checkpoint, node_rank, on_line)
    watcher.poll(final=True)
    return output


@flow(name="pretrain", flow_run_name=output_run_name, log_prints=True, timeout_seconds=7 * 24 * 3600)
def pretrain(config: PipelineConfig, instances: str | None = None, output: str | None = None,
             init_checkpoint: str | None = None, node_rank: int | None = None,
             extend_to: int | None = None) -> str:
    """Pre-train BERT on the instances (every phase of ``config.pretrain``) into the run folder;
    the folders not given are the version folders of ``config``. ``extend_to`` continues the
    finished run to that many steps of its last phase (``bert_core.pretrain.extend``)."""
    from flows.artifacts import markdown_image, publish_markdown
    from flows.report import objective, pretrain_curves

    instances, output = stage_paths(config, "pretrain", instances=instances, output=output).values()
    logger = get_run_logger()
    if extend_to is not None:  # refused in one line, never retried; node 0 makes the folder ready
        from bert_core.pretrain.loop import check_instances

        config = extend_run(config, output, extend_to, prepare=not node_rank,
                            check=lambda c: check_instances(c, instances, init_checkpoint))
        if not node_rank:
            logger.info(describe(read_extended(output)[-1]))
    check_run_config(config, output)  # a run folder of another config: refused, never retried
    if is_done(output):
        logger.info("pretrain: %s, %s has a manifest; not redone", SKIPPED, output)
        MetricsWatcher(config, output).poll(final=True)
    else:
        # The one retry site of pre-training: each retry resumes from the last checkpoint.
        launch.with_options(retries=config.pretrain.launch_retries)(
            config, instances, output, init_checkpoint, node_rank)
    if node_rank:  # another node's launcher: rank 0's node writes the manifest and the report
        return output
    manifest = storage.read_manifest(output)
    from bert_core.pretrain.metrics import read_metrics

    nsp = config.instances.next_sentence_prediction
    figs = pretrain_curves(read_metrics(output), nsp=nsp)
    stats = manifest["stats"]
    md = [f"**Run** `{output}`: {manifest['counts'].get('steps')} steps, loss "
          f"{stats.get('first_loss'):.4f} -> {stats.get('last_loss'):.4f}; export `{manifest.get('hf')}`"]
    md += [f"**Eval, phase {p['phase']}** (step {e['step']}, {e['instances']} instances): loss {e['loss']:.4f}, "
           f"mlm_acc {e['mlm_acc']:.4f}" + (f", nsp_acc {e['nsp_acc']:.4f}" if nsp else "")
           for p in stats.get("phases", []) if (e := p.get("eval"))]
    md += [markdown_image(fig, name) for name, fig in figs.items()]
    publish_markdown("pretrain-report", "\n\n".join(md), f"Pre-training ({objective(nsp)}) loss and accuracy")
    return output
