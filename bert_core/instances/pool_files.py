"""The instances job's files of each random-next pool (its tokenized documents, its instances),
its rejects, and the Parquet shard writer (:class:`InstanceShardWriter`). The folder and the
bounded merge are :mod:`bert_core.sorted_runs`'s.

    (beam_jobs/create_instances.py writes and reads them; all under OUT/_spill/, removed at the end)

    OUT/_spill/documents/<split>-<pool>-<uuid>.arrow     tokenized documents of one random-next pool
    OUT/_spill/instances/seq<L>-<split>-<pool>.arrow     a pool's instances of one length
    OUT/_spill/rejects/<uuid>.jsonl                      rejected documents, sorted by id
"""

from __future__ import annotations

import heapq
import json
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bert_core import storage
from bert_core.instances.batch import InstanceBatch, assemble, instance_spans, mask_batch, schema
from bert_core.instances.masking import MaskingSpec
from bert_core.instances.pairs import DocumentPool, VocabIds
from bert_core.instances.sharding import piece_bounds
from bert_core.instances.stats import InstanceStats
from bert_core.sorted_runs import MERGE_FAN_IN, check_fan_in, fewer_runs

# Why files: a local runner keeps what crosses a shuffle in its own process, and Beam elements
# are charged by the element; a file per few megabytes costs neither. They are Arrow IPC files, uncompressed: each is
# written once and read once, and Arrow's own layout costs a copy each way, where Parquet's
# encoding and compression cost more CPU than the rest of the job's steps around them.
#
# Memory: building a pool (:func:`read_pool`) holds its tokens (uint16 when the vocab fits) and
# sentence offsets plus one spill file; writing a pool's instances (:func:`write_pool_instances`)
# holds the pairs as integers (a few dozen bytes per instance) and one window of assembled rows;
# a shard is written a row group at a time (:class:`InstanceShardWriter`).

if TYPE_CHECKING:
    import pyarrow as pa

END_MARK = -1  # after each sentence's ids in a tokenized document
WINDOW_TOKENS = 1 << 20  # rows assembled and masked at once: ~4 MB of int32 ids
ROW_GROUP_TOKENS = 1 << 20  # a shard's row groups: a fixed number of rows per length


def rows_per_window(max_seq_length: int, tokens: int = WINDOW_TOKENS) -> int:
    return max(1, tokens // max_seq_length)


# --------------------------------------------------------------------------- documents


def marked_counts(docs: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Per tokenized document: ids that are not end marks, and sentences with at least one of
    them (all documents decoded at once)."""
    ids = np.frombuffer(b"".join(docs), dtype=np.intc)
    doc_ends = np.cumsum([len(m) // ids.itemsize for m in docs], dtype=np.int64)
    ends = np.flatnonzero(ids == END_MARK)
    kept = (np.diff(ends, prepend=-1) > 1).astype(np.int64)  # a sentence with a token
    marks_before = np.searchsorted(ends, doc_ends)  # marks (= sentences) up to each document's end
    n_marks = np.diff(marks_before, prepend=0)
    tokens = np.diff(doc_ends, prepend=0) - n_marks
    kept_before = np.concatenate([[0], np.cumsum(kept)])[marks_before]
    return tokens, np.diff(kept_before, prepend=0)


def spill_tokenized_documents(uri: str, docs: Sequence[tuple[str, bytes]]) -> int:
    """Tokenized documents ``(doc_id, marked ids)`` -> one spill file; returns its bytes.

    Columns: ``doc_id``, ``ids`` (the bytes of a C int array, each sentence's ids followed by an
    end mark: ``Tokenizer.encode_document_bytes``), ``tokens`` and ``sentences`` (counts, marks and
    empty sentences left out).
    """
    import pyarrow as pa

    marked = [m for _, m in docs]
    tokens, sentences = marked_counts(marked)
    table = pa.table({
        "doc_id": pa.array([d for d, _ in docs], pa.string()),
        "ids": pa.array(marked, pa.large_binary()),
        "tokens": pa.array(tokens, pa.int64()),
        "sentences": pa.array(sentences, pa.int64()),
    })
    _write_ipc(uri, table)
    return int(sum(map(len, marked)))


def _write_ipc(uri: str, table: pa.Table) -> None:
    import pyarrow as pa

    with storage.open_file(uri, "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table)


def _open_spill(uri: str) -> Any:
    """A spill file to read: memory-mapped when local (its record batches are then read in
    place, not copied), else through fsspec."""
    import pyarrow as pa

    if storage.is_local(uri):
        return pa.memory_map(storage.split_protocol(uri)[1], "r")
    return storage.open_file(uri, "rb")


def _read_columns(uri: str, columns: list[str]) -> pa.Table:
    import pyarrow as pa

    with _open_spill(uri) as f:
        return pa.ipc.open_file(f).read_all().select(columns)


def read_pool(uris: Iterable[str], vocab_size: int) -> tuple[DocumentPool, list[str]]:
    """A random-next pool from its spill files: documents sorted by ``doc_id`` (the pool never
    depends on how its documents were gathered), sentences without tokens dropped (as
    ``DocumentPool.from_marked``). Holds the pool and one file at a time, never two copies; a
    file's documents are decoded and placed at once (no Python step per document)."""
    from bert_core.instances.batch import _ranges

    uris = list(uris)
    doc_ids: list[str] = []
    n_tokens, n_sentences = [], []
    for uri in uris:
        table = _read_columns(uri, ["doc_id", "tokens", "sentences"])
        doc_ids += table.column(0).to_pylist()
        n_tokens.append(table.column(1).to_numpy())
        n_sentences.append(table.column(2).to_numpy())
    order = sorted(range(len(doc_ids)), key=doc_ids.__getitem__)
    rank = np.empty(len(order), dtype=np.int64)  # row (all files end to end) -> place in the pool
    rank[order] = np.arange(len(order))
    tokens_of = np.concatenate([np.zeros(0, np.int64), *n_tokens]).astype(np.int64)
    sentences_of = np.concatenate([np.zeros(0, np.int64), *n_sentences]).astype(np.int64)
    token_start = np.concatenate([[0], np.cumsum(tokens_of[order])]).astype(np.int64)
    sentence_start = np.concatenate([[0], np.cumsum(sentences_of[order])]).astype(np.int64)
    tokens = np.empty(int(token_start[-1]), dtype=np.uint16 if vocab_size <= 1 << 16 else np.int32)
    lengths = np.empty(int(sentence_start[-1]), dtype=np.int64)
    row = 0
    for uri in uris:
        for chunk in _read_columns(uri, ["ids"]).column(0).chunks:
            # the column's own buffers, the whole chunk at once: no Python bytes per document
            ends = np.frombuffer(chunk.buffers()[1], dtype=np.int64)[chunk.offset:chunk.offset + len(chunk) + 1]
            data = np.frombuffer(chunk.buffers()[2], dtype=np.uint8)[ends[0]:ends[-1]]
            ids = data.view(np.intc)
            is_mark = ids == END_MARK
            sentence_lengths = np.diff(np.flatnonzero(is_mark), prepend=-1) - 1
            rows = slice(row, row + len(chunk))
            row += len(chunk)
            tokens[_ranges(token_start[rank[rows]], tokens_of[rows])] = ids[~is_mark]
            lengths[_ranges(sentence_start[rank[rows]], sentences_of[rows])] = sentence_lengths[sentence_lengths > 0]
    # array('q'): 8 bytes a sentence instead of a list's ~36, and bisect still works on it
    offsets = array("q", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tobytes())
    pool = DocumentPool(tokens, offsets, sentence_start.tolist())
    return pool, [doc_ids[i] for i in order]


# --------------------------------------------------------------------------- instances


@dataclass(frozen=True)
class RowRange:
    """Rows ``start:stop`` of an instances spill file: a piece as a shuffle carries it
    (``bert_core.instances.sharding.assign_shards`` cuts it like a batch)."""

    uri: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def slice(self, start: int, stop: int) -> RowRange:
        return RowRange(self.uri, self.start + start, self.start + stop)

    def batches(self) -> Iterator[InstanceBatch]:
        return read_rows(self.uri, self.start, self.stop)


def write_pool_instances(uri: str, pool: DocumentPool, doc_ids: Sequence[str], groups: int, *,
                         seed: int, dupe_factor: int, max_seq_length: int, max_predictions_per_seq: int,
                         masked_lm_prob: float, short_seq_prob: float, vocab: VocabIds,
                         next_sentence_prediction: bool = True, whole_word_mask: bool = False,
                         mask: bool = True, window: int = 0) -> list[tuple[int, int, int]]:
    """Every instance of the pool for one length (``create_instance_batch``'s, the same rows)
    -> one spill file, ordered by piece ``key % groups`` then key
    (``bert_core.instances.sharding.pieces_by_group``'s order); returns ``(g, first row, end
    row)`` of every non-empty piece. Pairs are decided first as integers, then assembled and
    masked ``window`` rows at a time (0: WINDOW_TOKENS worth), a record batch each.

    The file holds the instances contract's columns in record batches of a fixed number of rows
    (``rows_per_batch`` in the schema's metadata).
    """
    import pyarrow as pa

    spans, keys = instance_spans(pool, doc_ids, seed=seed, dupe_factor=dupe_factor,
                                 max_seq_length=max_seq_length, short_seq_prob=short_seq_prob,
                                 next_sentence_prediction=next_sentence_prediction)
    order, bounds = piece_bounds(keys, groups)
    spec = MaskingSpec(masked_lm_prob, max_predictions_per_seq, vocab, whole_word_mask)
    window = window or rows_per_window(max_seq_length)
    spill_schema = schema().with_metadata({"rows_per_batch": str(window)})
    with storage.open_file(uri, "wb") as f, pa.ipc.new_file(f, spill_schema) as writer:
        for start in range(0, len(order), window):
            rows = order[start:start + window]
            batch = assemble(pool, spans[rows], keys[rows], vocab)
            if mask:
                batch = mask_batch(batch, spec)
            writer.write_table(batch.to_table())
    return [(g, int(bounds[g]), int(bounds[g + 1])) for g in range(groups) if bounds[g + 1] > bounds[g]]


def read_rows(uri: str, start: int, stop: int) -> Iterator[InstanceBatch]:
    """Rows ``start:stop`` of an instances spill file, a record batch at a time (only the
    batches that hold them are read)."""
    import pyarrow as pa

    with _open_spill(uri) as f:
        spill = pa.ipc.open_file(f)
        per_batch = int(spill.schema.metadata[b"rows_per_batch"])
        for i in range(start // per_batch, min(spill.num_record_batches, -(-stop // per_batch))):
            first = i * per_batch
            batch = spill.get_batch(i)
            lo, hi = max(start, first), min(stop, first + batch.num_rows)
            if lo < hi:
                yield InstanceBatch.from_table(pa.Table.from_batches([batch.slice(lo - first, hi - lo)]))


class InstanceShardWriter:
    """Rows, in any number of pieces -> one Parquet shard of the instances contract, in row
    groups of a fixed number of rows (so the same rows make the same bytes however they
    arrive), and the stats of what it wrote."""

    def __init__(self, uri: str, max_seq_length: int, mask_id: int, rows_per_group: int = 0) -> None:
        import pyarrow.parquet as pq

        self.uri, self.mask_id = uri, mask_id
        self.rows_per_group = rows_per_group or rows_per_window(max_seq_length, ROW_GROUP_TOKENS)
        self.stats = InstanceStats(max_seq_length=max_seq_length)
        self.count = 0
        self.pending: list[InstanceBatch] = []
        self.file = storage.open_file(uri, "wb")
        self.writer = pq.ParquetWriter(self.file, schema(), compression="zstd")

    def write(self, batch: InstanceBatch) -> None:
        self.pending.append(batch)
        if sum(len(b) for b in self.pending) >= self.rows_per_group:
            rows = InstanceBatch.concat(self.pending)
            full = len(rows) // self.rows_per_group * self.rows_per_group
            self._flush(rows.slice(0, full))
            self.pending = [rows.slice(full, len(rows))]

    def _flush(self, rows: InstanceBatch) -> None:
        if len(rows):
            self.writer.write_table(rows.to_table(), row_group_size=self.rows_per_group)
            self.stats.add_columns(rows.input_ids, rows.offsets, rows.len_a, rows.masked_lm_positions,
                                   rows.masked_lm_ids, rows.mask_offsets, rows.next_sentence_label,
                                   self.mask_id)
            self.count += len(rows)

    def close(self) -> dict[str, Any]:
        """Finish the file; returns its manifest entry."""
        self._flush(InstanceBatch.concat(self.pending))
        self.pending = []
        self.writer.close()
        self.file.close()
        return storage.shard_entry(self.uri, count=self.count)


# --------------------------------------------------------------------------- rejects


def spill_rejects(uri: str, rejects: list[dict]) -> int:
    """Rejects -> one JSON-lines spill file sorted by id; returns how many."""
    rejects = sorted(rejects, key=lambda r: str(r["id"]))
    storage.write_text(uri, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejects))
    return len(rejects)


def merge_rejects(uris: Iterable[str], out: str, *, fan_in: int = MERGE_FAN_IN) -> int:
    """Sorted reject spill files -> one file sorted by id (ties in the order of the sorted
    names), streamed (a line per input held); returns how many. At most ``fan_in`` files are read
    at once (:func:`bert_core.sorted_runs.fewer_runs`)."""
    check_fan_in(fan_in)
    with fewer_runs(sorted(uris), fan_in, _merge_lines, "jsonl") as few:
        return _merge_lines(few, out)


def _merge_lines(uris: list[str], out: str) -> int:
    """Reject files sorted by id -> ``out``, in one ``heapq.merge``; returns how many lines."""
    files = [storage.open_file(uri, "rb") for uri in uris]
    count = 0
    try:
        lines = [((str(json.loads(line)["id"]), line) for line in f) for f in files]
        with storage.open_file(out, "wb") as w:
            for _, line in heapq.merge(*lines, key=lambda item: item[0]):
                w.write(line)
                count += 1
    finally:
        for f in files:
            f.close()
    return count
