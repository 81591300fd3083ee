"""Instances by the batch: numpy columns instead of one Python object per instance, and the
"instances" contract they are written in (:func:`schema`).

    batch = create_instance_batch(pool, doc_ids, seed=12345, dupe_factor=5, max_seq_length=128,
                                  max_predictions_per_seq=20, masked_lm_prob=0.15,
                                  short_seq_prob=0.1, vocab=vocab_ids)
    write_instance_shards(batch, "out/seq128", num_shards=4)   # the "instances" contract
    (beam_jobs/create_instances.py makes the same rows per random-next pool, a window at a time:
    bert_core.instances.pool_files.write_pool_instances)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bert_core.instances.masking import GAMMA, MaskingSpec, mask_instances, splitmix64
from bert_core.instances.pairs import (
    NO_NSP,
    DocumentPool,
    VocabIds,
    packed_spans,
    pair_spans,
    rng_for,
)

# Why: made one at a time, an instance costs tens of microseconds of Python (copying token lists,
# a shuffle of the candidates, a loop over the predictions), several times what it costs to
# tokenize its text. Here the pairs of a whole pool are decided first, as token ranges
# (:func:`bert_core.instances.pairs.pair_spans`: a few draws per pair, no token touched), then
# numpy copies the tokens of every pair at once (:func:`assemble`) and masks all of them at once
# (:func:`mask_batch`, on :mod:`bert_core.instances.masking`).
#
# Randomness stays per document and pass: the pairs of ``(seed, doc_id, dupe, max_seq_length)``
# come from :func:`~bert_core.instances.pairs.rng_for` of those parts, which also draws a 64-bit
# base; instance ``k`` of that pass gets the key ``splitmix64(base + (k + 1) * GAMMA)``. The key
# orders the shards and seeds the instance's masking, so no draw depends on how instances are
# batched.

if TYPE_CHECKING:
    import pyarrow as pa

SPAN_CHUNK = 1 << 14  # pairs gathered as Python tuples before they become one array


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without the loop
    (int32 when the values fit: half the memory traffic of int64 on these long index arrays)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.asarray(starts, dtype=np.int64) - (ends - lengths)
    dtype = np.int32 if total < 2**31 and int(np.abs(shift).max()) < 2**30 else np.int64
    out = np.repeat(shift.astype(dtype), lengths)
    out += np.arange(total, dtype=dtype)
    return out


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass
class InstanceBatch:
    """Instances as columns (the "instances" contract plus a sort key per instance).

    Row ``i``'s ``input_ids`` are ``input_ids[offsets[i]:offsets[i + 1]]`` and its predictions
    ``masked_lm_positions/ids[mask_offsets[i]:mask_offsets[i + 1]]``. Pickles as a handful of
    arrays (cheap for Beam to move), and becomes a Parquet table without a Python loop.
    """

    keys: np.ndarray  # uint64: shard order
    input_ids: np.ndarray  # int32, all rows end to end
    offsets: np.ndarray  # int64, rows + 1
    len_a: np.ndarray  # int32
    masked_lm_positions: np.ndarray  # int32, all rows end to end
    masked_lm_ids: np.ndarray  # int32
    mask_offsets: np.ndarray  # int64, rows + 1
    next_sentence_label: np.ndarray  # int8

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def empty(cls) -> InstanceBatch:
        z32, zo = np.zeros(0, np.int32), np.zeros(1, np.int64)
        return cls(np.zeros(0, np.uint64), z32, zo, z32, z32, z32, zo, np.zeros(0, np.int8))

    @classmethod
    def concat(cls, batches: Sequence[InstanceBatch]) -> InstanceBatch:
        batches = [b for b in batches if len(b)]
        if not batches:
            return cls.empty()
        if len(batches) == 1:
            return batches[0]
        return cls(
            np.concatenate([b.keys for b in batches]),
            np.concatenate([b.input_ids for b in batches]),
            _offsets(np.concatenate([b.lengths for b in batches])),
            np.concatenate([b.len_a for b in batches]),
            np.concatenate([b.masked_lm_positions for b in batches]),
            np.concatenate([b.masked_lm_ids for b in batches]),
            _offsets(np.concatenate([np.diff(b.mask_offsets) for b in batches])),
            np.concatenate([b.next_sentence_label for b in batches]),
        )

    def take(self, rows: np.ndarray) -> InstanceBatch:
        """The rows at ``rows`` (any order), as a new batch."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths, n_masked = self.lengths[rows], np.diff(self.mask_offsets)[rows]
        tokens = _ranges(self.offsets[rows], lengths)
        masks = _ranges(self.mask_offsets[rows], n_masked)
        return InstanceBatch(
            self.keys[rows], self.input_ids[tokens], _offsets(lengths), self.len_a[rows],
            self.masked_lm_positions[masks], self.masked_lm_ids[masks], _offsets(n_masked),
            self.next_sentence_label[rows],
        )

    def slice(self, start: int, stop: int) -> InstanceBatch:
        """Rows ``start:stop`` (views, no copy)."""
        o0, o1 = int(self.offsets[start]), int(self.offsets[stop])
        m0, m1 = int(self.mask_offsets[start]), int(self.mask_offsets[stop])
        return InstanceBatch(
            self.keys[start:stop], self.input_ids[o0:o1], self.offsets[start:stop + 1] - o0,
            self.len_a[start:stop], self.masked_lm_positions[m0:m1], self.masked_lm_ids[m0:m1],
            self.mask_offsets[start:stop + 1] - m0, self.next_sentence_label[start:stop],
        )

    def sorted_by_key(self) -> InstanceBatch:
        return self.take(np.argsort(self.keys, kind="stable"))

    def rows(self) -> list[tuple[list[int], int, list[int], list[int], int]]:
        """``(input_ids, len_a, masked_lm_positions, masked_lm_ids, next_sentence_label)`` per row."""
        ids, pos, lab = self.input_ids.tolist(), self.masked_lm_positions.tolist(), self.masked_lm_ids.tolist()
        o, m = self.offsets.tolist(), self.mask_offsets.tolist()
        return [(ids[o[i]:o[i + 1]], int(self.len_a[i]), pos[m[i]:m[i + 1]], lab[m[i]:m[i + 1]],
                 int(self.next_sentence_label[i])) for i in range(len(self))]

    @classmethod
    def from_table(cls, table: pa.Table) -> InstanceBatch:
        """The rows of a table of the contract's columns (:meth:`to_table`'s inverse; keys 0)."""

        def lists(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
            array = column.combine_chunks()
            offsets = array.offsets.to_numpy().astype(np.int64)
            return array.flatten().to_numpy().astype(np.int32, copy=False), offsets - offsets[0]

        input_ids, offsets = lists(table.column("input_ids"))
        positions, mask_offsets = lists(table.column("masked_lm_positions"))
        masked_ids, _ = lists(table.column("masked_lm_ids"))
        return cls(np.zeros(table.num_rows, np.uint64), input_ids, offsets,
                   table.column("len_a").to_numpy().astype(np.int32, copy=False), positions, masked_ids,
                   mask_offsets, table.column("next_sentence_label").to_numpy().astype(np.int8, copy=False))

    def to_table(self) -> pa.Table:
        """The contract's Parquet schema (:data:`SCHEMA`), built from the arrays (no Python loop)."""
        import pyarrow as pa

        def lists(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
            return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.int32()))

        return pa.Table.from_arrays([
            lists(self.offsets, self.input_ids), pa.array(self.len_a, pa.int32()),
            lists(self.mask_offsets, self.masked_lm_positions), lists(self.mask_offsets, self.masked_lm_ids),
            pa.array(self.next_sentence_label, pa.int8()),
        ], schema=schema())


def schema() -> pa.Schema:
    """The "instances" contract: unpadded rows, segment ids 0 before ``len_a`` and 1 after.

    A shard (``seq{L}/part-SSSSS-of-NNNNN.parquet``) holds ``input_ids list<int32>``,
    ``len_a int32``, ``masked_lm_positions list<int32>``, ``masked_lm_ids list<int32>`` and
    ``next_sentence_label int8`` (1 a random next, 0 the actual next, -1 without NSP). With
    ``masking: dynamic`` the masked_lm columns are empty and the loader masks each epoch with
    ``bert_core.instances.masking``, the masking the job uses.
    """
    import pyarrow as pa

    ints = pa.list_(pa.int32())
    return pa.schema([
        ("input_ids", ints), ("len_a", pa.int32()), ("masked_lm_positions", ints),
        ("masked_lm_ids", ints), ("next_sentence_label", pa.int8()),
    ])


def write_table(uri: str, table: pa.Table) -> None:
    """One Parquet shard (same rows -> same bytes)."""
    import pyarrow.parquet as pq

    from bert_core import storage

    with storage.open_file(uri, "wb") as f:
        pq.write_table(table, f, compression="zstd")


def instance_shard_name(index: int, shards: int) -> str:
    """``part-SSSSS-of-NNNNN.parquet``: the instances contract's shard names."""
    from bert_core import storage

    return storage.shard_name("part", index, shards, "parquet")


def write_instance_shards(batch: InstanceBatch, folder: str, num_shards: int) -> list[dict]:
    """``batch`` in key order split into ``num_shards`` contiguous shards whose sizes differ by
    at most one, written as ``folder/part-SSSSS-of-NNNNN.parquet``; returns the manifest's shard
    entries (no manifest written: the caller adds stats and writes it last)."""
    from bert_core import storage

    batch = batch.sorted_by_key()
    q, rem = divmod(len(batch), num_shards)
    bounds = np.cumsum([0] + [q + (i < rem) for i in range(num_shards)])
    entries = []
    for i in range(num_shards):
        uri = storage.join(folder, instance_shard_name(i, num_shards))
        write_table(uri, batch.slice(int(bounds[i]), int(bounds[i + 1])).to_table())
        entries.append(storage.shard_entry(uri, count=int(bounds[i + 1] - bounds[i])))
    return entries


# --------------------------------------------------------------------------- making batches


def assemble(pool: DocumentPool, spans: np.ndarray, keys: np.ndarray, vocab: VocabIds) -> InstanceBatch:
    """``[CLS] A [SEP] (B [SEP])`` for every span ``(a0, a1, b0, b1, label)`` of ``pool`` (unmasked)."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 5)
    a0, a1, b0, b1, label = spans.T
    has_b = label != NO_NSP
    la = a1 - a0
    lb = np.where(has_b, b1 - b0, 0)
    len_a = la + 2
    len_b = np.where(has_b, lb + 1, 0)  # B and its [SEP]
    offsets = _offsets(len_a + len_b)
    start = offsets[:-1]
    # A job's pool keeps its tokens as uint16 when the vocab fits (half the memory): read as they are.
    tokens = pool.tokens if isinstance(pool.tokens, np.ndarray) else np.asarray(pool.tokens, dtype=np.int32)
    # One gather: position p of "[CLS] A [SEP]" reads token a0 - 1 + p, position p of "B [SEP]"
    # reads b0 + p (a [CLS]/[SEP] reads a neighbour, clipped to the pool, then is overwritten).
    shift = np.stack([a0 - 1 - start, b0 - start - len_a], axis=1).ravel()
    source = np.repeat(shift, np.stack([len_a, len_b], axis=1).ravel())
    source += np.arange(len(source))
    out = tokens.take(source, mode="clip").astype(np.int32)
    out[start] = vocab.cls_id
    out[start + la + 1] = vocab.sep_id
    out[(offsets[1:] - 1)[has_b]] = vocab.sep_id
    z32, zo = np.zeros(0, np.int32), np.zeros(len(spans) + 1, np.int64)
    return InstanceBatch(np.asarray(keys, dtype=np.uint64), out, offsets, len_a.astype(np.int32),
                         z32, z32, zo, label.astype(np.int8))


def mask_batch(batch: InstanceBatch, spec: MaskingSpec) -> InstanceBatch:
    """Every row masked by :func:`bert_core.instances.masking.mask_instances`, keyed by its key."""
    masked = mask_instances(batch.keys, batch.input_ids, batch.offsets, batch.len_a, spec)
    return InstanceBatch(batch.keys, masked.input_ids, batch.offsets, batch.len_a,
                         masked.masked_lm_positions, masked.masked_lm_ids, masked.mask_offsets,
                         batch.next_sentence_label)


def instance_spans(
    pool: DocumentPool,
    doc_ids: Sequence[str],
    *,
    seed: int,
    dupe_factor: int,
    max_seq_length: int,
    short_seq_prob: float,
    next_sentence_prediction: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The pairs of every document of ``pool`` (``doc_ids[d]`` names document ``d``), every pass,
    one length, in document/pass order: spans ``(a0, a1, b0, b1, label)`` as an ``(n, 5)`` array
    (int32 unless the pool has 2**31 tokens) and the instances' 64-bit keys. A few dozen bytes per instance: the tokens are copied
    later, a window at a time (:func:`assemble`)."""
    make = pair_spans if next_sentence_prediction else packed_spans
    dtype = np.int32 if len(pool.tokens) < 2**31 else np.int64  # token positions and labels
    span_parts: list[np.ndarray] = [np.zeros((0, 5), dtype=dtype)]
    key_parts: list[np.ndarray] = [np.zeros(0, dtype=np.uint64)]
    spans: list = []
    bases: list[int] = []
    counts: list[int] = []

    def flush() -> None:  # Python tuples cost ~10x the array: convert every SPAN_CHUNK pairs
        counts_arr = np.array(counts, dtype=np.int64)
        within = np.arange(len(spans)) - np.repeat(_offsets(counts_arr)[:-1], counts_arr)
        key_parts.append(splitmix64(np.repeat(np.array(bases, dtype=np.uint64), counts_arr)
                                    + (within.astype(np.uint64) + np.uint64(1)) * GAMMA))
        span_parts.append(np.array(spans, dtype=dtype).reshape(-1, 5))
        spans.clear()
        bases.clear()
        counts.clear()

    for index, doc_id in enumerate(doc_ids):
        for dupe in range(dupe_factor):
            rng = rng_for(seed, doc_id, dupe, max_seq_length)
            made = make(pool, index, max_seq_length, short_seq_prob, rng)
            spans += made
            bases.append(rng.getrandbits(64))
            counts.append(len(made))
        if len(spans) >= SPAN_CHUNK:
            flush()
    flush()
    return np.concatenate(span_parts), np.concatenate(key_parts)


def create_instance_batch(
    pool: DocumentPool,
    doc_ids: Sequence[str],
    *,
    seed: int,
    dupe_factor: int,
    max_seq_length: int,
    max_predictions_per_seq: int,
    masked_lm_prob: float,
    short_seq_prob: float,
    vocab: VocabIds,
    next_sentence_prediction: bool = True,
    whole_word_mask: bool = False,
    mask: bool = True,
) -> InstanceBatch:
    """Every instance of every document of ``pool`` (``doc_ids[d]`` names document ``d``), every
    pass, one length, in document/pass order (the keys give the shard order)."""
    spans, keys = instance_spans(pool, doc_ids, seed=seed, dupe_factor=dupe_factor,
                                 max_seq_length=max_seq_length, short_seq_prob=short_seq_prob,
                                 next_sentence_prediction=next_sentence_prediction)
    if not len(spans):
        return InstanceBatch.empty()
    batch = assemble(pool, spans, keys, vocab)
    if not mask:
        return batch
    return mask_batch(batch, MaskingSpec(masked_lm_prob, max_predictions_per_seq, vocab, whole_word_mask))
