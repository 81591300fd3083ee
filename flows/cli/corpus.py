"""CLI of the corpus stage.

    bertpipe corpus --wikipedia 'samples/wikipedia/*.xml.bz2' --books 'samples/books/*.txt' \
        --output ./bertpipe-data/corpus --workers 2 [-- beam args]
    bertpipe corpus --text 'data/*.jsonl.zst' --text-field text [--id-field id --title-field title] \
        --output ./bertpipe-data/corpus                             (JSON lines / Parquet records)
    bertpipe corpus --preset demo --output ./bertpipe-data/corpus     (globs from corpus.*)

Runs the Beam job directly (no Prefect), with progress while it runs (bytes of input read of
their total, records, rate, ETA: ``flows/cli/progress.py``) and a table of counts (read / kept /
rejected by reason) at the end.
"""

from __future__ import annotations

from typing import Annotated

import typer

from bert_core.config import validate
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
    bytes_per_worker: Annotated[
        int | None, typer.Option("--bytes-per-worker", help="Local runner: one worker process per this many "
                                 "bytes of input, up to --workers (0: start them all).")
    ] = None,
) -> None:
    """Clean Wikipedia dumps, books and text records into document-level sentences (Beam). Arguments
    after `--` go to Beam."""
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
    corpus_cfg = validate({**corpus_cfg.model_dump(), **updates}, "corpus options", type(corpus_cfg))

    from beam_jobs import clean_corpus
    from beam_jobs.clean_corpus import LOCAL_BYTES_PER_WORKER
    from flows.cli.progress import progress_bars

    per_worker = LOCAL_BYTES_PER_WORKER if bytes_per_worker is None else bytes_per_worker
    with progress_bars() as on_progress:
        manifest = clean_corpus.run(corpus_cfg, output, bytes_per_worker=per_worker, on_progress=on_progress,
                                    **opt.beam_run(cfg, ctx, workers, runner))
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
