"""Each rule of google-research/bert's create_pretraining_data.py, pinned on bert_core.instances.pairs.

Vocab ids come from the real bert-base-uncased vocab.txt of the sample MiniLM model.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from bert_core.instances.pairs import (
    NO_NSP,
    RANDOM_NEXT,
    DocumentPool,
    create_instances_from_document,
    create_masked_lm_predictions,
    create_packed_instances_from_document,
    rng_for,
    trim_counts,
    truncate_seq_pair,
)
from bert_core.instances.stats import InstanceStats


def sentences(doc: int, n: int, length: int) -> list[list[int]]:
    """Sentences whose ids say where they came from: 10000*doc + 100*sentence + position (+1000)."""
    return [[1000 + 10000 * doc + 100 * s + k for k in range(length)] for s in range(n)]


# --------------------------------------------------------------------------- truncation


def test_truncate_seq_pair_trims_the_longer_side_front_or_back() -> None:
    fronts = backs = 0
    for seed in range(200):
        a, b = list(range(10)), list(range(100, 104))
        truncate_seq_pair(a, b, 8, random.Random(seed))
        assert (len(a), b) == (4, [100, 101, 102, 103])  # only the longer side shrinks
        assert a == list(range(a[0], a[0] + 4))  # what is left is a contiguous run
        fronts += 10 - 4 - (9 - a[-1])  # tokens removed at the front
        backs += 9 - a[-1]
    total = 200 * 6
    assert abs(fronts / total - 0.5) < 0.05 and abs(backs / total - 0.5) < 0.05


def test_truncate_seq_pair_trims_b_on_a_tie_and_alternates() -> None:
    a, b = [1, 2, 3], [4, 5, 6]
    truncate_seq_pair(a, b, 5, random.Random(0))
    assert a == [1, 2, 3] and len(b) == 2
    a, b = list(range(6)), list(range(10, 16))
    truncate_seq_pair(a, b, 4, random.Random(1))
    assert len(a) == 2 and len(b) == 2  # trimming follows whichever side is longer now


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize(
    ("length", "prob", "cap", "expected"),
    [(3, 0.15, 20, 1), (7, 0.15, 20, 1), (10, 0.15, 20, 2), (30, 0.15, 20, 4), (40, 0.15, 20, 6),
     (200, 0.15, 20, 20), (128, 0.15, 20, 19), (512, 0.15, 80, 77)],
)
def test_budget_is_min_cap_max_1_round_len_times_prob(vocab, length, prob, cap, expected) -> None:
    # round() is Python 3's: 4.5 -> 4 (banker's), as the reference gives under Python 3.
    ids = [vocab.cls_id, *range(2000, 2000 + length - 2), vocab.sep_id]
    for seed in range(5):
        _, positions, _ = create_masked_lm_predictions(ids, prob, cap, vocab, random.Random(seed))
        assert len(positions) == expected == min(cap, max(1, int(round(length * prob))))


def test_masking_never_touches_specials_and_sorts_positions(vocab) -> None:
    a, b = list(range(2000, 2030)), list(range(3000, 3020))
    ids = [vocab.cls_id, *a, vocab.sep_id, *b, vocab.sep_id]
    for seed in range(50):
        out, positions, labels = create_masked_lm_predictions(ids, 0.15, 20, vocab, random.Random(seed))
        assert positions == sorted(set(positions))
        assert 0 not in positions and 31 not in positions and len(ids) - 1 not in positions
        assert labels == [ids[p] for p in positions]
        assert len(out) == len(ids)
        unmasked = [i for i in range(len(ids)) if i not in positions]
        assert all(out[i] == ids[i] for i in unmasked)


def test_80_10_10_split_over_many_draws(vocab) -> None:
    ids = [vocab.cls_id, *range(5000, 5125), vocab.sep_id]
    stats = InstanceStats(max_seq_length=128)
    random_ids: list[int] = []
    rng = random.Random(7)
    for _ in range(1500):
        out, positions, labels = create_masked_lm_predictions(ids, 0.15, 20, vocab, rng)
        stats.add(out, positions, labels, 0, vocab.mask_id)
        random_ids += [out[p] for p, t in zip(positions, labels, strict=True) if out[p] not in (vocab.mask_id, t)]
    n = stats.masked
    assert n == 1500 * 19
    for observed, p in [(stats.masked_as_mask, 0.8), (stats.masked_kept, 0.1), (stats.masked_random, 0.1)]:
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(observed - n * p) < 4 * sigma, (observed, n * p)
    # random replacements come from the whole vocab, not from the sentence
    assert min(random_ids) < 5000 and max(random_ids) >= 5125
    assert max(random_ids) < vocab.vocab_size
    assert len(set(random_ids)) > 0.8 * len(random_ids)


def test_every_candidate_is_equally_likely_to_be_masked(vocab) -> None:
    # the lazy shuffle must give each candidate the same chance, as a full shuffle does
    ids = [vocab.cls_id, *range(5000, 5060), vocab.sep_id, *range(6000, 6030), vocab.sep_id]
    budget = round(len(ids) * 0.15)  # 14 of 90 candidates
    hits = Counter()
    rng = random.Random(11)
    draws = 6000
    for _ in range(draws):
        hits.update(create_masked_lm_predictions(ids, 0.15, 20, vocab, rng)[1])
    p = budget / 90
    sigma = math.sqrt(draws * p * (1 - p))
    assert set(hits) == set(range(1, 61)) | set(range(62, 92))
    assert all(abs(c - draws * p) < 4.5 * sigma for c in hits.values()), sorted(hits.values())[:3]


def test_whole_word_mask_masks_whole_groups_within_budget(vocab, vocab_tokens) -> None:
    # real word pieces: "un ##believ ##able" style groups interleaved with whole words
    pieces = [t for t in vocab_tokens if t.startswith("##") and t[2:].isalpha()][:200]
    words = [t for t in vocab_tokens if t.isalpha() and len(t) > 3][1000:1200]
    tokens: list[str] = []
    for k in range(30):
        tokens += [words[k], pieces[2 * k], pieces[2 * k + 1]] if k % 2 else [words[k]]
    index = {t: i for i, t in enumerate(vocab_tokens)}
    ids = [vocab.cls_id, *(index[t] for t in tokens), vocab.sep_id]
    groups: list[list[int]] = []
    for pos, t in enumerate(ids[1:-1], start=1):
        if t in vocab.subword_ids:
            groups[-1].append(pos)
        else:
            groups.append([pos])
    budget = min(20, max(1, round(len(ids) * 0.15)))
    partial_without_wwm = 0
    for seed in range(100):
        _, positions, _ = create_masked_lm_predictions(ids, 0.15, 20, vocab, random.Random(seed), True)
        chosen = set(positions)
        assert 0 < len(chosen) <= budget
        for g in groups:  # every group is masked entirely or not at all
            assert chosen.isdisjoint(g) or chosen.issuperset(g)
        _, positions, _ = create_masked_lm_predictions(ids, 0.15, 20, vocab, random.Random(seed), False)
        chosen = set(positions)
        partial_without_wwm += any(0 < len(chosen & set(g)) < len(g) for g in groups)
    assert partial_without_wwm > 50  # without whole-word masking, words are split


# --------------------------------------------------------------------------- NSP pairs


def split_instance(inst, vocab) -> tuple[list[int], list[int]]:
    ids = inst.input_ids
    assert ids[0] == vocab.cls_id and ids[inst.len_a - 1] == vocab.sep_id and ids[-1] == vocab.sep_id
    return ids[1 : inst.len_a - 1], ids[inst.len_a : -1]


def test_unused_sentences_are_put_back(vocab) -> None:
    # One-token sentences: chunks fill the target exactly, so nothing is truncated and every
    # sentence of the document must appear exactly once in an A or an actual-next B segment.
    docs = [sentences(d, 300, 1) for d in range(5)]
    for seed in range(20):
        instances = create_instances_from_document(
            docs, 0, 32, 0.0, 0.15, 5, vocab, random.Random(seed), mask=False
        )
        used: list[int] = []
        for inst in instances:
            a, b = split_instance(inst, vocab)
            used += a
            if inst.next_sentence_label == RANDOM_NEXT:
                assert all(t >= 11000 for t in b)  # from the other document
                assert b == list(range(b[0], b[0] + 100 * len(b), 100))  # consecutive sentences
            else:
                used += b
                assert a[-1] + 100 == b[0]  # B really follows A
        assert sorted(used) == [s[0] for s in docs[0]], f"seed {seed}"
        labels = Counter(i.next_sentence_label for i in instances)
        assert labels[0] > 0 and labels[1] > 0


def test_one_sentence_chunk_always_takes_a_random_next(vocab) -> None:
    docs = [sentences(0, 20, 80), sentences(1, 20, 80)]  # each sentence fills the target alone
    instances = create_instances_from_document(docs, 0, 64, 0.0, 0.15, 10, vocab, random.Random(3))
    assert len(instances) == 20
    assert all(i.next_sentence_label == RANDOM_NEXT for i in instances)
    assert all(len(i.input_ids) == 64 for i in instances)  # truncated to max_seq_length


def test_random_next_is_half_of_multi_sentence_chunks(vocab) -> None:
    # short_seq_prob=0: chunks have ~9 sentences, so only a document's last chunk can be a
    # one-sentence chunk (always random next); every other chunk flips a fair coin.
    docs = [sentences(d, 200, 7) for d in range(5)]
    labels = Counter()
    for seed in range(30):
        for inst in create_instances_from_document(docs, seed % 5, 64, 0.0, 0.15, 10, vocab,
                                                   rng_for(1, seed), mask=False):
            labels[inst.next_sentence_label] += 1
    n = labels[0] + labels[1]
    assert abs(labels[1] / n - 0.5) < 4 * math.sqrt(0.25 / n)


def test_short_seq_prob_draws_one_target_per_document_pass(vocab) -> None:
    docs = [sentences(0, 400, 1), sentences(1, 400, 1)]
    max_seq_length = 40
    last = docs[0][-1][0]

    def targets(short_seq_prob: float) -> list[int]:
        out = []
        for seed in range(400):
            insts = create_instances_from_document(docs, 0, max_seq_length, short_seq_prob, 0.15, 5,
                                                   vocab, random.Random(seed), mask=False)
            # actual-next pairs hold exactly `target` one-token sentences (except at the doc's end)
            actual = [len(i.input_ids) - 3 for i in insts
                      if i.next_sentence_label == 0 and i.input_ids[-2] != last]
            assert len(set(actual)) == 1  # one target for the whole pass
            out.append(actual[0])
        return out

    assert set(targets(0.0)) == {max_seq_length - 3}
    t = targets(0.1)
    short = [x for x in t if x < max_seq_length - 3]
    assert abs(len(short) / len(t) - 0.1 * (1 - 1 / 36)) < 4 * math.sqrt(0.09 / len(t))
    t = targets(1.0)
    assert min(t) >= 2 and max(t) <= max_seq_length - 3
    assert len(set(t)) > 25  # spread over [2, max_seq_length - 3]


def test_instances_respect_max_seq_length_and_mask(vocab) -> None:
    docs = [sentences(d, 50, 13) for d in range(4)]
    for seed in range(20):
        for inst in create_instances_from_document(docs, 1, 64, 0.1, 0.15, 9, vocab, rng_for(5, seed)):
            assert len(inst.input_ids) <= 64
            assert 1 <= len(inst.masked_lm_positions) <= 9
            assert inst.next_sentence_label in (0, 1)


def test_rng_for_is_stable_and_separates_parts() -> None:
    assert rng_for(1, "wiki:1", 0).random() == rng_for(1, "wiki:1", 0).random()
    draws = {rng_for(1, "wiki:1", d).random() for d in range(10)} | {rng_for(2, "wiki:1", 0).random()}
    assert len(draws) == 11


# --------------------------------------------------------------------------- no NSP: packing


def test_packing_without_nsp_keeps_whole_sentences_in_order(vocab) -> None:
    doc = [s[: 3 + (i * 7) % 20] for i, s in enumerate(sentences(0, 80, 25))]
    for seed in range(20):
        instances = create_packed_instances_from_document(doc, 64, 0.0, 0.15, 10, vocab,
                                                          random.Random(seed), mask=False)
        flat: list[int] = []
        for k, inst in enumerate(instances):
            assert inst.len_a == len(inst.input_ids) <= 64
            assert inst.next_sentence_label == NO_NSP and inst.masked_lm_positions == []
            body = inst.input_ids[1:-1]
            assert body[0] % 100 == 0  # starts at a sentence start
            if k < len(instances) - 1:  # packed as full as it goes: the next sentence did not fit
                next_sentence = next(s for s in doc if s[0] == instances[k + 1].input_ids[1])
                assert len(body) + len(next_sentence) > 62
            flat += body
        assert flat == [t for s in doc for t in s]


def test_packing_trims_an_overlong_sentence_and_masks(vocab) -> None:
    doc = [list(range(2000, 2100)), list(range(3000, 3010))]
    instances = create_packed_instances_from_document(doc, 32, 0.0, 0.15, 5, vocab, random.Random(0))
    assert [len(i.input_ids) for i in instances] == [32, 12]
    assert all(1 <= len(i.masked_lm_positions) <= 5 for i in instances)


def test_trim_counts_are_the_reference_loops_counts() -> None:
    def loop(len_a: int, len_b: int, max_num_tokens: int) -> tuple[int, int]:
        removed = [0, 0]
        while len_a + len_b > max_num_tokens:  # the reference: the longer side, B on a tie
            if len_a > len_b:
                len_a, removed[0] = len_a - 1, removed[0] + 1
            else:
                len_b, removed[1] = len_b - 1, removed[1] + 1
        return removed[0], removed[1]

    for len_a in range(0, 30):
        for len_b in range(0, 30):
            for max_num_tokens in range(0, 40, 3):
                assert trim_counts(len_a, len_b, max_num_tokens) == loop(len_a, len_b, max_num_tokens)


def test_front_removals_are_binomial_half() -> None:
    # 40 tokens removed from A: the number taken at the front is Binomial(40, 1/2)
    fronts = []
    for seed in range(2000):
        a = list(range(100))
        truncate_seq_pair(a, [1], 61, random.Random(seed))
        fronts.append(a[0])
        assert len(a) == 60 and a == list(range(a[0], a[0] + 60))
    mean = sum(fronts) / len(fronts)
    var = sum((f - mean) ** 2 for f in fronts) / len(fronts)
    assert abs(mean - 20) < 4 * math.sqrt(10 / 2000)
    assert abs(var - 10) < 1.5  # np(1-p) = 10


def test_document_pool_from_marked_bytes_drops_empty_sentences() -> None:
    from array import array

    def marked(document: list[list[int]]) -> bytes:
        return array("i", [t for sentence in document for t in [*sentence, -1]]).tobytes()

    docs = [[[5, 6], [], [7]], [[], [8, 9, 10]], [[11]]]
    pool = DocumentPool.from_marked([marked(d) for d in docs])
    want = DocumentPool.from_documents([[s for s in d if s] for d in docs])
    assert list(pool.tokens) == want.tokens == [5, 6, 7, 8, 9, 10, 11]
    assert pool.sentence_offsets == want.sentence_offsets and pool.doc_first == want.doc_first == [0, 2, 3, 4]
