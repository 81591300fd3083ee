"""bert_core/instances/batch.py and masking.py: instances assembled, masked and sharded by the batch.

The rules are compared with google-research/bert's own loops in tests/test_pretraining_data.py.

Vocab ids come from the real bert-base-uncased vocab.txt of the sample MiniLM model.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest

from bert_core.instances.batch import (
    InstanceBatch,
    assemble,
    create_instance_batch,
    mask_batch,
    write_instance_shards,
)
from bert_core.instances.masking import MaskingSpec, splitmix64
from bert_core.instances.pairs import (
    NO_NSP,
    DocumentPool,
    Span,
    VocabIds,
    packed_spans,
    pair_spans,
    rng_for,
)
from bert_core.instances.stats import InstanceStats


def sentences(doc: int, n: int, length: int) -> list[list[int]]:
    return [[1000 + 10000 * doc + 100 * s + k for k in range(length)] for s in range(n)]


def rows_of(ids_list: list[list[int]], vocab: VocabIds, seed: int = 0) -> InstanceBatch:
    """An unmasked batch holding exactly these rows (one span per row, A only)."""
    pool = DocumentPool.from_documents([[ids[1:-1]] for ids in ids_list])
    spans = [(pool.sentence_offsets[d], pool.sentence_offsets[d + 1], 0, 0, NO_NSP) for d in range(len(ids_list))]
    keys = splitmix64(np.arange(len(ids_list), dtype=np.uint64) + np.uint64(seed * 1_000_003))
    return assemble(pool, np.array(spans), keys, vocab)


def span_instance(pool: DocumentPool, span: Span, vocab: VocabIds) -> tuple[list[int], int]:
    """``[CLS] A [SEP] (B [SEP])`` of one span, written out: ``(input_ids, len_a)``."""
    a0, a1, b0, b1, label = span
    tokens = list(pool.tokens)
    input_ids = [vocab.cls_id, *tokens[a0:a1], vocab.sep_id]
    if label == NO_NSP:
        return input_ids, len(input_ids)
    return input_ids + [*tokens[b0:b1], vocab.sep_id], len(input_ids)


def spec(vocab: VocabIds, prob: float = 0.15, cap: int = 20, whole_word_mask: bool = False) -> MaskingSpec:
    return MaskingSpec(prob, cap, vocab, whole_word_mask)


def test_batch_holds_the_pairs_of_every_document_and_pass(vocab) -> None:
    docs = [sentences(d, 30 + 7 * d, 5 + d) for d in range(6)]
    pool = DocumentPool.from_documents(docs)
    ids = [f"doc{d}" for d in range(len(docs))]
    for nsp, make, dupes in ((True, pair_spans, 2), (False, packed_spans, 1)):
        batch = create_instance_batch(pool, ids, seed=3, dupe_factor=dupes, max_seq_length=48,
                                      max_predictions_per_seq=7, masked_lm_prob=0.15, short_seq_prob=0.2,
                                      vocab=vocab, next_sentence_prediction=nsp, mask=False)
        spans = [s for d, doc_id in enumerate(ids) for dupe in range(dupes)
                 for s in make(pool, d, 48, 0.2, rng_for(3, doc_id, dupe, 48))]
        assert [(r[0], r[1], r[4]) for r in batch.rows()] == [(*span_instance(pool, s, vocab), s[4])
                                                             for s in spans]
        assert all(r[2] == [] == r[3] for r in batch.rows())
        assert len(set(batch.keys.tolist())) == len(batch)


def test_assemble_is_cls_a_sep_b_sep(vocab) -> None:
    docs = [sentences(d, 20, 9) for d in range(3)]
    pool = DocumentPool.from_documents(docs)
    spans = [s for d in range(3) for s in pair_spans(pool, d, 40, 0.0, rng_for(1, d))]
    batch = assemble(pool, np.array(spans), np.arange(len(spans), dtype=np.uint64), vocab)
    assert [(r[0], r[1]) for r in batch.rows()] == [span_instance(pool, s, vocab) for s in spans]


@pytest.mark.parametrize(
    ("length", "prob", "cap", "expected"),
    [(3, 0.15, 20, 1), (7, 0.15, 20, 1), (10, 0.15, 20, 2), (30, 0.15, 20, 4), (40, 0.15, 20, 6),
     (200, 0.15, 20, 20), (128, 0.15, 20, 19), (512, 0.15, 80, 77)],
)
def test_budget_is_min_cap_max_1_round_len_times_prob(vocab, length, prob, cap, expected) -> None:
    ids = [vocab.cls_id, *range(2000, 2000 + length - 2), vocab.sep_id]
    batch = mask_batch(rows_of([ids] * 5, vocab), spec(vocab, prob, cap))
    assert np.diff(batch.mask_offsets).tolist() == [expected] * 5
    assert expected == min(cap, max(1, int(round(length * prob))))


def test_masking_never_touches_specials_sorts_positions_and_keeps_labels(vocab) -> None:
    a, b = list(range(2000, 2030)), list(range(3000, 3020))
    ids = [vocab.cls_id, *a, vocab.sep_id, *b, vocab.sep_id]
    batch = mask_batch(rows_of([ids] * 300, vocab), spec(vocab))
    for out, _, positions, labels, _ in batch.rows():
        assert positions == sorted(set(positions)) and len(positions) == 8
        assert 0 not in positions and 31 not in positions and len(ids) - 1 not in positions
        assert labels == [ids[p] for p in positions]
        assert all(out[i] == ids[i] for i in range(len(ids)) if i not in positions)


def test_80_10_10_split_over_many_draws(vocab) -> None:
    ids = [vocab.cls_id, *range(5000, 5125), vocab.sep_id]
    batch = mask_batch(rows_of([ids] * 1500, vocab, seed=7), spec(vocab))
    stats = InstanceStats(max_seq_length=128)
    random_ids: list[int] = []
    for out, _, positions, labels, _ in batch.rows():
        stats.add(out, positions, labels, 0, vocab.mask_id)
        random_ids += [out[p] for p, t in zip(positions, labels, strict=True) if out[p] not in (vocab.mask_id, t)]
    n = stats.masked
    assert n == 1500 * 19
    for observed, p in [(stats.masked_as_mask, 0.8), (stats.masked_kept, 0.1), (stats.masked_random, 0.1)]:
        assert abs(observed - n * p) < 4 * math.sqrt(n * p * (1 - p)), (observed, n * p)
    assert min(random_ids) < 5000 and max(random_ids) >= 5125  # the whole vocab, not the sentence
    assert max(random_ids) < vocab.vocab_size and len(set(random_ids)) > 0.8 * len(random_ids)


def test_every_candidate_is_equally_likely_to_be_masked(vocab) -> None:
    ids = [vocab.cls_id, *range(5000, 5060), vocab.sep_id, *range(6000, 6030), vocab.sep_id]
    draws = 6000
    batch = mask_batch(rows_of([ids] * draws, vocab, seed=11), spec(vocab))
    hits = Counter(batch.masked_lm_positions.tolist())
    p = 14 / 90  # round(92 * 0.15) of 90 candidates
    sigma = math.sqrt(draws * p * (1 - p))
    assert set(hits) == set(range(1, 61)) | set(range(62, 92))
    assert all(abs(c - draws * p) < 4.5 * sigma for c in hits.values()), sorted(hits.values())[:3]


@pytest.mark.parametrize("whole_word_mask", [False, True])
def test_masks_depend_on_the_row_not_on_the_batching(vocab, whole_word_mask) -> None:
    # ids 2000.. of the vocab mix words and ## pieces, so whole words have several pieces
    ids = [[vocab.cls_id, *range(2000, 2000 + n), vocab.sep_id] for n in range(5, 120)]
    masking = spec(vocab, whole_word_mask=whole_word_mask)
    whole = mask_batch(rows_of(ids, vocab), masking)
    halves = InstanceBatch.concat([mask_batch(rows_of(ids, vocab).take(np.arange(0, 50)), masking),
                                   mask_batch(rows_of(ids, vocab).take(np.arange(50, len(ids))), masking)])
    assert whole.rows() == halves.rows()
    reordered = mask_batch(rows_of(ids, vocab).take(np.arange(len(ids))[::-1]), masking)
    assert reordered.rows()[::-1] == whole.rows()


def test_a_row_masked_alone_gets_the_masks_it_gets_in_any_batch(vocab) -> None:
    # budgets close to the candidate counts, so the draws often repeat: the rows that run out of
    # draws must not depend on how many draws the longest row of their batch needed
    ids = [[vocab.cls_id, *range(3000, 3000 + n), vocab.sep_id] for n in range(20, 140)]
    masking = spec(vocab, prob=0.3, cap=40)
    whole = mask_batch(rows_of(ids, vocab), masking).rows()
    alone = [mask_batch(rows_of(ids, vocab).take(np.array([i])), masking).rows()[0] for i in range(len(ids))]
    assert alone == whole


def test_whole_word_mask_masks_whole_groups(vocab, vocab_tokens) -> None:
    pieces = [t for t in vocab_tokens if t.startswith("##") and t[2:].isalpha()][:200]
    words = [t for t in vocab_tokens if t.isalpha() and len(t) > 3][1000:1200]
    index = {t: i for i, t in enumerate(vocab_tokens)}
    tokens: list[str] = []
    for k in range(30):
        tokens += [words[k], pieces[2 * k], pieces[2 * k + 1]] if k % 2 else [words[k]]
    doc = [[index[t] for t in tokens]]
    batch = create_instance_batch(DocumentPool.from_documents([doc]), ["d"], seed=1, dupe_factor=50,
                                  max_seq_length=128, max_predictions_per_seq=20, masked_lm_prob=0.15,
                                  short_seq_prob=0.0, vocab=vocab, next_sentence_prediction=False,
                                  whole_word_mask=True)
    groups: list[list[int]] = []
    for pos, t in enumerate(doc[0], start=1):
        (groups[-1].append(pos) if t in vocab.subword_ids else groups.append([pos]))
    for _, _, positions, _, _ in batch.rows():
        chosen = set(positions)
        assert 0 < len(chosen) <= 19
        assert all(chosen.isdisjoint(g) or chosen.issuperset(g) for g in groups)


def test_stats_columns_equal_stats_rows_and_shards_balance(vocab, tmp_path) -> None:
    docs = [sentences(d, 40, 6 + d % 5) for d in range(12)]
    batch = create_instance_batch(DocumentPool.from_documents(docs), [f"d{i}" for i in range(12)], seed=5,
                                  dupe_factor=3, max_seq_length=64, max_predictions_per_seq=10,
                                  masked_lm_prob=0.15, short_seq_prob=0.1, vocab=vocab)
    by_rows, by_columns = InstanceStats(64), InstanceStats(64)
    for ids, len_a, positions, labels, nsp in batch.rows():
        by_rows.add(ids, positions, labels, nsp, vocab.mask_id, n_special=2 if len_a == len(ids) else 3)
    by_columns.add_columns(batch.input_ids, batch.offsets, batch.len_a, batch.masked_lm_positions,
                           batch.masked_lm_ids, batch.mask_offsets, batch.next_sentence_label, vocab.mask_id)
    assert by_rows.to_dict() == by_columns.to_dict()

    entries = write_instance_shards(batch, str(tmp_path), num_shards=4)
    counts = [e["count"] for e in entries]
    assert max(counts) - min(counts) <= 1 and sum(counts) == len(batch)
    rows = [r for e in entries for r in pq.read_table(tmp_path / e["path"].rsplit("/", 1)[-1]).to_pylist()]
    want = batch.sorted_by_key().rows()
    assert [(r["input_ids"], r["len_a"], r["masked_lm_positions"], r["masked_lm_ids"], r["next_sentence_label"])
            for r in rows] == want


def test_special_ids_inside_a_segment_are_never_candidates(vocab) -> None:
    # Text never tokenizes to [SEP]/[CLS], but hand-made documents may hold their ids: those
    # rows take the by-id path (the reference's rule), the others the fast one, in one batch.
    plain = [vocab.cls_id, *range(2000, 2040), vocab.sep_id]
    odd = [vocab.cls_id, *range(2000, 2010), vocab.sep_id, vocab.cls_id, *range(2010, 2030), vocab.sep_id]
    ids = [plain, odd] * 200
    batch = mask_batch(rows_of(ids, vocab), spec(vocab))
    hits = Counter()
    for (_, _, positions, labels, _), row in zip(batch.rows(), ids, strict=True):
        assert positions == sorted(set(positions)) and labels == [row[p] for p in positions]
        assert len(positions) == min(20, max(1, round(len(row) * 0.15)))
        assert all(row[p] not in (vocab.cls_id, vocab.sep_id) for p in positions)
        if row is odd:
            hits.update(positions)
    assert 11 not in hits and 12 not in hits and len(hits) == 30  # every other token gets picked
    alone = mask_batch(rows_of([odd], vocab, seed=0).take(np.array([0])), spec(vocab))
    assert alone.rows()[0] == mask_batch(rows_of([odd, plain], vocab), spec(vocab)).rows()[0]
