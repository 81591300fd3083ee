"""Duplicate detection: exact (hash of normalized text) and near (MinHash + LSH bands).

    from bert_core.corpus.dedup import content_hash, MinHasher
    content_hash(["A  sentence.", "Another!"]) == content_hash(["a sentence", "another"])  # True
    hasher = MinHasher(num_perm=128, threshold=0.8)
    sig = hasher.signature(text); hasher.band_keys(sig); hasher.similarity(sig, other_sig)

Every hash here is stable across processes (never Python's salted ``hash()``), so Beam workers
on different machines agree. ``beam_jobs/clean_corpus.py`` runs both steps.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from bert_core.corpus import documents as D

_ASCII = bytes(range(128))
_SPACES = re.compile(b"  +")
# ASCII letters lowercased, digits kept, every other ASCII byte a space; bytes above 127 kept.
_ASCII_WORDS = bytes(
    (ord(chr(i).lower()) if chr(i).isalnum() else 32) if i < 128 else i for i in range(256)
)
_EMPTY = np.uint64(1 << 32)  # above every 32-bit hash value
_SHIFT = np.uint64(32)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier (golden ratio), order-sensitive mix
_CHUNK = 2048  # shingles per block: num_perm x 2048 x 8 bytes stays in cache


def normalize(text: str) -> str:
    """Case, accents-as-written, punctuation and spacing do not make a document different:
    the casefolded words (maximal runs of letters and digits) joined by single spaces."""
    if not unicodedata.is_normalized("NFKC", text):  # the check is much cheaper than the work
        text = unicodedata.normalize("NFKC", text)
    # The same as " ".join(re.findall(r"[^\W_]+", text.casefold())), done with C string methods: a
    # regex over every character of a corpus is several times slower. Characters beyond ASCII
    # that are not letters or digits become spaces one kind at a time; the ASCII ones through
    # a byte table (UTF-8 leaves every byte of a wider character above 127, untouched).
    if text.isascii():
        text = text.encode("ascii").translate(_ASCII_WORDS)
    else:
        text = text.casefold()
        data = text.encode("utf-8")
        wide = set(data.translate(None, _ASCII).decode("utf-8"))  # the characters beyond ASCII
        marks = [char for char in wide if not char.isalnum()]
        if marks:
            for char in marks:
                text = text.replace(char, " ")
            data = text.encode("utf-8")
        text = data.translate(_ASCII_WORDS)
    return _SPACES.sub(b" ", text).strip(b" ").decode("utf-8")


def content_hash(sentences: list[str]) -> str:
    """Stable hash of a document's normalized text (exact-duplicate key)."""
    return normalized_hash(normalize(" ".join(sentences)))


def normalized_hash(normalized: str) -> str:
    return hashlib.blake2b(normalized.encode("utf-8"), digest_size=16).hexdigest()


def shingle_hashes(text: str, k: int = 5, normalized: bool = False) -> np.ndarray:
    """32-bit hashes of the k-word shingles of the normalized text, in order, a shingle that
    recurs as often as it does (no minimum of a signature depends on how often).

    Each word is hashed once (CRC-32); a shingle's hash mixes its k word hashes with fixed odd
    multipliers in numpy, instead of building and hashing k-word strings in Python.
    """
    words = (text if normalized else normalize(text)).split()
    if not words:
        return np.zeros(0, dtype=np.uint64)
    word_hashes = np.fromiter((zlib.crc32(w.encode("utf-8")) for w in words), dtype=np.uint64,
                              count=len(words))
    n = max(len(words) - k + 1, 1)
    mixed = np.zeros(n, dtype=np.uint64)
    for j in range(min(k, len(words))):
        mixed = mixed * _MIX + word_hashes[j : j + n]  # wraps mod 2**64, as intended
    return mixed % np.uint64(1 << 32)


def choose_bands(num_perm: int, threshold: float) -> tuple[int, int]:
    """(bands, rows) with bands x rows = num_perm and the S-curve midpoint nearest threshold."""
    options = [(b, num_perm // b) for b in range(1, num_perm + 1) if num_perm % b == 0]
    return min(options, key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


# Why not datasketch: benchmarks/speed/bench_dedup.py runs both on the sample texts against exact
# Jaccard similarities; with the same bands their recall and precision are within sampling noise
# of each other. Ours computes signatures and LSH buckets faster, and its band keys are plain
# strings that a Beam GroupByKey shares out over workers, where MinHashLSH is one in-memory index.
class MinHasher:
    """MinHash signatures; permutation i is the multiply-shift hash h(x) = (a_i*x + b_i) >> 32
    over 64-bit words (a_i odd), drawn from ``rng``: universal, and no slow modulo.

    Near duplicates are documents whose 5-word shingle sets have an estimated Jaccard similarity
    at or above the threshold. Signatures are split into ``bands`` of ``rows`` values; two
    documents are candidates when any band is equal (the classic LSH S-curve, with bands x rows =
    num_perm and its midpoint as near the threshold as those allow), and a candidate pair is
    confirmed on the full signature.
    """

    def __init__(self, num_perm: int = 128, threshold: float = 0.8, rng: np.random.Generator | None = None):
        # A fixed default seed: every worker must draw the same permutations.
        rng = rng if rng is not None else np.random.default_rng(0x5EED)
        self.num_perm = num_perm
        self.threshold = threshold
        self.a = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
        self.bands, self.rows = choose_bands(num_perm, threshold)

    def signature(self, text: str, normalized: bool = False) -> np.ndarray:
        """num_perm minimum hash values (all 2**32 for an empty text)."""
        shingles = shingle_hashes(text, normalized=normalized)
        if not len(shingles):
            return np.full(self.num_perm, _EMPTY, dtype=np.uint64)
        lowest = np.full(self.num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
        block = np.empty((self.num_perm, _CHUNK), dtype=np.uint64)  # reused: no temporaries
        for start in range(0, len(shingles), _CHUNK):
            x = shingles[start : start + _CHUNK]
            values = block[:, : len(x)]
            np.multiply(self.a[:, None], x[None, :], out=values)  # wraps mod 2**64
            values += self.b[:, None]
            np.minimum(lowest, values.min(axis=1), out=lowest)
        # the shift is monotonic, so it can be applied to the minima only
        return lowest >> _SHIFT

    def band_keys(self, signature: np.ndarray) -> list[str]:
        """One key per band; equal keys make two documents candidate near duplicates."""
        keys = []
        for band in range(self.bands):
            rows = signature[band * self.rows : (band + 1) * self.rows]
            keys.append(f"{band}:{hashlib.blake2b(rows.tobytes(), digest_size=12).hexdigest()}")
        return keys

    @staticmethod
    def similarity(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
        """Estimated Jaccard similarity of the two shingle sets."""
        return float(np.mean(sig_a == sig_b))


def near_duplicates_in_bucket(
    members: list[tuple[str, np.ndarray]], threshold: float
) -> list[tuple[str, str, float]]:
    """(doc_id, duplicate_of, similarity) for one LSH bucket: each document is matched to the
    smallest doc_id below its own that it is similar to, so the smallest id of a group is the one kept."""
    members = sorted(members, key=lambda m: m[0])
    found = []
    for i, (doc_id, sig) in enumerate(members):
        for other_id, other_sig in members[:i]:
            if other_id == doc_id:
                continue
            sim = MinHasher.similarity(sig, other_sig)
            if sim >= threshold:
                found.append((doc_id, other_id, sim))
                break
    return found


# --------------------------------------------------------------------------- verdicts


def exact_losers(element: tuple[Any, Iterable[tuple[str, str]]]) -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Same normalized text: the smallest (doc_id, origin) is kept, every other one loses."""
    _, group = element
    members = sorted(group)
    for member in members[1:]:
        yield tuple(member), tuple(members[0])


def apply_verdicts(docs: Iterable[D.Document], exact: Iterable[tuple[tuple[str, str], tuple[str, str]]],
                   near: Iterable[tuple[str, tuple[str, float]]]) -> Iterator[Any]:
    """Kept documents in (doc_id, origin) order, and a reject for each duplicate (naming what it
    duplicates), as one merge of three sorted streams: ``docs`` sorted by (doc_id, origin),
    ``exact`` verdicts ((doc_id, origin) -> kept (doc_id, origin)) sorted by loser, and ``near``
    verdicts (doc_id -> (smallest similar doc_id, similarity)) sorted, so the first of a doc_id
    is its smallest match. Memory is one record per stream, never the shard.
    """
    exact, near = iter(exact), iter(near)
    verdict, match = next(exact, None), next(near, None)
    last_kept: tuple[str, str] | None = None
    for doc in docs:
        doc_id, origin = doc["doc_id"], doc["origin"]
        while verdict is not None and verdict[0] < (doc_id, origin):
            verdict = next(exact, None)
        if verdict is not None and verdict[0] == (doc_id, origin):
            kept = verdict[1]
            yield D.make_reject(doc["source"], doc_id, D.DUPLICATE,
                                f"{doc['title']!r} ({origin}) has the same normalized text as "
                                f"{kept[0]} ({kept[1]})", duplicate_of=kept[0])
            continue
        while match is not None and match[0] < doc_id:
            match = next(near, None)
        if last_kept is not None and last_kept[0] == doc_id:
            yield D.make_reject(doc["source"], doc_id, D.DUPLICATE_DOC_ID,
                                f"{origin} repeats doc_id {doc_id} of {last_kept[1]} with different "
                                "text; the first is kept", duplicate_of=doc_id)
        elif match is not None and match[0] == doc_id:
            dup_of, sim = match[1]
            yield D.make_reject(doc["source"], doc_id, D.NEAR_DUPLICATE,
                                f"{doc['title']!r}: estimated Jaccard similarity {sim:.2f} of 5-word "
                                f"shingles with {dup_of}", duplicate_of=dup_of)
        else:
            last_kept = (doc_id, origin)
            yield doc
