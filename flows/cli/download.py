"""``bertpipe download``: raw corpora, verified against their publisher's checksums.

    bertpipe download wikipedia --date 20240601 --lang en     (-> <storage_root>/downloads/wikipedia/enwiki-20240601)
    bertpipe download wikipedia --date 20240601 --set storage_root=gs://bucket/bert
    bertpipe download wikipedia --date 20240601 --to /mnt/dumps/enwiki-20240601
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, RetriesOpt, SetOpt, StagingOpt, resolve


def download_wikipedia(
    date: Annotated[str, typer.Option(help="Dump date, YYYYMMDD (see dumps.wikimedia.org).")],
    to: Annotated[str | None, typer.Option(
        help="Destination folder or URI (default: <storage_root>/downloads/wikipedia/<lang>wiki-<date>, "
             "where the bert-base presets read).")] = None,
    lang: Annotated[str, typer.Option(help="Wiki language code.")] = "en",
    job: Annotated[str, typer.Option(help="The dump site's job: articlesdump (split files), articlesdumprecombine (one file), "
                                             "articlesmultistreamdump or articlesmultistreamdumprecombine.")] = "articlesdump",
    base_url: Annotated[
        str | None, typer.Option(help="Dump site or mirror (default $BERTPIPE_DUMPS_URL or Wikimedia).")
    ] = None,
    staging: StagingOpt = None,
    retries: RetriesOpt = 5,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Download the articles files of a Wikipedia dump, verified against the site's sha1 sums."""
    from bert_core.corpus.download import download_wikipedia as run
    from bert_core.corpus.download import dump_url, wikipedia_folder

    dump_url("", lang, date)  # a wrong --date or --lang is refused before the config is read
    if to is None:
        to = wikipedia_folder(resolve(preset, config, set_).storage_root, lang, date)
    manifest = run(lang, date, to, job=job, base=base_url, staging=staging, retries=retries,
                   log=lambda m: typer.echo(m, err=True))
    typer.echo(f"{manifest['counts']['files']} file(s), {manifest['counts']['bytes']} bytes -> {manifest['uri']}")
