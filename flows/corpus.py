"""Prefect flow of the corpus stage: Wikipedia dumps + books + text records -> cleaned documents.

    bertpipe corpus --wikipedia GLOB --books GLOB --text GLOB --output URI   (the same work without Prefect)

Runs ``beam_jobs.clean_corpus.run``, its progress live (``corpus-progress``: bytes of input
read, records, rate, ETA), and publishes its counts (``corpus-counts``: kept and
rejected by reason) and length histograms (``corpus-lengths``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from bert_core.config import PipelineConfig
from flows.versions import finished_manifest, output_run_name, stage_paths


def count_rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows: per source the read/kept/rejected totals, then one row per reject reason."""
    rows = []
    for source, c in manifest["counts"].items():
        if not isinstance(c, dict):
            continue
        rows.append({"source": source, "what": "read", "records": c["read"]})
        rows.append({"source": source, "what": "kept", "records": c["kept"]})
        for reason, n in c["rejected_by_reason"].items():
            rows.append({"source": source, "what": f"rejected: {reason}", "records": n})
    return rows


@flow(name="corpus", flow_run_name=output_run_name, log_prints=True, timeout_seconds=24 * 3600)
def clean_corpus(config: PipelineConfig, output: str | None = None) -> str:
    """Clean ``config.corpus.wikipedia`` dumps, ``config.corpus.books`` and ``config.corpus.text``
    records into documents, in ``output`` (default: the corpus version folder of ``config``)."""
    from beam_jobs import clean_corpus as job
    from flows.artifacts import (
        histogram,
        markdown_image,
        publish_markdown,
        publish_table,
        stage_progress,
    )

    output = stage_paths(config, "corpus", output=output)["output"]
    logger = get_run_logger()
    with stage_progress("corpus") as on_progress:
        manifest = finished_manifest("corpus", output, lambda: job.run(
            config.corpus, output, workers=config.workers, runner=config.beam_runner,
            beam_args=config.beam_args, shared_storage=config.shared_storage, on_progress=on_progress))
    counts = manifest["counts"]
    logger.info("corpus: %s documents, %s sentences, %s rejects", counts["documents"],
                counts["sentences"], counts["rejects"])
    publish_table("corpus-counts", count_rows(manifest),
                  f"Records read, kept and rejected (by reason) for {manifest['uri']}")
    stats = manifest["stats"]
    pictures = [
        markdown_image(histogram(stats["sentences_per_doc"], "Sentences per document", "sentences"),
                       "sentences per document"),
        markdown_image(histogram(stats["chars_per_doc"], "Characters per document", "characters"),
                       "characters per document"),
    ]
    publish_markdown("corpus-lengths", "\n\n".join(pictures), "Document length histograms")
    return output

