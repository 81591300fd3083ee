"""The documents contract: records, filters, rejects, Parquet/JSONL shards, length histograms.
Produced by ``bertpipe corpus`` (beam_jobs/clean_corpus.py).

    docs-SSSSS-of-NNNNN.parquet   doc_id: string (stable, source-prefixed: "wiki:12", "book:botchan",
                                  "text:web:3"), source: string ("wikipedia" | "books" | "text"),
                                  title: string, sentences: list<string> (document order)
    rejects-SSSSS-of-NNNNN.jsonl  {"source", "id", "reason", "detail"[, "duplicate_of"]}
    _MANIFEST.json                written last (bert_core.storage.write_manifest, stage="corpus")

The attempt that holds the folder's lease (``bert_core.lease``) first clears what an earlier
attempt left (:func:`clear_output`), so the manifest it writes names only its own shards.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.failures import Refusal
from bert_core.histogram import Histogram

WIKIPEDIA = "wikipedia"
BOOKS = "books"
TEXT = "text"  # JSON lines / Parquet records, one record = one document (bert_core/corpus/records.py)

# Reject reasons (each also a Beam counter "rejected_<reason>").
REDIRECT = "redirect"
NOT_ARTICLE = "not_article"
NO_TEXT = "no_text"  # nothing left after removing templates, tables, lists, headings
TOO_FEW_SENTENCES = "too_few_sentences"
TOO_SHORT = "too_short"
DUPLICATE = "duplicate"
NEAR_DUPLICATE = "near_duplicate"
DUPLICATE_DOC_ID = "duplicate_doc_id"
MALFORMED_XML = "malformed_xml"
INVALID_UTF8 = "invalid_utf8"
TRUNCATED_INPUT = "truncated_input"
NOT_A_DUMP = "not_a_dump"
EMPTY_FILE = "empty_file"
UNREADABLE_FILE = "unreadable_file"
UNPARSEABLE_PAGE = "unparseable_page"  # the wikitext cleaner raised (a bug to report, not data loss)
LINE_TOO_LONG = "line_too_long"  # a paragraph longer than MAX_LINE_CHARS is not prose
BAD_JSON = "bad_json"  # a JSON line that is not one JSON object
MISSING_FIELD = "missing_field"  # a record (or a Parquet file) without the text/id/title field
NOT_A_STRING = "not_a_string"  # the field holds a number, a list, ... instead of text
EMPTY_TEXT = "empty_text"  # the text field is empty or only whitespace
NOT_A_RECORD_FILE = "not_a_record_file"  # a text input that is neither JSON lines nor Parquet

MAX_LINE_CHARS = 100_000  # longest paragraph (one line of a book) a document may have

Document = dict[str, Any]  # doc_id, source, title, sentences, origin (file@offset, not written)
Reject = dict[str, Any]


def make_document(doc_id: str, source: str, title: str, sentences: list[str], origin: str) -> Document:
    return {"doc_id": doc_id, "source": source, "title": title, "sentences": sentences, "origin": origin}


def make_reject(source: str, record_id: str, reason: str, detail: str, duplicate_of: str | None = None) -> Reject:
    reject = {"source": source, "id": record_id, "reason": reason, "detail": detail}
    if duplicate_of is not None:
        reject["duplicate_of"] = duplicate_of
    return reject


def apply_filters(doc: Document, cfg: CorpusConfig) -> Document | Reject:
    """The document with too-short sentences removed, or a reject naming the filter."""
    shortest = cfg.min_chars_per_sentence
    sentences = [s for s in doc["sentences"] if len(s) >= shortest]
    chars = sum(map(len, sentences))
    if not sentences:
        return make_reject(doc["source"], doc["doc_id"], NO_TEXT,
                           f"{doc['title']!r}: no text left after removing markup, lists and tables")
    if len(sentences) < cfg.min_sentences_per_doc:
        return make_reject(doc["source"], doc["doc_id"], TOO_FEW_SENTENCES,
                           f"{doc['title']!r}: {len(sentences)} sentences < min_sentences_per_doc="
                           f"{cfg.min_sentences_per_doc}")
    if chars < cfg.min_chars_per_doc:
        return make_reject(doc["source"], doc["doc_id"], TOO_SHORT,
                           f"{doc['title']!r}: {chars} chars < min_chars_per_doc={cfg.min_chars_per_doc}")
    return {**doc, "sentences": sentences}


def is_reject(record: dict[str, Any]) -> bool:
    return "reason" in record


def stable_shard(key: str, num_shards: int) -> int:
    """Shard of a record: CRC-32 of its id (stable across processes, unlike ``hash``).

    A document's shard is this of its ``doc_id`` and the rows of a shard are sorted by ``doc_id``,
    so the bytes depend only on the input, never on the number of workers or the order they finish.
    """
    return zlib.crc32(key.encode("utf-8")) % num_shards


def auto_num_shards(total_chars: int, target_chars: int = 128 << 20) -> int:
    """About 128 M characters (a few hundred MB of Parquet) per shard; at least one."""
    return max(1, -(-total_chars // target_chars))


def arrow_schema():
    import pyarrow as pa

    return pa.schema([
        ("doc_id", pa.string()), ("source", pa.string()), ("title", pa.string()),
        ("sentences", pa.list_(pa.string())),
    ])


class DocumentShardWriter:
    """One documents shard written as its documents stream in (in doc_id order): Parquet rows a
    row group of about ``row_group_chars`` characters at a time, so memory is one row group,
    never the shard; and, with ``text_uri``, google-research/bert's text beside it."""

    def __init__(self, uri: str, text_uri: str | None = None, row_group_chars: int = 8 << 20):
        import pyarrow.parquet as pq

        self.file = storage.open_file(uri, "wb")
        self.parquet = pq.ParquetWriter(self.file, arrow_schema(), compression="zstd")
        self.text = storage.open_file(text_uri, "wb") if text_uri else None
        self.row_group_chars = row_group_chars
        self.rows: list[Document] = []
        self.chars = 0
        self.empty = True

    def add(self, doc: Document) -> None:
        if self.text is not None:  # one sentence per line, a blank line between documents
            lines = "".join(s.replace("\n", " ") + "\n" for s in doc["sentences"])
            self.text.write((lines if self.empty else "\n" + lines).encode("utf-8"))
        self.empty = False
        self.rows.append(doc)
        self.chars += sum(map(len, doc["sentences"]))
        if self.chars >= self.row_group_chars:
            self._write_row_group()

    def _write_row_group(self) -> None:
        import pyarrow as pa

        columns = {name: [d[name] for d in self.rows] for name in ("doc_id", "source", "title", "sentences")}
        self.parquet.write_table(pa.Table.from_pydict(columns, schema=arrow_schema()))
        self.rows, self.chars = [], 0

    def close(self) -> None:
        if self.rows or self.empty:  # an empty shard still has its (empty) row group
            self._write_row_group()
        self.parquet.close()
        self.file.close()
        if self.text is not None:
            self.text.close()


def read_documents(uri: str) -> list[Document]:
    """Rows of one documents shard as dicts (tests and small tools)."""
    import pyarrow.parquet as pq

    with storage.open_file(uri, "rb") as f:
        return pq.read_table(f).to_pylist()


def reject_sort_key(r: Reject) -> tuple[str, ...]:
    return (r["source"], r["id"], r["reason"], r["detail"])


# Length histogram edges (bert_core.histogram): log-ish so both a stub article and a novel fit;
# the last bin is open. A kept document has at least one sentence.
LENGTH_EDGES = {
    "sentences": (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, None),
    "chars": (0, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000, None),
}


def length_stats(doc: Document) -> dict[str, int]:
    return {"sentences": len(doc["sentences"]), "chars": sum(map(len, doc["sentences"]))}


OWN_FILES = ("docs-*-of-*.parquet", "rejects-*-of-*.jsonl", "text-*-of-*.txt")


def clear_output(output: str, attempt: str | None = None) -> None:
    """Remove an earlier attempt's manifest, temporary files and shards (of any count) from a
    corpus folder; other files are left alone. Called by the attempt that holds the lease
    (``attempt``): each removal is fenced by it (``lease.remove_held``)."""
    from bert_core import lease
    from bert_core.sorted_runs import SPILL_DIR

    lease.remove_held(output, attempt, storage.join(output, storage.MANIFEST))  # an old manifest must not bless new shards
    lease.remove_held(output, attempt, storage.join(output, SPILL_DIR))
    for pattern in OWN_FILES:
        for uri in storage.glob(storage.join(output, pattern)):
            lease.remove_held(output, attempt, uri)


def write_corpus_manifest(output: str, cfg: CorpusConfig, inputs: dict[str, list[str]],
                          num_shards: int, summary: dict[str, Any], fence: Any = None) -> dict[str, Any]:
    """``_MANIFEST.json`` of a corpus folder (call it last): counts per source and reason
    (kept + rejected = read is checked), shard lists with sha256, length histograms; ``fence``
    as for ``storage.write_manifest``.
    ``summary`` holds "read"/"kept" per source, "rejected" per "source/reason", and the
    "sentences"/"chars" counts by bin of :data:`LENGTH_EDGES` and "totals" of kept documents.

    Every record read is either a kept document or exactly one reject, so per source
    ``kept + rejected = read``.
    """
    counts: dict[str, Any] = {}
    for source in sorted(set(summary["read"]) | set(summary["kept"])):
        rejected = {k.split("/", 1)[1]: v for k, v in sorted(summary["rejected"].items())
                    if k.startswith(source + "/")}
        counts[source] = {"read": summary["read"].get(source, 0), "kept": summary["kept"].get(source, 0),
                          "rejected": sum(rejected.values()), "rejected_by_reason": rejected}
        if counts[source]["kept"] + counts[source]["rejected"] != counts[source]["read"]:
            raise RuntimeError(f"bug: {source} kept + rejected != read: {counts[source]}")
    counts["documents"] = sum(summary["kept"].values())
    counts["rejects"] = sum(summary["rejected"].values())
    counts["sentences"] = summary["totals"].get("sentences", 0)
    counts["chars"] = summary["totals"].get("chars", 0)
    docs = [storage.shard_name("docs", i, num_shards, "parquet") for i in range(num_shards)]
    rejects = [storage.shard_name("rejects", i, num_shards, "jsonl") for i in range(num_shards)]
    shards = [storage.shard_entry(storage.join(output, name)) for name in docs]
    extra: dict[str, Any] = {
        "rejects": [storage.shard_entry(storage.join(output, name)) for name in rejects],
    }
    if cfg.text_format == "google":
        extra["text_shards"] = [storage.shard_entry(storage.join(output, storage.shard_name("text", i, num_shards, "txt")))
                                for i in range(num_shards)]
    stats = {f"{name}_per_doc": Histogram.from_bins(edges, summary[name]).to_json()
             for name, edges in LENGTH_EDGES.items()}
    return storage.write_manifest(
        output, stage="corpus", config=cfg, inputs=(), shards=shards, counts=counts, stats=stats,
        input_files=inputs, fence=fence, **extra)


# --------------------------------------------------------------------------- cut inputs
#
# A file that breaks off (a cut .bz2, .gz or .zst, XML without its end) has lost an unknown
# share of its records, so the corpus is not finished: its records read and its one
# ``truncated_input`` reject are written as usual (kept + rejected = read still holds), but no
# manifest, and the job ends naming the file. ``corpus.allow_truncated`` keeps what was read and
# says so.


class TruncatedInputError(Refusal):
    """An input file breaks off: the corpus is not finished (no manifest)."""


def truncated_inputs(summary: dict[str, Any]) -> int:
    """``truncated_input`` rejects in a job's summary (see :func:`write_corpus_manifest`)."""
    return sum(n for key, n in summary["rejected"].items() if key.endswith("/" + TRUNCATED_INPUT))


def read_rejects(output: str, num_shards: int, reason: str) -> list[Reject]:
    """The rejects of one reason in the rejects shards of ``output``, in shard order."""
    marker = json.dumps({"reason": reason})[1:-1].encode("utf-8")  # as the writer spells it
    found = []
    for i in range(num_shards):
        uri = storage.join(output, storage.shard_name("rejects", i, num_shards, "jsonl"))
        if not storage.exists(uri):
            continue
        with storage.open_file(uri, "rb") as f:
            found += [r for line in f if marker in line and (r := json.loads(line))["reason"] == reason]
    return found


def truncation_message(output: str, cuts: list[Reject], allowed: bool) -> str:
    """One line for the cut input files ``cuts`` (their ``truncated_input`` rejects): the first
    one's file and how far it was read, and what to do."""
    more = f" ({len(cuts) - 1} more cut file(s) in {output}/rejects-*.jsonl)" if len(cuts) > 1 else ""
    if allowed:
        return (f"{cuts[0]['detail']}{more}; the corpus keeps only what was read "
                "(corpus.allow_truncated=true)")
    return (f"{cuts[0]['detail']}{more}; the corpus is not finished (no {storage.MANIFEST} in {output}): "
            "download the file again or drop it from the inputs (corpus.allow_truncated=true keeps "
            "what was read)")


# --------------------------------------------------------------------------- reading shards


DOCUMENT_COLUMNS = ["doc_id", "sentences"]


def read_sentences(uri: str, batch_rows: int = 256, part: int = 0,
                   parts: int = 1) -> Iterator[tuple[str, list[str] | None]]:
    """``(doc_id, sentences)`` of one documents shard, streamed a row group at a time, in row
    batches (never the whole file). With ``parts`` > 1, only this reader's share of a shard that
    ``parts`` readers share: row groups ``part``, ``part + parts``, ... when the shard has enough
    of them, else row batches ``part``, ``part + parts``, ...

    Row groups are read one by one rather than through one batch reader over the file, which
    reads ahead and holds more of a big shard."""
    import pyarrow.parquet as pq

    with storage.open_file(uri, "rb") as f:
        shard = pq.ParquetFile(f)
        missing = set(DOCUMENT_COLUMNS) - set(shard.schema_arrow.names)
        if missing:
            raise storage.ManifestError(f"documents shard {uri} has no column(s) {sorted(missing)}; it is not "
                             "a corpus stage output: re-run `bertpipe corpus` or fix --corpus")
        by_group = shard.num_row_groups >= parts
        batch_index = 0
        for group in range(shard.num_row_groups):
            if by_group and group % parts != part:
                continue
            table = shard.read_row_group(group, columns=DOCUMENT_COLUMNS, use_threads=False)
            for batch in table.to_batches(batch_rows):
                mine = by_group or batch_index % parts == part
                batch_index += 1
                if mine:
                    yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)
            del table


def count_documents(shards: Iterable[str]) -> int:
    """Rows of the documents shards, from their Parquet footers (no data read)."""
    import pyarrow.parquet as pq

    total = 0
    for uri in shards:
        with storage.open_file(uri, "rb") as f:
            total += pq.ParquetFile(f).metadata.num_rows
    return total
