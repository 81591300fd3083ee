"""Prefect flow of the corpus stage: Wikipedia dumps + books -> cleaned documents.

    bertpipe run --preset demo                       (as part of the whole DAG, flows/pipeline.py)
    bertpipe clean --wikipedia GLOB --books GLOB --output URI   (the same work without Prefect)

The work is ``beam_jobs.clean_corpus.clean``; this flow runs it on ``config.corpus`` (its
globs are the inputs), publishes the counts as the table artifact ``corpus-counts`` (one row per
source and reject reason, kept + rejected = read) and the length histograms as
``corpus-lengths``, and returns ``output``. A folder whose manifest holds the same CorpusConfig
and the same input files is not redone.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from bert_core import storage
from bert_core.config import PipelineConfig


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


def _already_done(output: str, config: PipelineConfig) -> bool:
    if not storage.has_manifest(output):
        return False
    from beam_jobs.clean_corpus import expand_inputs

    done = storage.read_manifest(output)
    inputs = {"wikipedia": expand_inputs(config.corpus.wikipedia, "wikipedia"),
              "books": expand_inputs(config.corpus.books, "books")}
    return done["config"] == config.corpus.model_dump(mode="json") and done.get("input_files") == inputs


@flow(name="clean-corpus", log_prints=True, timeout_seconds=24 * 3600)
def clean_corpus(config: PipelineConfig, output: str) -> str:
    """Clean ``config.corpus.wikipedia`` dumps and ``config.corpus.books`` into documents."""
    from beam_jobs.clean_corpus import clean
    from flows.artifacts import histogram, markdown_image, publish_markdown, publish_table

    logger = get_run_logger()
    if _already_done(output, config):
        logger.info("corpus already at %s (same config and inputs); not redone", output)
        manifest = storage.read_manifest(output)
    else:
        manifest = clean(config.corpus, output, workers=config.workers, runner=config.beam_runner,
                         beam_args=config.beam_args)
    counts = manifest["counts"]
    logger.info("corpus: %s documents, %s sentences, %s rejects", counts["documents"],
                counts["sentences"], counts["rejects"])
    publish_table("corpus-counts", count_rows(manifest),
                  f"Records read, kept and rejected (by reason) for {manifest['uri']}")
    stats = manifest["stats"]
    pictures = [
        markdown_image(histogram(_positions(stats["sentences_per_doc"]), "Sentences per document",
                                 "sentences (bin start)"), "sentences per document"),
        markdown_image(histogram(_positions(stats["chars_per_doc"]), "Characters per document",
                                 "characters (bin start)"), "characters per document"),
    ]
    publish_markdown("corpus-lengths", "\n\n".join(pictures), "Document length histograms")
    return output


def _positions(bins: dict[str, int]) -> dict[int, int]:
    """{"10-19": n, ...} -> {bin index: n}: log-ish bins drawn evenly spaced."""
    return {i: n for i, n in enumerate(bins.values())}
