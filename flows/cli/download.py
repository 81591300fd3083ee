"""``bertpipe download``: raw corpora, verified against their publisher's checksums.

    bertpipe download wikipedia --date 20240601 --lang en --to ./bertpipe-data/raw/enwiki/20240601
"""

from __future__ import annotations

from typing import Annotated

import typer


def download_wikipedia(
    date: Annotated[str, typer.Option(help="Dump date, YYYYMMDD (see dumps.wikimedia.org).")],
    to: Annotated[str, typer.Option(help="Destination folder or URI (gs://...).")],
    lang: Annotated[str, typer.Option(help="Wiki language code.")] = "en",
    job: Annotated[str, typer.Option(help="articlesdump or articlesmultistreamdump.")] = "articlesdump",
    base_url: Annotated[
        str | None, typer.Option(help="Dump site or mirror (default $BERTPIPE_DUMPS_URL or Wikimedia).")
    ] = None,
    staging: Annotated[str | None, typer.Option(help="Local folder for resumable .part files.")] = None,
    retries: Annotated[int, typer.Option(help="Resume attempts per file.")] = 5,
) -> None:
    """Download the articles files of a Wikipedia dump, verified against the site's sha1 sums."""
    from bert_core.corpus.download import download_wikipedia as run

    manifest = run(lang, date, to, job=job, base=base_url, staging=staging, retries=retries,
                   log=lambda m: typer.echo(m, err=True))
    typer.echo(f"{manifest['counts']['files']} file(s), {manifest['counts']['bytes']} bytes -> {manifest['uri']}")
