"""Prefect flow of the vocab stage: documents -> WordPiece ``vocab.txt`` + ``tokenizer.json``.

    bertpipe vocab --corpus C --output O [--vocab-file F]   (the same work without Prefect)

Runs ``beam_jobs.build_vocab.run``, its progress live (``vocab-progress``: documents counted,
words given to the trainer), and publishes the ``vocab-report`` artifact.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from bert_core.config import PipelineConfig
from bert_core.vocab.training import report_markdown
from flows.versions import finished_manifest, output_run_name, stage_paths


@flow(name="vocab", flow_run_name=output_run_name, log_prints=True, timeout_seconds=24 * 3600)
def build_vocab(config: PipelineConfig, corpus: str | None = None, output: str | None = None) -> str:
    """A WordPiece vocab trained on the corpus stage's documents (or ``config.vocab.vocab_file``);
    the folders not given are the version folders of ``config``."""
    from beam_jobs import build_vocab as job
    from flows.artifacts import histogram, markdown_image, publish_markdown, stage_progress

    corpus, output = stage_paths(config, "vocab", corpus=corpus, output=output).values()
    logger = get_run_logger()
    with stage_progress("vocab") as on_progress:
        manifest = finished_manifest("vocab", output, lambda: job.run(
            config.vocab, corpus, output, workers=config.workers, runner=config.beam_runner,
            beam_args=config.beam_args, shared_storage=config.shared_storage, on_progress=on_progress))
    logger.info("vocab: %s", manifest["counts"])
    md = report_markdown(manifest)
    if manifest["stats"].get("token_length_histogram"):
        fig = histogram(manifest["stats"]["token_length_histogram"], "Vocab token lengths",
                        "characters (without ##)")
        md += "\n\n" + markdown_image(fig, "token lengths")
    publish_markdown("vocab-report", md, f"WordPiece vocab of {manifest['uri']}")
    return output
