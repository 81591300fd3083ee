"""Words as BERT's basic tokenizer sees them, and their counts: the input of vocab training.

    bertpipe vocab --corpus CORPUS_URI --output VOCAB_URI
    (beam_jobs/build_vocab.py calls :func:`count_words` per document, then sums per word)

BERT's basic tokenization (google-research/bert ``BasicTokenizer``): drop control characters,
put spaces around CJK ideographs, lowercase and strip accents when uncased, split on whitespace
and punctuation. The normalizer and pre-tokenizer are the exact objects the tokenizer uses
(:func:`bert_core.vocab.tokenization.bert_normalizer` / ``bert_pre_tokenizer``), so a word counted here
is a word the trainer and the tokenizer would see in the raw text. Such a word never contains
whitespace, so ``"word word word"`` splits back into three copies of it (see
:func:`repeated_words`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from functools import lru_cache
from typing import Any

from bert_core import storage


@lru_cache(maxsize=8)
def _pipeline(lowercase: bool, strip_accents: bool | None) -> tuple[Any, Any]:
    # Built once per process and casing (Rust objects; cheap to call, not free to build).
    from bert_core.vocab.tokenization import bert_normalizer, bert_pre_tokenizer

    return bert_normalizer(lowercase, strip_accents), bert_pre_tokenizer()


def basic_tokenize(text: str, lowercase: bool = True, strip_accents: bool | None = None) -> list[str]:
    """``text`` -> BERT's basic-tokenized words (before WordPiece)."""
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


def repeated_words(word: str, count: int, max_chars: int = 1 << 20) -> Iterator[str]:
    """``word`` ``count`` times, as space-joined strings of at most ~``max_chars`` characters.

    Feeding these to a trainer that splits on whitespace counts ``word`` exactly ``count`` times
    while no string (and so no memory) grows with the count.
    """
    per_chunk = max(1, max_chars // (len(word) + 1))
    while count > 0:
        n = min(count, per_chunk)
        yield " ".join([word] * n)
        count -= n


def read_counts(scratch: str) -> list[tuple[str, int]]:
    """All ``(word, count)`` pairs, sorted by count descending then word (a stable training order)."""
    pairs = []
    for uri in storage.glob(storage.join(scratch, "counts*.tsv")):
        with storage.open_file(uri, "rb") as f:
            for line in f:
                word, count = line.decode("utf-8").rstrip("\n").rsplit("\t", 1)
                pairs.append((word, int(count)))
    pairs.sort(key=lambda wc: (-wc[1], wc[0]))
    return pairs
