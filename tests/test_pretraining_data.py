"""bert_core.instances against google-research/bert's create_pretraining_data.py (tests/oracles.py).

Each rule is pinned on the library and on the reference's own loops, and the two are compared
where their draws differ: distributions of lengths, random-next pairs, masked positions and the
80/10/10 split, with fixed seeds (deterministic) and |z| below 4 (sampling error, not bias).

Vocab ids come from the real bert-base-uncased vocab.txt of the sample MiniLM model.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from oracles import (
    Instance,
    create_instances_from_document,
    create_masked_lm_predictions,
    create_packed_instances_from_document,
    truncate_seq_pair,
)

from bert_core.instances.batch import assemble, create_instance_batch
from bert_core.instances.masking import MaskingSpec, mask_instances, splitmix64
from bert_core.instances.pairs import (
    NO_NSP,
    RANDOM_NEXT,
    DocumentPool,
    VocabIds,
    packed_spans,
    pair_spans,
    rng_for,
    trim_counts,
    truncate_spans,
)
from bert_core.instances.stats import InstanceStats

Z = 4.0  # |z| bound: a false alarm about once in 16,000 comparisons, and the seeds are fixed


def sentences(doc: int, n: int, length: int) -> list[list[int]]:
    """Sentences whose ids say where they came from: 10000*doc + 100*sentence + position (+1000)."""
    return [[1000 + 10000 * doc + 100 * s + k for k in range(length)] for s in range(n)]


def z_of_means(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Welch's z of the difference of two means (independent samples)."""
    vx, vy = np.var(xs, ddof=1) / len(xs), np.var(ys, ddof=1) / len(ys)
    return float((np.mean(xs) - np.mean(ys)) / math.sqrt(vx + vy)) if vx + vy else 0.0


def z_of_proportions(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-proportion z (pooled)."""
    p = (k1 + k2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    return (k1 / n1 - k2 / n2) / se if se else 0.0


# --------------------------------------------------------------------------- the two makers


def library_pairs(docs: Sequence, document_index: int, max_seq_length: int, short_seq_prob: float,
                  vocab: VocabIds, rng: random.Random, packed: bool = False) -> list[Instance]:
    """The library's unmasked instances of one document and pass, as oracle Instances."""
    pool = DocumentPool.from_documents(docs)
    make = packed_spans if packed else pair_spans
    spans = make(pool, document_index, max_seq_length, short_seq_prob, rng)
    batch = assemble(pool, np.array(spans, dtype=np.int64), np.zeros(len(spans), np.uint64), vocab)
    return [Instance(ids, len_a, [], [], nsp) for ids, len_a, _, _, nsp in batch.rows()]


def oracle_pairs(docs: Sequence, document_index: int, max_seq_length: int, short_seq_prob: float,
                 vocab: VocabIds, rng: random.Random, packed: bool = False) -> list[Instance]:
    if packed:
        return create_packed_instances_from_document(docs[document_index], max_seq_length, short_seq_prob,
                                                     0.15, 20, vocab, rng, mask=False)
    return create_instances_from_document(docs, document_index, max_seq_length, short_seq_prob, 0.15, 20,
                                          vocab, rng, mask=False)


MAKERS = pytest.mark.parametrize("make", [library_pairs, oracle_pairs], ids=["library", "reference"])
Maker = Callable[..., list[Instance]]


def split_instance(inst: Instance, vocab: VocabIds) -> tuple[list[int], list[int]]:
    ids = inst.input_ids
    assert ids[0] == vocab.cls_id and ids[inst.len_a - 1] == vocab.sep_id and ids[-1] == vocab.sep_id
    return ids[1 : inst.len_a - 1], ids[inst.len_a : -1]


# --------------------------------------------------------------------------- NSP pairs: rules


@MAKERS
def test_unused_sentences_are_put_back(vocab, make: Maker) -> None:
    # One-token sentences: chunks fill the target exactly, so nothing is truncated and every
    # sentence of the document must appear exactly once in an A or an actual-next B segment.
    docs = [sentences(d, 300, 1) for d in range(5)]
    for seed in range(20):
        instances = make(docs, 0, 32, 0.0, vocab, random.Random(seed))
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


@MAKERS
def test_one_sentence_chunk_always_takes_a_random_next(vocab, make: Maker) -> None:
    docs = [sentences(0, 20, 80), sentences(1, 20, 80)]  # each sentence fills the target alone
    instances = make(docs, 0, 64, 0.0, vocab, random.Random(3))
    assert len(instances) == 20
    assert all(i.next_sentence_label == RANDOM_NEXT for i in instances)
    assert all(len(i.input_ids) == 64 for i in instances)  # truncated to max_seq_length


@MAKERS
def test_random_next_is_half_of_multi_sentence_chunks(vocab, make: Maker) -> None:
    # short_seq_prob=0: chunks have ~9 sentences, so only a document's last chunk can be a
    # one-sentence chunk (always random next); every other chunk flips a fair coin.
    docs = [sentences(d, 200, 7) for d in range(5)]
    labels = Counter()
    for seed in range(30):
        for inst in make(docs, seed % 5, 64, 0.0, vocab, rng_for(1, seed)):
            labels[inst.next_sentence_label] += 1
    n = labels[0] + labels[1]
    assert abs(labels[1] / n - 0.5) < Z * math.sqrt(0.25 / n)


@MAKERS
def test_short_seq_prob_draws_one_target_per_document_pass(vocab, make: Maker) -> None:
    docs = [sentences(0, 400, 1), sentences(1, 400, 1)]
    max_seq_length = 40
    last = docs[0][-1][0]

    def targets(short_seq_prob: float) -> list[int]:
        out = []
        for seed in range(400):
            insts = make(docs, 0, max_seq_length, short_seq_prob, vocab, random.Random(seed))
            # actual-next pairs hold exactly `target` one-token sentences (except at the doc's end)
            actual = [len(i.input_ids) - 3 for i in insts
                      if i.next_sentence_label == 0 and i.input_ids[-2] != last]
            assert len(set(actual)) == 1  # one target for the whole pass
            out.append(actual[0])
        return out

    assert set(targets(0.0)) == {max_seq_length - 3}
    t = targets(0.1)
    short = [x for x in t if x < max_seq_length - 3]
    assert abs(len(short) / len(t) - 0.1 * (1 - 1 / 36)) < Z * math.sqrt(0.09 / len(t))
    t = targets(1.0)
    assert min(t) >= 2 and max(t) <= max_seq_length - 3
    assert len(set(t)) > 25  # spread over [2, max_seq_length - 3]


@MAKERS
def test_packing_without_nsp_keeps_whole_sentences_in_order(vocab, make: Maker) -> None:
    doc = [s[: 3 + (i * 7) % 20] for i, s in enumerate(sentences(0, 80, 25))]
    for seed in range(20):
        instances = make([doc], 0, 64, 0.0, vocab, random.Random(seed), packed=True)
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


@MAKERS
def test_packing_trims_an_overlong_sentence(vocab, make: Maker) -> None:
    doc = [list(range(2000, 2100)), list(range(3000, 3010))]
    instances = make([doc], 0, 32, 0.0, vocab, random.Random(0), packed=True)
    assert [len(i.input_ids) for i in instances] == [32, 12]
    body = instances[0].input_ids[1:-1]
    assert body == list(range(body[0], body[0] + 30))  # a contiguous run of the sentence


def test_rng_for_is_stable_and_separates_parts() -> None:
    assert rng_for(1, "wiki:1", 0).random() == rng_for(1, "wiki:1", 0).random()
    draws = {rng_for(1, "wiki:1", d).random() for d in range(10)} | {rng_for(2, "wiki:1", 0).random()}
    assert len(draws) == 11


# --------------------------------------------------------------------------- truncation


def test_trim_counts_are_the_reference_loops_counts() -> None:
    for len_a in range(0, 30):
        for len_b in range(0, 30):
            for max_num_tokens in range(0, 40, 3):
                a, b = list(range(len_a)), list(range(len_b))
                truncate_seq_pair(a, b, max_num_tokens, random.Random(0))
                assert trim_counts(len_a, len_b, max_num_tokens) == (len_a - len(a), len_b - len(b))


def test_truncate_spans_trims_the_longer_side_front_or_back() -> None:
    for seed in range(200):
        assert truncate_spans(0, 10, 100, 104, 8, random.Random(seed))[2:] == (100, 104)  # B untouched
        a0, a1, _, _ = truncate_spans(0, 10, 100, 104, 8, random.Random(seed))
        assert a1 - a0 == 4 and 0 <= a0 <= 6
    assert truncate_spans(0, 3, 10, 13, 5, random.Random(0))[:2] == (0, 3)  # B loses on a tie


def test_front_removals_have_the_reference_distribution() -> None:
    # 40 tokens removed from A: the number taken at the front is Binomial(40, 1/2) in both
    library, reference = [], []
    for seed in range(2000):
        library.append(truncate_spans(0, 100, 1000, 1001, 61, random.Random(seed))[0])
        a = list(range(100))
        truncate_seq_pair(a, [1], 61, random.Random(seed))
        reference.append(a[0])
    for fronts in (library, reference):
        assert abs(np.mean(fronts) - 20) < Z * math.sqrt(10 / len(fronts))
        assert abs(np.var(fronts) - 10) < 1.5  # np(1-p) = 10
    assert abs(z_of_means(library, reference)) < Z


# --------------------------------------------------------------------------- masking


def mask_both(rows: list[list[int]], spec: MaskingSpec, seed: int) -> tuple[list, list]:
    """Each row masked by the library (one key per row) and by the reference (one RNG)."""
    offsets = np.cumsum([0] + [len(r) for r in rows])
    len_a = [r.index(spec.vocab.sep_id) + 1 for r in rows]
    keys = splitmix64(np.arange(len(rows), dtype=np.uint64) + np.uint64(seed << 32))
    m = mask_instances(keys, np.concatenate(rows), offsets, np.array(len_a), spec)
    out, pos, lab, mo = (m.input_ids.tolist(), m.masked_lm_positions.tolist(), m.masked_lm_ids.tolist(),
                         m.mask_offsets.tolist())
    library = [(out[offsets[i]:offsets[i + 1]], pos[mo[i]:mo[i + 1]], lab[mo[i]:mo[i + 1]])
               for i in range(len(rows))]
    rng = random.Random(seed)
    reference = [create_masked_lm_predictions(r, spec.masked_lm_prob, spec.max_predictions_per_seq,
                                              spec.vocab, rng, spec.whole_word_mask) for r in rows]
    return library, reference


@pytest.mark.parametrize(
    ("length", "prob", "cap", "expected"),
    [(3, 0.15, 20, 1), (7, 0.15, 20, 1), (10, 0.15, 20, 2), (30, 0.15, 20, 4), (40, 0.15, 20, 6),
     (200, 0.15, 20, 20), (128, 0.15, 20, 19), (512, 0.15, 80, 77)],
)
def test_budget_is_min_cap_max_1_round_len_times_prob(vocab, length, prob, cap, expected) -> None:
    # round() is Python 3's: 4.5 -> 4 (banker's), as the reference gives under Python 3.
    ids = [vocab.cls_id, *range(5000, 5000 + length - 2), vocab.sep_id]
    for side in mask_both([ids] * 5, MaskingSpec(prob, cap, vocab), seed=length):
        assert [len(p) for _, p, _ in side] == [expected] * 5
    assert expected == min(cap, max(1, int(round(length * prob))))


def test_masking_never_touches_specials_and_sorts_positions(vocab) -> None:
    ids = [vocab.cls_id, *range(5000, 5030), vocab.sep_id, *range(6000, 6020), vocab.sep_id]
    for side in mask_both([ids] * 50, MaskingSpec(0.15, 20, vocab), seed=1):
        for out, positions, labels in side:
            assert positions == sorted(set(positions))
            assert 0 not in positions and 31 not in positions and len(ids) - 1 not in positions
            assert labels == [ids[p] for p in positions] and len(out) == len(ids)
            assert all(out[i] == ids[i] for i in range(len(ids)) if i not in positions)


def corruption(side: list, vocab: VocabIds) -> Counter:
    counts = Counter()
    for out, positions, labels in side:
        for p, label in zip(positions, labels, strict=True):
            counts["mask" if out[p] == vocab.mask_id else "kept" if out[p] == label else "random"] += 1
    return counts


def test_80_10_10_split_is_the_references(vocab) -> None:
    ids = [vocab.cls_id, *range(5000, 5125), vocab.sep_id]
    library, reference = mask_both([ids] * 1500, MaskingSpec(0.15, 20, vocab), seed=7)
    ours, theirs = corruption(library, vocab), corruption(reference, vocab)
    n = sum(ours.values())
    assert n == sum(theirs.values()) == 1500 * 19
    for kind, p in (("mask", 0.8), ("kept", 0.1), ("random", 0.1)):
        assert abs(ours[kind] - n * p) < Z * math.sqrt(n * p * (1 - p)), (kind, ours[kind], n * p)
        assert abs(z_of_proportions(ours[kind], n, theirs[kind], n)) < Z, kind
    # random replacements come from the whole vocab, not from the sentence
    random_ids = [out[p] for out, positions, labels in library for p, t in zip(positions, labels, strict=True)
                  if out[p] not in (vocab.mask_id, t)]
    assert min(random_ids) < 5000 and max(random_ids) >= 5125 and max(random_ids) < vocab.vocab_size
    assert len(set(random_ids)) > 0.8 * len(random_ids)


def test_every_candidate_is_equally_likely_to_be_masked(vocab) -> None:
    ids = [vocab.cls_id, *range(5000, 5060), vocab.sep_id, *range(6000, 6030), vocab.sep_id]
    draws = 6000
    p = 14 / 90  # round(92 * 0.15) of 90 candidates
    sigma = math.sqrt(draws * p * (1 - p))
    for side in mask_both([ids] * draws, MaskingSpec(0.15, 20, vocab), seed=11):
        hits = Counter(pos for _, positions, _ in side for pos in positions)
        assert set(hits) == set(range(1, 61)) | set(range(62, 92))
        assert all(abs(c - draws * p) < 4.5 * sigma for c in hits.values()), sorted(hits.values())[:3]


def word_piece_row(vocab: VocabIds, vocab_tokens: list[str]) -> tuple[list[int], list[list[int]]]:
    """A row of real words, every other one in three pieces, and its groups of positions."""
    pieces = [t for t in vocab_tokens if t.startswith("##") and t[2:].isalpha()][:200]
    words = [t for t in vocab_tokens if t.isalpha() and len(t) > 3][1000:1200]
    tokens: list[str] = []
    for k in range(30):
        tokens += [words[k], pieces[2 * k], pieces[2 * k + 1]] if k % 2 else [words[k]]
    index = {t: i for i, t in enumerate(vocab_tokens)}
    ids = [vocab.cls_id, *(index[t] for t in tokens), vocab.sep_id]
    groups: list[list[int]] = []
    for pos, t in enumerate(ids[1:-1], start=1):
        (groups[-1].append(pos) if t in vocab.subword_ids else groups.append([pos]))
    return ids, groups


def test_whole_word_mask_matches_the_reference(vocab, vocab_tokens) -> None:
    ids, groups = word_piece_row(vocab, vocab_tokens)
    budget = min(20, max(1, round(len(ids) * 0.15)))
    draws = 3000
    sides = mask_both([ids] * draws, MaskingSpec(0.15, 20, vocab, whole_word_mask=True), seed=5)
    counts, word_hits = [], []
    for side in sides:
        for _, positions, _ in side:
            chosen = set(positions)
            assert 0 < len(chosen) <= budget
            assert all(chosen.isdisjoint(g) or chosen.issuperset(g) for g in groups)
        counts.append([len(p) for _, p, _ in side])
        word_hits.append(sum(1 for _, p, _ in side if 1 in p))  # the first word (one piece)
    # a word that would overshoot is skipped: how often the budget is not filled, and which
    # words get chosen, is the same in both
    assert abs(z_of_means(*counts)) < Z
    assert abs(z_of_proportions(word_hits[0], draws, word_hits[1], draws)) < Z
    # without whole-word masking, words are split
    library, _ = mask_both([ids] * 100, MaskingSpec(0.15, 20, vocab), seed=5)
    assert sum(any(0 < len(set(p) & set(g)) < len(g) for g in groups) for _, p, _ in library) > 50


# --------------------------------------------------------------------------- whole instances


def test_instances_are_distributed_like_the_references(vocab) -> None:
    """Every document x pass of a corpus made by both; the pass is the independent unit (its
    target length and its pairs hang together), so per-pass sums are compared by Welch's z."""
    rng = random.Random(0)
    docs = [[[2000 + rng.randrange(20000) for _ in range(rng.randint(3, 30))]
             for _ in range(rng.randint(2, 40))] for _ in range(40)]
    doc_ids = [f"doc{d}" for d in range(len(docs))]
    L, P, passes = 64, 10, 10
    batch = create_instance_batch(DocumentPool.from_documents(docs), doc_ids, seed=1, dupe_factor=passes,
                                  max_seq_length=L, max_predictions_per_seq=P, masked_lm_prob=0.15,
                                  short_seq_prob=0.1, vocab=vocab)

    def per_pass(rows: list[tuple[list[int], int, list[int], list[int], int]]) -> dict[str, float]:
        stats, a_tokens = InstanceStats(L), 0
        for ids, len_a, positions, labels, nsp in rows:
            stats.add(ids, positions, labels, nsp, vocab.mask_id)
            a_tokens += len_a
        return {"instances": stats.instances, "tokens": stats.tokens, "random_next": stats.random_next,
                "masked": stats.masked, "masked_as_mask": stats.masked_as_mask, "a_tokens": a_tokens}

    rows, pool = batch.rows(), DocumentPool.from_documents(docs)
    ours, theirs, start = [], [], 0  # the batch is in document/pass order
    for d in range(len(docs)):
        for dupe in range(passes):
            made = create_instances_from_document(docs, d, L, 0.1, 0.15, P, vocab, rng_for(2, d, dupe))
            theirs.append(per_pass([(i.input_ids, i.len_a, i.masked_lm_positions, i.masked_lm_ids,
                                     i.next_sentence_label) for i in made]))
            n = len(pair_spans(pool, d, L, 0.1, rng_for(1, doc_ids[d], dupe, L)))
            ours.append(per_pass(rows[start:start + n]))
            start += n
    assert start == len(rows)
    for key in ours[0]:
        z = z_of_means([p[key] for p in ours], [p[key] for p in theirs])
        assert abs(z) < Z, (key, z)
    # and the headline fractions agree closely
    total = {k: sum(p[k] for p in ours) for k in ours[0]}
    ref = {k: sum(p[k] for p in theirs) for k in theirs[0]}
    assert abs(total["random_next"] / total["instances"] - ref["random_next"] / ref["instances"]) < 0.03
    assert abs(total["tokens"] / total["instances"] - ref["tokens"] / ref["instances"]) < 2.0
    assert abs(total["masked"] / total["tokens"] - ref["masked"] / ref["tokens"]) < 0.005


def test_document_pool_from_marked_bytes_drops_empty_sentences() -> None:
    from array import array

    def marked(document: list[list[int]]) -> bytes:
        return array("i", [t for sentence in document for t in [*sentence, -1]]).tobytes()

    docs = [[[5, 6], [], [7]], [[], [8, 9, 10]], [[11]]]
    pool = DocumentPool.from_marked([marked(d) for d in docs])
    want = DocumentPool.from_documents([[s for s in d if s] for d in docs])
    assert list(pool.tokens) == want.tokens == [5, 6, 7, 8, 9, 10, 11]
    assert pool.sentence_offsets == want.sentence_offsets and pool.doc_first == want.doc_first == [0, 2, 3, 4]
