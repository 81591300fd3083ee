"""Prefect flow of the vocab stage: documents -> WordPiece ``vocab.txt`` + ``tokenizer.json``.

    bertpipe run --preset demo                              (as part of the whole DAG, flows/pipeline.py)
    bertpipe vocab --corpus C --output O [--vocab-file F]   (the same work without Prefect)

The work is ``beam_jobs.build_vocab.build_vocab``; this flow runs it with ``config.vocab``,
publishes the markdown artifact ``vocab-report`` (size, casing, UNK rate, pieces per word, top
tokens, token length histogram) and returns ``output``. A finished ``output`` (it has its
manifest) is not redone (flows/versions.py).
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from bert_core.config import PipelineConfig
from bert_core.vocab.training import report_markdown
from flows.versions import finished_manifest


@flow(name="vocab", log_prints=True, timeout_seconds=24 * 3600)
def build_vocab(config: PipelineConfig, corpus: str, output: str) -> str:
    """A WordPiece vocab trained on the corpus stage's documents (or ``config.vocab.vocab_file``)."""
    from beam_jobs.build_vocab import build_vocab as run_job
    from flows.artifacts import histogram, markdown_image, publish_markdown

    logger = get_run_logger()
    manifest = finished_manifest("vocab", output, lambda: run_job(
        corpus, output, config.vocab, workers=config.workers, runner=config.beam_runner,
        beam_args=config.beam_args, shared_storage=config.shared_storage))
    logger.info("vocab: %s", manifest["counts"])
    md = report_markdown(manifest)
    if manifest["stats"].get("token_length_histogram"):
        fig = histogram(manifest["stats"]["token_length_histogram"], "Vocab token lengths",
                        "characters (without ##)")
        md += "\n\n" + markdown_image(fig, "token lengths")
    publish_markdown("vocab-report", md, f"WordPiece vocab of {manifest['uri']}")
    return output
