"""Near-duplicate search: ours (MinHash + LSH bands, bert_core/corpus/dedup.py) vs ``datasketch``
(``MinHash`` + ``MinHashLSH``), on real text.

    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_dedup

Documents are 300-word windows of the sample texts at random starts, so overlapping windows of
one text spread over every similarity around the 0.8 threshold. Both sides get the same shingles
and 128 permutations, each with its own bands and then with the other's (which tells the band
choice from the MinHash estimate); the truth is the exact Jaccard similarity of every
overlapping and every reported pair. Rows: ``bench-results/dedup.json``.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from pathlib import Path

from benchmarks.common import row, sample_texts, samples, timed, write_rows

WINDOW = 300  # words per document
MEAN_GAP = 240  # words between window starts, on average
THRESHOLD = 0.8
NUM_PERM = 128
K = 5  # words per shingle, as bert_core.corpus.dedup


def documents(root: Path, rng: random.Random) -> list[tuple[int, int, str]]:
    """(text number, start word, normalized words joined) of every window."""
    from bert_core.corpus.dedup import normalize

    docs = []
    for t, text in enumerate(sample_texts(root)):
        words = normalize(text).split()
        n = max(len(words) - WINDOW, 0) // MEAN_GAP
        for start in sorted(rng.sample(range(len(words) - WINDOW), n)):
            docs.append((t, start, " ".join(words[start : start + WINDOW])))
    return docs


def shingles(normalized: str) -> set[str]:
    words = normalized.split()
    return {" ".join(words[i : i + K]) for i in range(len(words) - K + 1)}


def our_pairs(sigs: list, bands: tuple[int, int]) -> set[tuple[int, int]]:
    """Pairs that share a band key (``bands`` = (bands, rows)) and pass the similarity check."""
    from bert_core.corpus.dedup import MinHasher

    hasher = MinHasher(NUM_PERM, THRESHOLD)
    hasher.bands, hasher.rows = bands
    buckets = defaultdict(list)
    for i, sig in enumerate(sigs):
        for key in hasher.band_keys(sig):
            buckets[key].append(i)
    pairs = set()
    for members in buckets.values():
        for i, j in itertools.combinations(members, 2):
            if (i, j) not in pairs and hasher.similarity(sigs[i], sigs[j]) >= THRESHOLD:
                pairs.add((i, j))
    return pairs


def reference_signature(doc: str):
    from datasketch import MinHash

    m = MinHash(num_perm=NUM_PERM)
    m.update_batch([s.encode("utf-8") for s in shingles(doc)])
    return m


def reference_pairs(sigs: list, bands: tuple[int, int] | None) -> set[tuple[int, int]]:
    """datasketch's LSH with ``bands`` (None: the bands it chooses for the threshold)."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM, params=bands)
    for i, m in enumerate(sigs):
        lsh.insert(i, m)
    pairs = set()
    for i, m in enumerate(sigs):
        for j in lsh.query(m):
            if j > i and m.jaccard(sigs[j]) >= THRESHOLD:
                pairs.add((i, j))
    return pairs


def main() -> None:
    from datasketch import MinHashLSH

    from bert_core.corpus.dedup import MinHasher, choose_bands

    windows = documents(samples(), random.Random(0))
    docs = [d for _, _, d in windows]
    n = len(docs)
    hasher = MinHasher(NUM_PERM, THRESHOLD)
    our_sigs, our_sig_s = timed(lambda: [hasher.signature(d, normalized=True) for d in docs])
    ref_sigs, ref_sig_s = timed(lambda: [reference_signature(d) for d in docs])
    our_bands = choose_bands(NUM_PERM, THRESHOLD)
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    ref_bands = (lsh.b, lsh.r)
    found = {  # (side, bands) -> (pairs, LSH CPU-seconds)
        ("ours", our_bands): timed(lambda: our_pairs(our_sigs, our_bands)),
        ("datasketch", ref_bands): timed(lambda: reference_pairs(ref_sigs, None)),
        ("ours", ref_bands): timed(lambda: our_pairs(our_sigs, ref_bands)),
        ("datasketch", our_bands): timed(lambda: reference_pairs(ref_sigs, our_bands)),
    }

    # the truth: exact Jaccard of every overlapping pair of windows and of every reported pair
    sets = [shingles(d) for d in docs]
    reported = set().union(*(pairs for pairs, _ in found.values()))
    truth = {(i, j) for i, j in _overlapping(windows) | reported
             if len(sets[i] & sets[j]) / len(sets[i] | sets[j]) >= THRESHOLD}

    def quality(pairs: set[tuple[int, int]]) -> tuple[float, float]:
        hits = len(pairs & truth)
        return hits / max(len(pairs), 1), hits / max(len(truth), 1)

    print(f"{n} documents of {WINDOW} words; {len(truth)} pairs with true Jaccard >= {THRESHOLD}")
    for (side, (b, r)), (pairs, seconds) in found.items():
        p, rec = quality(pairs)
        print(f"{side:>10} LSH {b}x{r}: {n / seconds:,.0f} docs/CPU-s, {len(pairs)} pairs, "
              f"precision {p:.3f}, recall {rec:.3f}")
    same = [found["ours", our_bands][0], found["datasketch", our_bands][0]]
    agree = len(same[0] & same[1]) / max(len(same[0] | same[1]), 1)

    (our_p, our_r), (ref_p, ref_r) = quality(found["ours", our_bands][0]), quality(found["datasketch", ref_bands][0])
    (_, our_r_same), (_, ref_r_same) = (quality(s) for s in same)
    our_lsh_s, ref_lsh_s = found["ours", our_bands][1], found["datasketch", ref_bands][1]
    bands_name = f"ours {our_bands[0]}x{our_bands[1]}, datasketch {ref_bands[0]}x{ref_bands[1]}"
    rows = [
        row(f"MinHash signatures ({NUM_PERM} permutations, {WINDOW}-word documents, 1 thread)", round(n / our_sig_s),
            round(n / ref_sig_s), "docs/CPU-s", ref_sig_s / our_sig_s),
        row(f"LSH index + query + confirm, each side's bands ({bands_name})", round(n / our_lsh_s),
            round(n / ref_lsh_s), "docs/CPU-s", ref_lsh_s / our_lsh_s),
        row(f"near-duplicate recall, each side's bands ({len(truth)} true pairs of {n} docs)", our_r, ref_r,
            "recall", our_r / ref_r),
        row("near-duplicate precision, each side's bands", our_p, ref_p, "precision", our_p / ref_p),
        row(f"near-duplicate recall, same bands ({our_bands[0]}x{our_bands[1]})", our_r_same, ref_r_same,
            "recall", our_r_same / ref_r_same),
        row("pairs found by both sides, of the pairs found by either (same bands)", agree, None, "fraction"),
    ]
    write_rows("dedup", rows)


def _overlapping(windows: list[tuple[int, int, str]]) -> set[tuple[int, int]]:
    """Pairs of windows of one text that share words (windows are sorted by text, then start)."""
    pairs = set()
    for i, (t, start, _) in enumerate(windows):
        j = i + 1
        while j < len(windows) and windows[j][0] == t and windows[j][1] - start < WINDOW:
            pairs.add((i, j))
            j += 1
    return pairs


if __name__ == "__main__":
    main()
