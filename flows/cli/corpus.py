"""CLI of the corpus stage.

    bertpipe corpus --wikipedia 'samples/wikipedia/*.xml.bz2' --books 'samples/books/*.txt' \
        --output ./bertpipe-data/corpus --workers 2 [-- beam args]
    bertpipe corpus --text 'data/*.jsonl.zst' --text-field text [--id-field id --title-field title] \
        --output ./bertpipe-data/corpus                             (JSON lines / Parquet records)
    bertpipe corpus --preset demo --output ./bertpipe-data/corpus     (globs from corpus.*)

Runs the Beam job directly (no Prefect), with a progress display while it runs and a table of
counts (read / kept / rejected by reason) at the end.
"""

from __future__ import annotations

from typing import Annotated

import typer

from bert_core.config import ConfigError, validate
from flows.cli import options as opt


def corpus(
    ctx: typer.Context,
    output: Annotated[str, typer.Option(help="Output folder or URI (gs://...) for the documents.")],
    preset: opt.PresetOpt = "demo",
    config: opt.ConfigOpt = None,
    set_: opt.SetOpt = None,
    wikipedia: Annotated[
        list[str] | None, typer.Option(help="Dump glob (.xml, .xml.bz2); repeatable. Default: corpus.wikipedia.")
    ] = None,
    books: Annotated[
        list[str] | None, typer.Option(help="Book glob (.txt, .txt.gz, .md); repeatable. Default: corpus.books.")
    ] = None,
    text: Annotated[
        list[str] | None, typer.Option(help="Text record glob (.jsonl, .jsonl.gz, .jsonl.zst, .parquet), one "
                                            "record = one document; repeatable. Default: corpus.text.")
    ] = None,
    text_field: Annotated[
        str | None, typer.Option("--text-field", help="Field holding a record's text (default: corpus.text_field).")
    ] = None,
    id_field: Annotated[
        str | None, typer.Option("--id-field", help="Field holding a record's id (default: file stem + line/row).")
    ] = None,
    title_field: Annotated[
        str | None, typer.Option("--title-field", help="Field holding a record's title (default: from the file).")
    ] = None,
    text_format: Annotated[
        str | None, typer.Option("--text-format", help="'google': also one sentence per line files.")
    ] = None,
    workers: opt.WorkersOpt = None,
    runner: opt.RunnerOpt = None,
) -> None:
    """Clean Wikipedia dumps, books and text records into document-level sentences (Beam). Extra
    arguments after the options are passed to Beam."""
    from rich.console import Console

    cfg = opt.resolve(preset, config, set_)
    corpus_cfg = cfg.corpus
    updates = {}
    if wikipedia or books or text:  # explicit inputs replace the preset's globs
        updates = {"wikipedia": wikipedia or [], "books": books or [], "text": text or []}
    for name, value in (("text_field", text_field), ("id_field", id_field), ("title_field", title_field)):
        if value:
            updates[name] = value
    if text_format:
        updates["text_format"] = text_format
    with opt.user_errors(ConfigError, code=2):
        corpus_cfg = validate({**corpus_cfg.model_dump(), **updates}, "corpus options", type(corpus_cfg))

    from beam_jobs.clean_corpus import clean as run_job
    from beam_jobs.job import EmptyResultError
    from bert_core import storage
    from bert_core.corpus.inputs import InputError

    console = Console(stderr=True)
    with opt.user_errors(InputError, code=2), opt.user_errors(storage.OutputError, EmptyResultError):
        with console.status(f"cleaning {len(corpus_cfg.wikipedia)} dump glob(s), {len(corpus_cfg.books)} "
                            f"book glob(s) and {len(corpus_cfg.text)} text glob(s) with "
                            f"up to {workers or cfg.workers} worker(s) ..."):
            manifest = run_job(corpus_cfg, output, **opt.beam_run(cfg, ctx, workers, runner))
    typer.echo(format_counts(manifest))


def format_counts(manifest: dict) -> str:
    lines = [f"corpus at {manifest['uri']}"]
    for source, c in manifest["counts"].items():
        if isinstance(c, dict):
            lines.append(f"  {source}: read {c['read']}, kept {c['kept']}, rejected {c['rejected']}")
            lines += [f"    {reason}: {n}" for reason, n in c["rejected_by_reason"].items()]
    c = manifest["counts"]
    lines.append(f"  documents {c['documents']}, sentences {c['sentences']}, chars {c['chars']}")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    extra = {"allow_extra_args": True}  # Beam options go after `--`; unknown ones are refused
    app.command("corpus", context_settings=extra)(corpus)
