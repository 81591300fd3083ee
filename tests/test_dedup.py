"""bert_core/corpus/dedup.py: normalized exact hashes, MinHash similarity, LSH banding."""

from __future__ import annotations

import random

import numpy as np

from bert_core.corpus.dedup import (
    MinHasher,
    choose_bands,
    content_hash,
    near_duplicates_in_bucket,
    normalize,
)


def _text(rng: random.Random, words: int) -> str:
    vocab = [f"w{i}" for i in range(5000)]
    return " ".join(rng.choice(vocab) for _ in range(words))


def test_exact_hash_ignores_case_punctuation_and_spacing() -> None:
    assert normalize("  Hello,  WORLD!\n") == "hello world"
    assert content_hash(["Hello, world!", "Bye."]) == content_hash(["hello world", "bye"])
    assert content_hash(["Hello world."]) != content_hash(["Hello word."])


def test_minhash_estimates_jaccard_and_is_stable() -> None:
    rng = random.Random(1)
    base = _text(rng, 3000).split()
    edited = list(base)
    for i in rng.sample(range(len(edited)), 30):  # 1% of the words changed
        edited[i] = "changed"
    hasher = MinHasher(128, 0.8)
    a, b = hasher.signature(" ".join(base)), hasher.signature(" ".join(edited))
    c = hasher.signature(_text(rng, 3000))
    assert hasher.similarity(a, b) > 0.75  # true 5-gram Jaccard is about 0.82
    assert hasher.similarity(a, c) < 0.05
    # same permutations in every process (seeded, never Python's salted hash)
    again = MinHasher(128, 0.8).signature(" ".join(base))
    assert np.array_equal(a, again)
    assert set(hasher.band_keys(a)) & set(hasher.band_keys(b))
    assert not set(hasher.band_keys(a)) & set(hasher.band_keys(c))


def test_bands_put_the_s_curve_at_the_threshold() -> None:
    bands, rows = choose_bands(128, 0.8)
    assert bands * rows == 128
    assert abs((1 / bands) ** (1 / rows) - 0.8) < 0.1


def test_bucket_keeps_the_smallest_id() -> None:
    sig = np.arange(16, dtype=np.uint64)
    other = sig.copy()
    other[:2] = 99
    far = sig + 1000
    found = near_duplicates_in_bucket([("book:c", sig), ("book:a", sig), ("book:b", other),
                                       ("book:z", far)], 0.8)
    assert found == [("book:b", "book:a", 0.875), ("book:c", "book:a", 1.0)]
