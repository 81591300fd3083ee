"""Words as BERT's basic tokenizer sees them, and their counts: the input of vocab training.

    bertpipe vocab --corpus CORPUS_URI --output VOCAB_URI
    (beam_jobs/build_vocab.py calls :func:`count_words` per document, then sums per word)

A word counted here is a word the trainer and the tokenizer would see in the raw text
(:func:`basic_tokenize`).
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache
from typing import Any

from bert_core import storage


@lru_cache(maxsize=8)
def _pipeline(lowercase: bool, strip_accents: bool | None) -> tuple[Any, Any]:
    # Built once per process and casing (Rust objects; cheap to call, not free to build).
    from bert_core.vocab.tokenization import bert_normalizer, bert_pre_tokenizer

    return bert_normalizer(lowercase, strip_accents), bert_pre_tokenizer()


def basic_tokenize(text: str, lowercase: bool = True, strip_accents: bool | None = None) -> list[str]:
    """``text`` -> BERT's basic-tokenized words (before WordPiece).

    BERT's basic tokenization (google-research/bert ``BasicTokenizer``): drop control characters,
    put spaces around CJK ideographs, lowercase and strip accents when uncased, split on whitespace
    and punctuation. The normalizer and pre-tokenizer are the exact objects the tokenizer uses
    (:func:`bert_core.vocab.tokenization.bert_normalizer` / ``bert_pre_tokenizer``). Such a word
    never contains whitespace, so ``"word word word"`` splits back into three copies of it (see
    :func:`repeated_words`).
    """
    normalizer, pre_tokenizer = _pipeline(lowercase, strip_accents)
    return [word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))]


def count_words(
    texts: Iterable[str], lowercase: bool = True, strip_accents: bool | None = None
) -> Counter[str]:
    """Word counts over ``texts`` (e.g. the sentences of one document)."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(basic_tokenize(text, lowercase, strip_accents))
    return counts


def repeated_words(word: str, count: int, max_chars: int = 1 << 16) -> Iterator[str]:
    """``word`` ``count`` times, as space-joined strings of at most ~``max_chars`` characters.

    Feeding these to a trainer that splits on whitespace counts ``word`` exactly ``count`` times
    while no string (and so no memory) grows with the count.
    """
    per_chunk = max(1, max_chars // (len(word) + 1))
    while count > 0:
        n = min(count, per_chunk)
        yield " ".join([word] * n)
        count -= n


def word_bucket(word: str, buckets: int) -> int:
    """Bucket of a word for spreading counts over files (CRC-32: stable across processes)."""
    return zlib.crc32(word.encode("utf-8")) % buckets


def count_key(pair: tuple[str, int]) -> tuple[int, str]:
    """The training order: count descending, then word."""
    return -pair[1], pair[0]


def write_counts(uri: str, pairs: Iterable[tuple[str, int]]) -> None:
    """``word<TAB>count`` lines (a basic-tokenized word holds no whitespace, so no escaping)."""
    with storage.open_file(uri, "wb") as f:
        for word, count in pairs:
            f.write(f"{word}\t{count}\n".encode())


def iter_count_file(uri: str) -> Iterator[tuple[str, int]]:
    """The ``(word, count)`` pairs of one counts file, in file order."""
    with storage.open_file(uri, "rb") as f:
        for line in f:
            word, count = line.decode("utf-8").rstrip("\n").rsplit("\t", 1)
            yield word, int(count)


def merge_count_files(uris: Iterable[str]) -> Counter[str]:
    """Summed counts of several partial counts files (the words of one bucket)."""
    counts: Counter[str] = Counter()
    for uri in uris:
        for word, count in iter_count_file(uri):
            counts[word] += count
    return counts


def iter_counts(scratch: str, min_count: int = 1) -> Iterator[tuple[str, int]]:
    """All ``(word, count)`` pairs of the ``counts-*.tsv`` files in ``scratch`` with a count of at
    least ``min_count``, each file already sorted by :func:`count_key`, merged into that order as
    a stream: memory is one line per file, never the distinct-word table. The order puts the
    kept words first, so the stream stops at the first word below ``min_count``."""
    files = storage.glob(storage.join(scratch, "counts-*.tsv"))
    merged = heapq.merge(*(iter_count_file(uri) for uri in files), key=count_key)
    return merged if min_count <= 1 else itertools.takewhile(lambda pair: pair[1] >= min_count, merged)


def read_counts(scratch: str) -> list[tuple[str, int]]:
    """All ``(word, count)`` pairs, sorted by count descending then word (tests, small tools)."""
    return list(iter_counts(scratch))


# --------------------------------------------------------------------------- count of counts


def write_count_of_counts(uri: str, counts: Iterable[int]) -> None:
    """How many words have each count (``count<TAB>words`` lines): a table of at most a few
    thousand lines whatever the corpus, since a corpus of N words has fewer than sqrt(2N)
    distinct counts."""
    with storage.open_file(uri, "wb") as f:
        for count, words in sorted(Counter(counts).items()):
            f.write(f"{count}\t{words}\n".encode())


def read_count_of_counts(scratch: str) -> Counter[int]:
    """The ``hist-*.tsv`` files of ``scratch`` summed: words per count over the whole corpus."""
    total: Counter[int] = Counter()
    for uri in storage.glob(storage.join(scratch, "hist-*.tsv")):
        with storage.open_file(uri, "rb") as f:
            for line in f:
                count, words = line.split(b"\t")
                total[int(count)] += int(words)
    return total


def min_count_for(count_of_counts: Mapping[int, int], max_words: int) -> int:
    """The smallest count ``t`` such that at most ``max_words`` words have a count of ``t`` or
    more (1 when the corpus has at most ``max_words`` distinct words). Words that tie at the
    cut are all left out, so the kept words never depend on their order."""
    kept = 0
    for count in sorted(count_of_counts, reverse=True):
        kept += count_of_counts[count]
        if kept > max_words:
            return count + 1
    return 1
