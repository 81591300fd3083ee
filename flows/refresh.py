"""Corpus refresh: download the newest finished Wikipedia dump, then clean it (with the books).

    bertpipe serve --only refresh-corpus/monthly      (the monthly schedule of infra/prefect.yaml)

The corpus lands in the folder ``bert_pipeline`` computes for the same config, so the next
pipeline run picks it up.
"""

from __future__ import annotations

import datetime as dt

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from bert_core import storage
from bert_core.config import PipelineConfig
from flows.retry import retry_on_infrastructure
from flows.versions import SKIPPED, corpus_folder, is_done


def candidate_dates(today: dt.date) -> list[str]:
    """Dump dates (1st and 20th) of this month and last month that are not in the future."""
    prev = (today.replace(day=1) - dt.timedelta(days=1)).replace(day=1)
    dates = [today.replace(day=20), today.replace(day=1), prev.replace(day=20), prev]
    return [d.strftime("%Y%m%d") for d in dates if d <= today]


@task(retries=3, retry_delay_seconds=60, retry_condition_fn=retry_on_infrastructure,
      cache_policy=NO_CACHE, task_run_name="find-dump-{lang}")
def find_dump(lang: str, dates: list[str], base_url: str | None) -> str:
    from bert_core.corpus.download import DownloadError, list_dump_files

    logger = get_run_logger()
    reasons = []
    for date in dates:
        try:
            files = list_dump_files(lang, date, base=base_url)
        except DownloadError as err:
            reasons.append(f"{date}: {err}")
            continue
        logger.info("newest finished %swiki dump: %s (%d files)", lang, date, len(files))
        return date
    raise LookupError(f"no finished {lang}wiki articles dump among {dates}:\n" + "\n".join(reasons))


@task(retries=3, retry_delay_seconds=60, retry_condition_fn=retry_on_infrastructure,
      cache_policy=NO_CACHE, task_run_name="download-{lang}wiki-{date}")
def download(lang: str, date: str, to: str, base_url: str | None) -> str:
    from bert_core.corpus.download import download_wikipedia

    logger = get_run_logger()
    if is_done(to):
        logger.info("%s: %s, already downloaded and verified", to, SKIPPED)
        return to
    download_wikipedia(lang, date, to, base=base_url, log=logger.info)
    return to


def refresh_run_name() -> str:
    """``enwiki-20240601``, or ``enwiki-latest`` when the newest finished dump is looked up."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"{p.get('lang', 'en')}wiki-{p.get('date') or 'latest'}"


@flow(name="refresh-corpus", flow_run_name=refresh_run_name, log_prints=True)
def refresh_corpus(
    config: PipelineConfig, lang: str = "en", date: str | None = None, base_url: str | None = None
) -> str:
    """Download a dump (newest finished one unless ``date``) and clean it; returns the corpus URI."""
    from flows.corpus import clean_corpus

    dates = [date] if date else candidate_dates(dt.datetime.now(dt.timezone.utc).date())
    date = find_dump(lang, dates, base_url)
    raw = download(lang, date, storage.join(config.storage_root, "raw", "wikipedia", f"{lang}wiki-{date}"),
                   base_url)
    corpus_cfg = config.corpus.model_copy(update={"wikipedia": [storage.join(raw, "*.bz2")]})
    config = config.model_copy(update={"corpus": corpus_cfg})
    output = corpus_folder(config)
    if is_done(output):
        get_run_logger().info("corpus: %s, %s has a manifest", SKIPPED, output)
        return output
    return clean_corpus(config, output)
