"""bert_core/corpus/dedup.py: normalized exact hashes, MinHash similarity, LSH banding."""

from __future__ import annotations

import random

import numpy as np

from bert_core.corpus import documents as D
from bert_core.corpus.dedup import (
    MinHasher,
    apply_verdicts,
    choose_bands,
    content_hash,
    exact_losers,
    near_duplicates_in_bucket,
    normalize,
    shingle_hashes,
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


def test_verdicts_apply_as_one_merge_of_sorted_streams() -> None:
    def doc(doc_id: str, origin: str) -> dict:
        return D.make_document(doc_id, D.BOOKS, doc_id.upper(), ["A sentence of the book."], origin)

    docs = [doc("book:a", "a.txt"), doc("book:b", "b.txt"), doc("book:c", "c.txt"), doc("book:c", "d.txt"),
            doc("book:d", "d.txt"), doc("book:e", "e.txt")]
    exact = sorted(exact_losers(("h", [("book:b", "b.txt"), ("book:a", "a.txt")])))
    # book:e is near two documents: the smallest match names it; book:zz has no document here
    near = sorted([("book:e", ("book:d", 0.9)), ("book:e", ("book:a", 0.85)), ("book:zz", ("book:a", 1.0))])
    out = list(apply_verdicts(docs, iter(exact), iter(near)))
    kept = [r["doc_id"] for r in out if not D.is_reject(r)]
    rejects = {(r["id"], r["reason"], r.get("duplicate_of")) for r in out if D.is_reject(r)}
    assert kept == ["book:a", "book:c", "book:d"]
    assert rejects == {("book:b", D.DUPLICATE, "book:a"), ("book:c", D.DUPLICATE_DOC_ID, "book:c"),
                       ("book:e", D.NEAR_DUPLICATE, "book:a")}
    assert len(out) == len(docs)  # kept + rejected = read


def test_normalize_is_the_casefolded_words_joined_by_spaces() -> None:
    import re
    import unicodedata

    words = re.compile(r"[^\W_]+")  # letters and digits: the definition normalize() implements
    for text in ["Straße – “Quoted” don’t snake_case 3.14 ½ K\u212a Ⅻ", "ÉTÉ\u00a0été\u2003l'été…",
                 "plain ASCII, with-dashes_and (brackets)", "", "  __  ", "ﬁne ﬂow ｆｕｌｌ ①"]:
        expected = " ".join(words.findall(unicodedata.normalize("NFKC", text).casefold()))
        assert normalize(text) == expected


def test_a_signature_does_not_depend_on_how_often_a_shingle_recurs() -> None:
    hasher = MinHasher(num_perm=64)
    text = " ".join(["the cat sat on the mat"] * 40 + ["and then a dog came by"] * 3)
    shingles = shingle_hashes(text)
    distinct = np.unique(shingles)
    assert len(distinct) < len(shingles)  # the text repeats its shingles
    # the minimum of each permutation over the distinct shingles only
    values = hasher.a[:, None] * distinct[None, :] + hasher.b[:, None]  # wraps mod 2**64
    assert (hasher.signature(text) == values.min(axis=1) >> np.uint64(32)).all()
