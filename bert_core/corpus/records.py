"""Text records -> documents: JSON lines and Parquet files, one record = one document.

    from bert_core.corpus.records import plan_records, read_records
    for item in plan_records(["web.jsonl.zst", "news.parquet"], cfg):   # cfg: CorpusConfig
        for kind, record in read_records(item, cfg):   # ("doc", Document) or ("reject", Reject)
            ...

Inputs: ``.jsonl`` / ``.ndjson`` (plain, ``.gz`` or ``.zst``), streamed line by line, and
``.parquet``, read in row batches of the needed columns only.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bert_core import storage
from bert_core.config import ConfigError, CorpusConfig
from bert_core.corpus import documents as D
from bert_core.corpus.books import unwrap
from bert_core.corpus.sentences import split_paragraphs
from bert_core.failures import Refusal

# How records are read:
#
# Its text becomes paragraphs as a book's does (``bert_core.corpus.books.unwrap``: a blank line,
# an indented line or a short line ending a sentence closes a paragraph, hard-wrapped lines are
# joined), then sentences (``bert_core.corpus.sentences.split_paragraphs``).
#
# Ids are stable and source-prefixed: ``text:<id>`` with an id field, else
# ``text:<file stem>:<n>`` where ``n`` is the JSON line number or the Parquet row number (both
# count from 1, blank lines included); the stem gets its folder when two files share one.
#
# Every record read is one document or one reject naming the file and its line or row:
# ``bad_json``, ``missing_field``, ``not_a_string``, ``invalid_utf8`` (also a lone surrogate
# such as ``"\\ud800"`` in a JSON string), ``empty_text``, ``line_too_long``. A file that yields
# no record at all is one reject (``empty_file``, ``not_a_record_file``, ``unreadable_file``, or
# ``missing_field`` for a Parquet file without the column), and a file that breaks off after some
# records (a cut ``.gz``/``.zst``, a damaged Parquet page) adds one ``truncated_input`` /
# ``unreadable_file`` reject saying where: so per source ``kept + rejected = read`` holds with
# each such file counted as one record read.
#
# Work items (:func:`plan_records`): one per Parquet row group, so a big Parquet file is shared by
# all workers; one per JSON lines file (line numbers, and so doc_ids, need the lines before, and
# a compressed stream cannot be entered in the middle), so JSON lines spread over workers by file.
# Used by ``beam_jobs/clean_corpus.py`` (``bertpipe corpus --text GLOB``).

JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSIONS = ("", ".gz", ".zst", ".zstd")
PARQUET_SUFFIXES = (".parquet", ".pq")
CHUNK_BYTES = 1 << 18  # bytes read (or decompressed) at a time from a JSON lines file
ZSTD_INPUT_BYTES = 1 << 12  # zstd input fed at a time (its output comes back in one piece)
BATCH_ROWS = 1024  # Parquet rows decoded at a time


@dataclass(frozen=True)
class RecordItem:
    """One unit of work: a whole file (``row_group`` None) or one Parquet row group."""

    uri: str
    key: str  # the file's part of derived doc_ids ("web" -> "text:web:12")
    row_group: int | None = None
    first_row: int = 1  # row number of the row group's first row


class _RecordError(ValueError, Refusal):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def record_format(uri: str) -> str | None:
    """``"jsonl"``, ``"parquet"``, or None for any other file name."""
    name = uri.rsplit("/", 1)[-1].lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if any(name.endswith(s + c) for s in JSONL_SUFFIXES for c in COMPRESSIONS):
        return "jsonl"
    return None


def file_stem(uri: str) -> str:
    """``/x/web-00.jsonl.zst`` -> ``web-00``."""
    base = uri.rstrip("/").rsplit("/", 1)[-1]
    for suffix in COMPRESSIONS[1:] + JSONL_SUFFIXES + PARQUET_SUFFIXES + (".json",):
        base = base.removesuffix(suffix)
    return base


def file_keys(files: list[str]) -> dict[str, str]:
    """The doc_id part of each file: its stem; when stems collide, its file name; when names
    collide too, its folder and name; else its whole path. Every file has its own key."""
    def candidates(uri: str) -> list[str]:
        parts = uri.rstrip("/").rsplit("/", 2)
        return [file_stem(uri), parts[-1], "/".join(parts[-2:]), uri]

    options = {f: candidates(f) for f in files}
    keys = {}
    for f, mine in options.items():
        level = next(k for k in range(4) if k == 3 or sum(o[k] == mine[k] for o in options.values()) == 1)
        keys[f] = mine[level]
    return keys


def plan_records(files: list[str], cfg: CorpusConfig) -> list[RecordItem]:
    """Work items of the files: one per Parquet row group, one per other file. A Parquet file
    whose footer cannot be read or that lacks a needed column is one whole-file item, which
    :func:`read_records` turns into its one reject."""
    keys = file_keys(files)
    items: list[RecordItem] = []
    for uri in files:
        groups = _row_groups(uri, _fields(cfg)) if record_format(uri) == "parquet" else None
        if groups:
            items += [RecordItem(uri, keys[uri], g, first) for g, first in groups]
        else:
            items.append(RecordItem(uri, keys[uri]))
    return items


def read_records(item: RecordItem, cfg: CorpusConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """``("doc", Document)`` or ``("reject", Reject)`` per record read (see the module docstring).

    A blank JSON line is not a record.
    """
    kind = record_format(item.uri)
    if kind is None:
        yield "reject", D.make_reject(
            D.TEXT, f"text:{item.key}", D.NOT_A_RECORD_FILE,
            f"{item.uri} is not a text record file; give --text files named *.jsonl, *.jsonl.gz, "
            "*.jsonl.zst or *.parquet")
    elif kind == "parquet":
        yield from _read_parquet(item, cfg)
    else:
        yield from _read_jsonl(item, cfg)


# --------------------------------------------------------------------------- one record


def record_document(record: dict[str, Any], uri: str, key: str, where: str, number: int,
                    cfg: CorpusConfig) -> D.Document | D.Reject:
    """One record (a dict of field values) -> its document, or a reject naming ``uri`` + ``where``.

    A record's text is the field ``corpus.text_field``; ``corpus.id_field`` and
    ``corpus.title_field``, when set, name the fields holding its id (a string or an integer) and
    title (a string).
    """
    place = f"{uri} {where}"
    doc_id = f"text:{key}:{number}"  # the reject's id when the id field itself is bad
    try:
        if cfg.id_field is not None:
            value = record.get(cfg.id_field)
            if isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
            doc_id = f"text:{_field_text(value, cfg.id_field, place, cfg.id_field in record)}"
        title = f"{key} {where}"
        if cfg.title_field is not None:
            title = _field_text(record.get(cfg.title_field), cfg.title_field, place, cfg.title_field in record)
        if cfg.text_field not in record:
            raise _RecordError(D.MISSING_FIELD, f"{place}: field {cfg.text_field!r} is missing (its fields: "
                               f"{_names(record)}); set --text-field to the one that holds the text")
        text = _field_text(record.get(cfg.text_field), cfg.text_field, place, True, may_be_empty=True)
        text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
        if not text.strip():
            raise _RecordError(D.EMPTY_TEXT, f"{place}: field {cfg.text_field!r} is empty")
        for n, line in enumerate(text.split("\n"), 1):
            if len(line) > D.MAX_LINE_CHARS:
                raise _RecordError(D.LINE_TOO_LONG, f"{place}: line {n} of its text has {len(line):,} "
                                   f"characters (limit {D.MAX_LINE_CHARS:,}); it is not prose")
    except _RecordError as err:
        return D.make_reject(D.TEXT, doc_id, err.reason, err.detail)
    return D.make_document(doc_id, D.TEXT, title, split_paragraphs(unwrap(text)), place)


def _field_text(value: Any, field: str, place: str, present: bool, may_be_empty: bool = False) -> str:
    """A field's string value, or the reject saying what is wrong with it."""
    if isinstance(value, bytes | bytearray):  # a Parquet binary column
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise _RecordError(D.INVALID_UTF8, f"{place}: field {field!r} has invalid UTF-8 at byte "
                               f"{err.start}; re-encode the file as UTF-8") from None
    if value is None or (value == "" and not may_be_empty):
        what = "is empty" if value == "" else "is null" if present else "is missing"
        raise _RecordError(D.MISSING_FIELD, f"{place}: field {field!r} {what}; set the field's name "
                           "with --text-field / --id-field / --title-field")
    if not isinstance(value, str):
        kind = _TYPE_NAMES.get(type(value), type(value).__name__)
        raise _RecordError(D.NOT_A_STRING, f"{place}: field {field!r} is {kind}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate from a JSON "\ud800" escape
        raise _RecordError(D.INVALID_UTF8, f"{place}: field {field!r} has a lone surrogate "
                           f"{value[err.start]!r} at character {err.start}; it is not UTF-8 text") from None
    return value


def _names(record: dict[str, Any], most: int = 12) -> str:
    names = list(record)
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "") or "none"


_TYPE_NAMES = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}


def _fields(cfg: CorpusConfig) -> list[str]:
    return list(dict.fromkeys(f for f in (cfg.text_field, cfg.id_field, cfg.title_field) if f))


# --------------------------------------------------------------------------- before the job


class TextFieldError(ConfigError):
    """No record of a text file has the configured text field: the setting, not the data, is wrong."""


SNIFF_RECORDS = 100  # records read from the head of each JSON lines file by check_text_field


def check_text_field(files: list[str], cfg: CorpusConfig) -> None:
    """Refuse, before any work, text inputs none of which has ``corpus.text_field`` in its first
    records (a Parquet file: its columns), naming the fields they do have: that is a wrong
    ``--text-field``. A record, or a file, without the field beside others that have it is a
    reject of the job."""
    problems = []
    for uri in files:
        seen = _head_fields(uri)
        if seen is not None and cfg.text_field in seen:
            return
        if seen is not None:
            problems.append(f"{uri}: no record has the field {cfg.text_field!r} (they have: "
                            f"{_names(dict.fromkeys(seen))})")
    if problems:
        raise TextFieldError("; ".join(problems) + "; set --text-field (corpus.text_field) to the field "
                             "that holds the text")


def _head_fields(uri: str) -> list[str] | None:
    """Field names of a file's first records (a Parquet file's columns); None when it cannot tell
    (no records, not JSON): the job's rejects say why."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = record_format(uri)
    try:
        if kind == "parquet":
            with storage.open_file(uri, "rb") as f:
                return pq.ParquetFile(f).schema_arrow.names
        if kind != "jsonl":
            return None
        fields: dict[str, None] = {}
        records = 0
        for line in _lines(uri):
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(record, dict):
                fields.update(dict.fromkeys(record))
                records += 1
                if records >= SNIFF_RECORDS:
                    break
        return list(fields) if records else None
    except (OSError, EOFError, zlib.error, pa.ArrowException):
        return None


# --------------------------------------------------------------------------- JSON lines


def _read_jsonl(item: RecordItem, cfg: CorpusConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    uri, key = item.uri, item.key
    number = 0
    records = 0
    try:
        for number, line in enumerate(_lines(uri), 1):
            if not line.strip():
                continue
            records += 1
            yield _kind(_json_record(line, uri, key, number, cfg))
    except EOFError as err:  # a cut .gz / .zst: the records before the cut are kept
        records += 1
        yield "reject", D.make_reject(D.TEXT, f"text:{key}", D.TRUNCATED_INPUT,
                                      f"{uri} ends inside its compressed stream {_after(number)}: {err}")
    except (OSError, zlib.error) as err:  # not gzip / zstd data, unreadable storage
        records += 1
        yield "reject", D.make_reject(D.TEXT, f"text:{key}", D.UNREADABLE_FILE,
                                      f"{uri} {_after(number)}: {type(err).__name__}: {err}")
    if records == 0:
        yield "reject", D.make_reject(D.TEXT, f"text:{key}", D.EMPTY_FILE,
                                      f"{uri} has no records; remove it or add JSON lines")


def _after(line: int) -> str:
    return f"after line {line}" if line else "before its first line"


def _json_record(line: bytes, uri: str, key: str, number: int, cfg: CorpusConfig) -> D.Document | D.Reject:
    where = f"line {number}"
    try:
        text = line.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as err:
        return D.make_reject(D.TEXT, f"text:{key}:{number}", D.INVALID_UTF8,
                             f"{uri} {where}: invalid UTF-8 at byte {err.start} of the line; re-encode "
                             "the file as UTF-8")
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as err:
        msg = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
        return D.make_reject(D.TEXT, f"text:{key}:{number}", D.BAD_JSON,
                             f"{uri} {where}: not JSON ({msg}); each line must be one JSON object")
    if not isinstance(record, dict):
        return D.make_reject(D.TEXT, f"text:{key}:{number}", D.BAD_JSON,
                             f"{uri} {where}: a JSON {type(record).__name__}, not an object; each line "
                             "must be one JSON object")
    return record_document(record, uri, key, where, number, cfg)


def _lines(uri: str) -> Iterator[bytes]:
    """Lines (bytes) of a plain, gzip or zstd JSON lines file, streamed."""
    with storage.open_file(uri, "rb") as raw:
        name = uri.lower()
        if name.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=raw)
            # read1: at most one read of the file, so the lines before a cut are still returned
            chunks: Iterable[bytes] = iter(lambda: stream.read1(CHUNK_BYTES), b"")
        elif name.endswith((".zst", ".zstd")):
            chunks = _zstd_chunks(raw)
        else:
            chunks = iter(lambda: raw.read(CHUNK_BYTES), b"")
        pending = bytearray()
        for chunk in chunks:
            pending += chunk
            start = 0
            while (end := pending.find(b"\n", start)) >= 0:
                yield bytes(pending[start:end])
                start = end + 1
            del pending[:start]
        if pending:
            yield bytes(pending)


def _zstd_chunks(raw) -> Iterator[bytes]:
    """Decompressed chunks of a zstd stream (several frames allowed); EOFError if it is cut.
    (zstandard's stream reader would bound the output too, but it ends a cut stream silently.)"""
    import zstandard  # a dependency of apache-beam

    dctx = zstandard.ZstdDecompressor()
    frame, fed = dctx.decompressobj(), False
    while chunk := raw.read(ZSTD_INPUT_BYTES):
        while chunk:
            try:
                yield frame.decompress(chunk)
            except zstandard.ZstdError as err:
                raise OSError(f"not zstd data: {err}") from None
            fed = True
            if not frame.eof:
                break
            chunk = frame.unused_data  # the next frame starts here
            frame, fed = dctx.decompressobj(), False
    if fed:
        raise EOFError("the zstd stream ends inside a frame")


# --------------------------------------------------------------------------- Parquet


def _row_groups(uri: str, fields: list[str]) -> list[tuple[int, int]] | None:
    """(row group, its first row number) of a readable Parquet file with every field, else None."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with storage.open_file(uri, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            if set(fields) - set(meta.schema.to_arrow_schema().names) or meta.num_rows == 0:
                return None
            groups, first = [], 1
            for g in range(meta.num_row_groups):
                groups.append((g, first))
                first += meta.row_group(g).num_rows
            return groups
    except (OSError, pa.ArrowException):
        return None


def _read_parquet(item: RecordItem, cfg: CorpusConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    uri, key = item.uri, item.key
    fields = _fields(cfg)
    number = item.first_row - 1
    try:
        with storage.open_file(uri, "rb") as f:
            parquet = pq.ParquetFile(f)
            missing = [name for name in fields if name not in parquet.schema_arrow.names]
            if missing:
                yield "reject", D.make_reject(
                    D.TEXT, f"text:{key}", D.MISSING_FIELD,
                    f"{uri} has no column(s) {missing}; its columns are {parquet.schema_arrow.names}: "
                    "set --text-field / --id-field / --title-field")
                return
            if parquet.metadata.num_rows == 0:
                yield "reject", D.make_reject(D.TEXT, f"text:{key}", D.EMPTY_FILE, f"{uri} has no rows")
                return
            groups = [item.row_group] if item.row_group is not None else None
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=groups, columns=fields):
                # strings as bytes: one bad value is one reject, not a failed batch
                columns = [_as_bytes(batch.column(name)).to_pylist() for name in fields]
                for values in zip(*columns, strict=True):
                    number += 1
                    record = dict(zip(fields, values, strict=True))
                    yield _kind(record_document(record, uri, key, f"row {number}", number, cfg))
    except (OSError, pa.ArrowException) as err:
        yield "reject", D.make_reject(D.TEXT, f"text:{key}", D.UNREADABLE_FILE,
                                      f"{uri} after row {number}: {type(err).__name__}: {err}")


def _as_bytes(column):
    import pyarrow as pa

    if pa.types.is_string(column.type):
        return column.cast(pa.binary())
    if pa.types.is_large_string(column.type):
        return column.cast(pa.large_binary())
    return column


def _kind(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("reject" if D.is_reject(result) else "doc"), result
