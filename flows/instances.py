"""Prefect flow of the instance stage: documents + vocab -> MLM (and NSP) instance shards per length.

    bertpipe instances --corpus C --vocab V --output O    (the same work without Prefect)

Runs ``beam_jobs.create_instances.run``, its progress live (``instances-progress``: documents
read, pools, shards written), and publishes its statistics
(``instances-stats``) and length histogram (``instances-lengths``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from bert_core.config import PipelineConfig
from flows.versions import finished_manifest, output_run_name, stage_paths


def stats_rows(manifest: dict[str, Any], nsp: bool = True) -> list[dict[str, Any]]:
    """One table row per length from an instances manifest's stats and counts; the share of
    random next sentences only where the instances have next-sentence pairs (``nsp``)."""
    rows = []
    # the manifest's keys are sorted as text (seq128 < seq64): order by length again
    for name, s in sorted(manifest["stats"].items(), key=lambda kv: kv[1]["max_seq_length"]):
        rows.append({
            "set": name, "instances": s["instances"],
            "eval_instances": manifest["counts"].get(f"eval_instances_{name}", 0), "tokens": s["tokens"],
            "mean_length": s["mean_length"], "masked_fraction": s["masked_fraction"],
            "mask_token": s["mask_token_fraction"], "kept": s["kept_fraction"],
            "random_token": s["random_token_fraction"],
        } | ({"random_next": s["random_next_fraction"]} if nsp else {}))
    return rows


@flow(name="instances", flow_run_name=output_run_name, log_prints=True, timeout_seconds=24 * 3600)
def create_instances(config: PipelineConfig, corpus: str | None = None, vocab: str | None = None,
                     output: str | None = None) -> str:
    """Masked-LM instances (with next-sentence pairs where configured) from the corpus stage's
    documents and the vocab stage's vocab; the folders not given are the version folders of
    ``config``."""
    from beam_jobs import create_instances as job
    from flows.artifacts import (
        histogram,
        markdown_image,
        publish_markdown,
        publish_table,
        stage_progress,
    )

    corpus, vocab, output = stage_paths(config, "instances", corpus=corpus, vocab=vocab,
                                        output=output).values()
    logger = get_run_logger()
    with stage_progress("instances") as on_progress:
        manifest = finished_manifest("instances", output, lambda: job.run(
            config.instances, corpus, vocab, output, lowercase=config.vocab.lowercase,
            workers=config.workers, runner=config.beam_runner, beam_args=config.beam_args,
            shared_storage=config.shared_storage, on_progress=on_progress))
    logger.info("instances: %s", manifest["counts"])
    publish_table("instances-stats", stats_rows(manifest, nsp=config.instances.next_sentence_prediction),
                  f"Instance statistics of {manifest['uri']}")
    pictures = [
        markdown_image(histogram(s["length_histogram"], f"{name}: instance lengths", "tokens"), name)
        for name, s in manifest["stats"].items()
    ]
    publish_markdown("instances-lengths", "\n\n".join(pictures), "Instance length histograms")
    return output
