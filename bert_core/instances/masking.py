"""Masked-LM masking: many instances at once, every draw keyed by the instance.

    masked = mask_instances(keys, input_ids, offsets, len_a, spec)
    (bert_core.instances.batch masks the job's instances with it under ``masking: static``;
    bert_core.pretrain.data masks each epoch's rows with it under ``masking: dynamic``)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from bert_core.instances.pairs import VocabIds

# The rules of google-research/bert's ``create_masked_lm_predictions``, per instance:
#
# - candidates are all tokens but ``[CLS]``/``[SEP]``; with ``whole_word_mask`` a ``##`` piece
#   joins the group of the candidate before it, and a group is chosen whole or not at all;
# - ``num_to_predict = min(max_predictions_per_seq, max(1, rint(len * masked_lm_prob)))``,
#   halves to even as Python 3 does;
# - the groups are walked in a uniformly random order, each taken when it fits in what is left
#   of ``num_to_predict`` (a whole word that would overshoot is skipped, not split);
# - each chosen position becomes ``[MASK]`` with probability 0.8, keeps its token 0.1, becomes a
#   random id of the whole vocab 0.1; positions come out sorted.
#
# Randomness: instance ``i`` has a 64-bit key, and its draw number ``j`` is
# ``splitmix64(key + j * GAMMA)``, output ``j`` of a SplitMix64 generator seeded with the key. A
# counter-based stream: every random number is a pure function of (key, counter), so numpy draws
# them for all instances in a few vector operations and no draw depends on how instances are
# batched. Counters ``1..`` choose positions, ``_CHOICE_STREAM + position`` corrupts a position,
# ``_KEY_STREAM + position`` orders the group that starts at that position.
#
# Choosing, fast form (single tokens, the structural ``[CLS] A [SEP] (B [SEP])`` layout): the
# first ``num_to_predict`` distinct values of the instance's stream of uniform draws over its
# candidates, by symmetry a uniformly random subset, in about ``num_to_predict`` draws. General
# form (whole words; rows whose segments hold a ``[CLS]``/``[SEP]`` id, found by id as the
# reference does; rows whose draws repeat too often to fill their budget, rare with a dozen spare
# draws): a random key per group, groups walked in key order (:func:`_choose_by_groups`).

GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2^64 / golden ratio)
_CHOICE_STREAM = np.uint64(1 << 20)
_KEY_STREAM = np.uint64(2 << 20)
MASK_CHUNK_TOKENS = 1 << 18  # tokens masked at once: bounds the (instances x length) matrices
DRAW_SLACK = 12  # draws per row beyond max_predictions_per_seq (fast form)
_NO_KEY = np.uint64(np.iinfo(np.uint64).max)


@dataclass(frozen=True)
class MaskingSpec:
    """The masking settings of one sequence length, and the vocab they draw from."""

    masked_lm_prob: float
    max_predictions_per_seq: int
    vocab: VocabIds
    whole_word_mask: bool = False


class Masked(NamedTuple):
    """Masked rows, in the layout they came in: row ``i``'s predictions are
    ``masked_lm_positions/ids[mask_offsets[i]:mask_offsets[i + 1]]``."""

    input_ids: np.ndarray  # int32, the corrupted rows end to end
    masked_lm_positions: np.ndarray  # int32
    masked_lm_ids: np.ndarray  # int32, the original ids at those positions
    mask_offsets: np.ndarray  # int64, rows + 1


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on each uint64 (wrapping arithmetic), in place: pass a
    temporary (or a copy)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def mask_instances(keys: np.ndarray, input_ids: np.ndarray, offsets: np.ndarray, len_a: np.ndarray,
                   spec: MaskingSpec) -> Masked:
    """Mask every row: row ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]`` (``[CLS] A [SEP]
    (B [SEP])``, ``len_a`` tokens up to the first ``[SEP]``) with key ``keys[i]``."""
    keys = np.asarray(keys, dtype=np.uint64)
    input_ids = np.asarray(input_ids, dtype=np.int32)
    offsets = np.asarray(offsets, dtype=np.int64)
    len_a = np.asarray(len_a, dtype=np.int64)
    parts = []
    longest = int(np.diff(offsets).max()) if len(keys) else 1
    chunk = max(1, MASK_CHUNK_TOKENS // max(1, longest))
    for start in range(0, len(keys), chunk):
        stop = min(start + chunk, len(keys))
        o0, o1 = int(offsets[start]), int(offsets[stop])
        parts.append(_mask_chunk(keys[start:stop], input_ids[o0:o1], offsets[start:stop + 1] - o0,
                                 len_a[start:stop], spec))
    if not parts:
        z32 = np.zeros(0, np.int32)
        return Masked(input_ids.copy(), z32, z32, np.zeros(1, np.int64))
    return Masked(
        np.concatenate([p.input_ids for p in parts]),
        np.concatenate([p.masked_lm_positions for p in parts]),
        np.concatenate([p.masked_lm_ids for p in parts]),
        _offsets(np.concatenate([np.diff(p.mask_offsets) for p in parts])),
    )


def _mask_chunk(keys: np.ndarray, ids: np.ndarray, offsets: np.ndarray, len_a: np.ndarray,
                spec: MaskingSpec) -> Masked:
    vocab = spec.vocab
    n = len(keys)
    lengths = np.diff(offsets)
    has_b = len_a != lengths
    budget = np.minimum(spec.max_predictions_per_seq,
                        np.maximum(1, np.rint(lengths * spec.masked_lm_prob).astype(np.int64)))
    is_special = (ids == vocab.cls_id) | (ids == vocab.sep_id)
    if spec.whole_word_mask:
        rows, positions = _choose_by_groups(keys, offsets, budget, ~is_special,
                                            ~_subword_table(vocab)[ids])
    else:
        # [CLS] at 0, [SEP] at len_a - 1 and (with B) at the end: the candidates are the rest,
        # unless a segment holds a [CLS]/[SEP] id itself (never from text; possible in hand-made
        # documents), which the general form handles by id.
        structural = np.add.reduceat(is_special.astype(np.int64), offsets[:-1]) == np.where(has_b, 3, 2)
        n_candidates = lengths - np.where(has_b, 3, 2)
        rows, positions, ok = _choose_by_draws(keys, len_a - 2, n_candidates,
                                               np.minimum(budget, n_candidates),
                                               spec.max_predictions_per_seq + DRAW_SLACK)
        ok &= structural
        if not ok.all():
            keep = ok[rows]
            redo_rows, redo_positions = _choose_by_groups(keys, offsets, budget, ~is_special,
                                                          np.ones(len(ids), dtype=bool))
            redo = ~ok[redo_rows]
            rows = np.concatenate([rows[keep], redo_rows[redo]])
            positions = np.concatenate([positions[keep], redo_positions[redo]])
            order = np.lexsort((positions, rows))
            rows, positions = rows[order], positions[order]

    where = offsets[rows] + positions
    labels = ids[where]
    # One 64-bit draw per prediction: the high 32 bits choose [MASK]/keep/random, the low 32
    # bits pick the random id (multiply-shift: uniform over the vocab to within 2**-32).
    draw = splitmix64(keys[rows] + (_CHOICE_STREAM + positions.astype(np.uint64) + np.uint64(1)) * GAMMA)
    choice = (draw >> np.uint64(32)).astype(np.float64) * (1.0 / (1 << 32))
    random_id = (((draw & np.uint64(0xFFFFFFFF)) * np.uint64(vocab.vocab_size)) >> np.uint64(32)).astype(np.int32)
    out = ids.copy()
    out[where[choice < 0.8]] = vocab.mask_id  # 80% [MASK]; 0.8-0.9: keep the token (10%)
    randomized = choice >= 0.9
    out[where[randomized]] = random_id[randomized]  # 10% a random id of the whole vocab
    return Masked(out, positions.astype(np.int32), labels.astype(np.int32),
                  _offsets(np.bincount(rows, minlength=n)))


def _choose_by_draws(keys: np.ndarray, a_tokens: np.ndarray, n_candidates: np.ndarray,
                     budget: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, ``budget`` distinct candidates, uniformly: the first ``budget`` distinct values
    of a stream of uniform draws from ``[0, n_candidates)`` (by symmetry a uniformly random
    subset), candidate ``c`` being position ``c + 1`` in A and ``c + 2`` in B. A few more draws
    than any budget (``width`` in all, fixed by the spec so that no row's result depends on
    the rows masked with it) are made for every row at once (a small matrix, not one key per
    token); a row whose draws repeat too often to fill its budget comes back with ``ok`` False.
    Returns (row, position) sorted by row then position, and ``ok``."""
    n = len(keys)
    counters = (np.arange(1, width + 1, dtype=np.uint64) * GAMMA)[None, :]
    draws = splitmix64(keys[:, None] + counters)
    picks = ((draws & np.uint64(0xFFFFFFFF)) * n_candidates.astype(np.uint64)[:, None]) \
        >> np.uint64(32)  # uniform in [0, n_candidates) to within 2**-32
    # Each row's draws sorted by (value, draw number) in one sort of value * 2**bits + draw number.
    bits = np.uint64(int(width - 1).bit_length())
    ranked = (picks << bits) | np.arange(width, dtype=np.uint64)[None, :]
    ranked.sort(axis=1)
    draw = (ranked & ((np.uint64(1) << bits) - np.uint64(1))).astype(np.intp)
    value = (ranked >> bits).astype(np.int64)
    first = np.ones(value.shape, dtype=bool)
    first[:, 1:] = value[:, 1:] != value[:, :-1]  # the first draw of each value
    distinct = np.empty_like(first)  # in draw order
    np.put_along_axis(distinct, draw, first, axis=1)
    seen = np.cumsum(distinct, axis=1)
    ok = seen[:, -1] >= budget
    # back in value order, so the chosen candidates (and their positions) come out sorted
    chosen = np.take_along_axis(distinct & (seen <= budget[:, None]), draw, axis=1)
    rows = np.repeat(np.arange(n), chosen.sum(axis=1))
    positions = value[chosen]
    positions += 1 + (positions >= a_tokens[rows])
    return rows, positions, ok


def _choose_by_groups(keys: np.ndarray, offsets: np.ndarray, budget: np.ndarray,
                      candidate: np.ndarray, starts_group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The general form: candidates found by id, grouped (a candidate that does not start a
    group joins the one before it, across a ``[SEP]`` as in the reference), a random key per
    group, groups walked in key order and taken while they fit the budget. Returns (row,
    position), sorted."""
    n = len(keys)
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(len(candidate)) - np.repeat(offsets[:-1], lengths)
    cand = np.flatnonzero(candidate)
    if len(cand) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    c_row = row[cand]
    starts = starts_group[cand].copy()
    starts[0] = True
    starts[1:] |= c_row[1:] != c_row[:-1]  # a row's first candidate always starts a group
    group = np.cumsum(starts) - 1
    g_row, g_col = c_row[starts], col[cand][starts]
    g_size = np.bincount(group)
    # the group's key: 48 random bits over its first position's column, so keys never tie
    g_col64 = g_col.astype(np.uint64)
    key = splitmix64(keys[g_row] + (_KEY_STREAM + g_col64 + np.uint64(1)) * GAMMA)
    key >>= np.uint64(16)
    key <<= np.uint64(16)
    key |= g_col64
    per_row = np.bincount(g_row, minlength=n)
    slot = np.arange(len(g_row)) - np.repeat(_offsets(per_row)[:-1], per_row)
    grid = np.full((n, int(per_row.max())), _NO_KEY, dtype=np.uint64)
    grid[g_row, slot] = key
    order = np.argsort(grid, axis=1)
    sizes = np.zeros(grid.shape, dtype=np.int64)
    sizes[g_row, slot] = g_size
    sizes = np.take_along_axis(sizes, order, axis=1)
    taken = np.zeros(n, dtype=np.int64)
    accepted = np.zeros(grid.shape, dtype=bool)
    for j in range(grid.shape[1]):  # walk the groups in key order, all rows at once
        fits = (sizes[:, j] > 0) & (taken + sizes[:, j] <= budget)
        accepted[:, j] = fits
        taken += np.where(fits, sizes[:, j], 0)
        if (taken >= budget).all():
            break
    chosen = np.empty_like(accepted)
    np.put_along_axis(chosen, order, accepted, axis=1)
    picked = cand[chosen[g_row, slot][group]]
    return row[picked], col[picked]


@lru_cache(maxsize=8)
def _subword_table(vocab: VocabIds) -> np.ndarray:
    """``table[id]`` is True for the ``##`` pieces of the vocab."""
    table = np.zeros(vocab.vocab_size, dtype=bool)
    table[np.fromiter(vocab.subword_ids, dtype=np.int64, count=len(vocab.subword_ids))] = True
    return table
