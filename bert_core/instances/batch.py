"""Instances by the batch: numpy columns instead of one Python object per instance.

    batch = create_instance_batch(pool, doc_ids, seed=12345, dupe_factor=5, max_seq_length=128,
                                  max_predictions_per_seq=20, masked_lm_prob=0.15,
                                  short_seq_prob=0.1, vocab=vocab_ids)
    write_instance_shards(batch, "out/seq128", num_shards=4)   # the "instances" contract
    (beam_jobs/create_instances.py calls create_instance_batch once per random-next pool)

Why: made one at a time, an instance costs tens of microseconds of Python (copying token lists,
a shuffle of the candidates, a loop over the predictions), several times what it costs to
tokenize its text. Here the pairs of a whole pool are decided first, as token ranges
(:func:`bert_core.instances.pairs.pair_spans`: a few draws per pair, no token touched), then
numpy copies the tokens of every pair at once (:func:`assemble`) and masks all of them at once
(:func:`mask_batch`). The rules are the same; the draws are not the reference's.

Randomness stays per document and pass: the pairs of ``(seed, doc_id, dupe, max_seq_length)``
come from :func:`~bert_core.instances.pairs.rng_for` of those parts, which also draws a 64-bit
base; instance ``k`` of that pass gets the key ``splitmix64(base + (k + 1) * GAMMA)``. The key
orders the shards, and seeds a counter-based stream for the instance's masking (SplitMix64:
``splitmix64(key + j * GAMMA)`` is output ``j`` of a SplitMix64 generator seeded with ``key``),
so every random number is a pure function of the instance and numpy draws them for all
instances in a few vector operations. No draw depends on how instances are batched.

Masking (:func:`mask_batch`), per instance, as in the reference: candidates are all tokens but
``[CLS]``/``[SEP]``, ``num_to_predict = min(max_predictions_per_seq, max(1, round(len *
masked_lm_prob)))`` (numpy's ``rint`` rounds half to even like Python 3's ``round``), a uniformly
random subset of that many candidates, each ``[MASK]`` with probability 0.8, kept 0.1, a random
id of the whole vocab 0.1, positions sorted. The subset is the first ``num_to_predict`` distinct
values of the instance's stream of uniform draws over its candidates (by symmetry a uniformly
random subset, and ~30 draws per instance instead of a key per token); rows whose segments hold a
``[CLS]``/``[SEP]`` id, or whose draws repeat too much (astronomically rare), use a random key
per token instead (:func:`_choose_by_keys`). Whole-word masking keeps the per-instance
:func:`~bert_core.instances.pairs.create_masked_lm_predictions` (seeded from the same key).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bert_core.instances.pairs import (
    NO_NSP,
    DocumentPool,
    VocabIds,
    create_masked_lm_predictions,
    packed_spans,
    pair_spans,
    rng_for,
)

GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2^64 / golden ratio)
# counters of an instance's stream: 1.. the draws that choose its predictions, then their
# corruption (keyed by position), then per-token keys (only for _choose_by_keys)
_CHOICE_STREAM = np.uint64(1 << 20)
_KEY_STREAM = np.uint64(2 << 20)
MASK_CHUNK = 2048  # instances masked at once: bounds the (instances x length) key matrix


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on each uint64 (wrapping arithmetic), in place: pass a
    temporary (or a copy)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _uniform(z: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in [0, 1) (the top 53 bits)."""
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


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

    def to_table(self):  # noqa: ANN201 - pyarrow.Table
        """The contract's Parquet schema (:data:`SCHEMA`), built from the arrays (no Python loop)."""
        import pyarrow as pa

        def lists(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
            return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.int32()))

        return pa.Table.from_arrays([
            lists(self.offsets, self.input_ids), pa.array(self.len_a, pa.int32()),
            lists(self.mask_offsets, self.masked_lm_positions), lists(self.mask_offsets, self.masked_lm_ids),
            pa.array(self.next_sentence_label, pa.int8()),
        ], schema=schema())


def schema():  # noqa: ANN201 - pyarrow.Schema
    """The "instances" contract: unpadded rows, segment ids 0 before ``len_a`` and 1 after."""
    import pyarrow as pa

    ints = pa.list_(pa.int32())
    return pa.schema([
        ("input_ids", ints), ("len_a", pa.int32()), ("masked_lm_positions", ints),
        ("masked_lm_ids", ints), ("next_sentence_label", pa.int8()),
    ])


def write_table(uri: str, table) -> None:  # noqa: ANN001 - pyarrow.Table
    """One Parquet shard (same rows -> same bytes)."""
    import pyarrow.parquet as pq

    from bert_core import storage

    with storage.open_file(uri, "wb") as f:
        pq.write_table(table, f, compression="zstd")


def shard_name(index: int, shards: int) -> str:
    return f"part-{index:05d}-of-{shards:05d}.parquet"


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
        uri = storage.join(folder, shard_name(i, num_shards))
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
    offsets = _offsets(len_a + np.where(has_b, lb + 1, 0))
    out = np.empty(int(offsets[-1]), dtype=np.int32)
    start = offsets[:-1]
    tokens = np.asarray(pool.tokens, dtype=np.int32)
    out[start] = vocab.cls_id
    out[start + la + 1] = vocab.sep_id
    out[(offsets[1:] - 1)[has_b]] = vocab.sep_id
    out[_ranges(start + 1, la)] = tokens[_ranges(a0, la)]
    out[_ranges(start + la + 2, lb)] = tokens[_ranges(b0, lb)]
    z32, zo = np.zeros(0, np.int32), np.zeros(len(spans) + 1, np.int64)
    return InstanceBatch(np.asarray(keys, dtype=np.uint64), out, offsets, len_a.astype(np.int32),
                         z32, z32, zo, label.astype(np.int8))


def mask_batch(batch: InstanceBatch, masked_lm_prob: float, max_predictions_per_seq: int,
               vocab: VocabIds) -> InstanceBatch:
    """Static masking of every row (see the module docstring), in chunks of MASK_CHUNK rows."""
    if len(batch) <= MASK_CHUNK:
        return _mask_chunk(batch, masked_lm_prob, max_predictions_per_seq, vocab)
    return InstanceBatch.concat([
        _mask_chunk(batch.slice(i, min(i + MASK_CHUNK, len(batch))), masked_lm_prob,
                    max_predictions_per_seq, vocab)
        for i in range(0, len(batch), MASK_CHUNK)
    ])


def _mask_chunk(batch: InstanceBatch, masked_lm_prob: float, max_predictions_per_seq: int,
                vocab: VocabIds) -> InstanceBatch:
    n = len(batch)
    if n == 0:
        return batch
    ids, lengths = batch.input_ids, batch.lengths
    has_b = batch.len_a != lengths
    # [CLS] at 0, [SEP] at len_a - 1 and (with B) at the end: the candidates are the rest,
    # unless a segment holds a [CLS]/[SEP] id itself (never from text; possible in hand-made
    # documents), which _choose_by_keys handles by id, as the reference does.
    is_special = (ids == vocab.cls_id) | (ids == vocab.sep_id)
    structural = np.add.reduceat(is_special.astype(np.int64), batch.offsets[:-1]) == np.where(has_b, 3, 2)
    n_candidates = lengths - np.where(has_b, 3, 2)
    budget = np.minimum(np.minimum(max_predictions_per_seq,
                                   np.maximum(1, np.rint(lengths * masked_lm_prob).astype(np.int64))),
                        n_candidates)
    rows, positions, ok = _choose_by_draws(batch.keys, batch.len_a.astype(np.int64) - 2, n_candidates, budget)
    ok &= structural
    if not ok.all():
        redo = np.flatnonzero(~ok)
        keep = ok[rows]
        redo_rows, redo_positions = _choose_by_keys(batch.take(redo), masked_lm_prob, max_predictions_per_seq, vocab)
        rows = np.concatenate([rows[keep], redo[redo_rows]])
        positions = np.concatenate([positions[keep], redo_positions])
        order = np.lexsort((positions, rows))
        rows, positions = rows[order], positions[order]

    where = batch.offsets[rows] + positions
    labels = ids[where]
    # One 64-bit draw per prediction: the high 32 bits choose [MASK]/keep/random, the low 32
    # bits pick the random id (multiply-shift: uniform over the vocab to within 2**-32).
    draw = splitmix64(batch.keys[rows] + (_CHOICE_STREAM + positions.astype(np.uint64) + np.uint64(1)) * GAMMA)
    choice = (draw >> np.uint64(32)).astype(np.float64) * (1.0 / (1 << 32))
    random_id = (((draw & np.uint64(0xFFFFFFFF)) * np.uint64(vocab.vocab_size)) >> np.uint64(32)).astype(np.int32)
    out = ids.copy()
    out[where[choice < 0.8]] = vocab.mask_id  # 80% [MASK]; 0.8-0.9: keep the token (10%)
    randomized = choice >= 0.9
    out[where[randomized]] = random_id[randomized]  # 10% a random id of the whole vocab
    return InstanceBatch(batch.keys, out, batch.offsets, batch.len_a, positions.astype(np.int32),
                         labels.astype(np.int32), _offsets(np.bincount(rows, minlength=n)),
                         batch.next_sentence_label)


def _choose_by_draws(keys: np.ndarray, a_tokens: np.ndarray, n_candidates: np.ndarray,
                     budget: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, ``budget`` distinct candidates, uniformly: the first ``budget`` distinct values
    of a stream of uniform draws from ``[0, n_candidates)`` (by symmetry a uniformly random
    subset), candidate ``c`` being position ``c + 1`` in A and ``c + 2`` in B. A few more draws
    than the largest budget are made for every row at once (a small matrix, not one key per
    token); a row whose draws repeat too often to fill its budget (astronomically rare) comes
    back with ``ok`` False. Returns (row, position) sorted by row then position, and ``ok``."""
    n = len(keys)
    width = int(budget.max()) + 12
    counters = (np.arange(1, width + 1, dtype=np.uint64) * GAMMA)[None, :]
    draws = splitmix64(keys[:, None] + counters)
    picks = (((draws & np.uint64(0xFFFFFFFF)) * n_candidates.astype(np.uint64)[:, None])
             >> np.uint64(32)).astype(np.int64)  # uniform in [0, n_candidates) to within 2**-32
    order = np.argsort(picks, axis=1, kind="stable")
    ranked = np.take_along_axis(picks, order, axis=1)
    first = np.ones_like(ranked, dtype=bool)
    first[:, 1:] = ranked[:, 1:] != ranked[:, :-1]  # first draw of each value (stable sort)
    distinct = np.empty_like(first)
    np.put_along_axis(distinct, order, first, axis=1)
    seen = np.cumsum(distinct, axis=1)
    chosen = distinct & (seen <= budget[:, None])
    ok = seen[:, -1] >= budget
    positions = picks + 1 + (picks >= a_tokens[:, None])
    big = np.iinfo(np.int64).max
    positions = np.where(chosen, positions, big)
    positions.sort(axis=1)
    valid = positions != big
    return np.repeat(np.arange(n), valid.sum(axis=1)), positions[valid], ok


def _choose_by_keys(batch: InstanceBatch, masked_lm_prob: float, max_predictions_per_seq: int,
                    vocab: VocabIds) -> tuple[np.ndarray, np.ndarray]:
    """The general form of :func:`_choose_by_draws`: a random key per token, candidates found
    by id, the ``budget`` smallest keys of each row. Returns (row, position), sorted."""
    n = len(batch)
    ids, lengths = batch.input_ids, batch.lengths
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(len(ids)) - np.repeat(batch.offsets[:-1], lengths)
    candidate = (ids != vocab.cls_id) & (ids != vocab.sep_id)
    # the low 16 bits hold the column, so keys within a row never tie (48 random bits above)
    col64 = col.astype(np.uint64)
    u = splitmix64(batch.keys[row] + (_KEY_STREAM + col64 + np.uint64(1)) * GAMMA)
    u >>= np.uint64(16)
    u <<= np.uint64(16)
    u |= col64
    u[~candidate] = np.uint64(np.iinfo(np.uint64).max)
    budget = np.minimum(max_predictions_per_seq, np.maximum(1, np.rint(lengths * masked_lm_prob).astype(np.int64)))
    budget = np.minimum(budget, np.add.reduceat(candidate.astype(np.int64), batch.offsets[:-1]))
    kmax = int(budget.max())
    if kmax == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    grid = np.full((n, int(lengths.max())), np.iinfo(np.uint64).max, dtype=np.uint64)
    grid[row, col] = u
    smallest = np.partition(grid, kmax - 1, axis=1)[:, :kmax] if kmax < grid.shape[1] else grid
    smallest.sort(axis=1)
    threshold = smallest[np.arange(n), np.maximum(budget, 1) - 1]
    where = np.flatnonzero(candidate & (u <= threshold[row]) & (budget[row] > 0))
    return row[where], col[where]


def _mask_whole_words(batch: InstanceBatch, masked_lm_prob: float, max_predictions_per_seq: int,
                      vocab: VocabIds) -> InstanceBatch:
    """Whole-word masking, row by row with the per-instance rules, seeded from each row's key."""
    outs, positions, labels = [], [], []
    for i, (input_ids, *_rest) in enumerate(batch.rows()):
        out, pos, lab = create_masked_lm_predictions(input_ids, masked_lm_prob, max_predictions_per_seq,
                                                     vocab, random.Random(int(batch.keys[i])), True)
        outs.append(out)
        positions.append(pos)
        labels.append(lab)

    def flat(lists: list[list[int]]) -> np.ndarray:
        return np.fromiter((x for xs in lists for x in xs), dtype=np.int32)

    return InstanceBatch(batch.keys, flat(outs), batch.offsets, batch.len_a, flat(positions),
                         flat(labels), _offsets(np.array([len(p) for p in positions], dtype=np.int64)),
                         batch.next_sentence_label)


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
    make = pair_spans if next_sentence_prediction else packed_spans
    spans: list = []
    bases: list[int] = []
    counts: list[int] = []
    for index, doc_id in enumerate(doc_ids):
        for dupe in range(dupe_factor):
            rng = rng_for(seed, doc_id, dupe, max_seq_length)
            made = make(pool, index, max_seq_length, short_seq_prob, rng)
            spans += made
            bases.append(rng.getrandbits(64))
            counts.append(len(made))
    if not spans:
        return InstanceBatch.empty()
    counts_arr = np.array(counts, dtype=np.int64)
    within = np.arange(len(spans)) - np.repeat(_offsets(counts_arr)[:-1], counts_arr)
    keys = splitmix64(np.repeat(np.array(bases, dtype=np.uint64), counts_arr)
                      + (within.astype(np.uint64) + np.uint64(1)) * GAMMA)
    batch = assemble(pool, np.array(spans, dtype=np.int64), keys, vocab)
    if not mask:
        return batch
    if whole_word_mask:
        return _mask_whole_words(batch, masked_lm_prob, max_predictions_per_seq, vocab)
    return mask_batch(batch, masked_lm_prob, max_predictions_per_seq, vocab)
