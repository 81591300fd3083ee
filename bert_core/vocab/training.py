"""Train a WordPiece vocab from word counts, measure a vocab on word counts, and report it.

    bertpipe vocab --corpus CORPUS_URI --output VOCAB_URI
    (beam_jobs/build_vocab.py counts the words in parallel, then calls these in the driver)

Special tokens come first in bert-base order: ``[PAD]`` = 0, ``[unused0..N-1]``, ``[UNK]``,
``[CLS]``, ``[SEP]``, ``[MASK]``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bert_core.config import ConfigError
from bert_core.histogram import Histogram
from bert_core.vocab.tokenization import CLS, MASK, PAD, SEP, SUBWORD_PREFIX, UNK, Tokenizer
from bert_core.vocab.wordcount import repeated_words

# **Why the counts are fed as repeated words.** HF ``tokenizers`` trains WordPiece from an
# iterator of texts and has no train-from-counts API (its maintainers declined one). The trainer
# only uses the count of each distinct word, so feeding each word repeated by its count
# (:func:`bert_core.vocab.wordcount.repeated_words`) gives it exactly the counts it would have built
# from the raw text: the same vocab as raw-text training up to ties (tests/test_build_vocab.py
# checks it; benchmarks/speed/bench_vocab.py measures it on the whole sample corpus). Scaling the
# counts down to save time changes which merges win, so we do not. Costs: time is linear in
# the corpus's word count, as for raw-text training (but the text is already normalized and
# split); memory is the trainer's own
# distinct-word table, never the corpus: the sorted counts stream from files
# (:func:`bert_core.vocab.wordcount.iter_counts`) and the repeats are generated lazily in chunks
# of at most 1 MB.
#
# **Why the output is byte-for-byte reproducible.** The trainer assigns ids to ``##c`` pieces in
# hash-map order and breaks ties between equally frequent merges by id, so two runs on the same
# counts could give a different vocab. We fix every initial id: the alphabet is chosen here
# (``limit_alphabet`` most frequent characters, ties by code point) and passed as the initial
# alphabet, and the ``##c`` piece of every alphabet character that occurs inside a word (the
# pieces the trainer would add itself) is registered up front with the special tokens. From there
# the trainer's merge order is a total order on (count, pair ids), so the same counts give the
# same ``vocab.txt``, whatever the Beam runner or worker count.


def special_tokens(num_unused: int) -> list[str]:
    """``[PAD]``, ``[unused0..N-1]``, ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` (ids 0..N+4)."""
    return [PAD, *(f"[unused{i}]" for i in range(num_unused)), UNK, CLS, SEP, MASK]


def choose_alphabet(word_counts: Iterable[tuple[str, int]], limit_alphabet: int) -> tuple[list[str], list[str]]:
    """The ``limit_alphabet`` most frequent characters (ties by code point), sorted, and those of
    them that occur inside a word (after its first character): the ones that get a ``##`` piece."""
    chars: Counter[str] = Counter()
    inner: set[str] = set()
    for word, count in word_counts:
        for char in word:
            chars[char] += count
        inner.update(word[1:])
    ranked = sorted(chars, key=lambda c: (-chars[c], c))
    alphabet = sorted(ranked[:limit_alphabet])
    return alphabet, [c for c in alphabet if c in inner]


def train_wordpiece(
    word_counts: Callable[[], Iterable[tuple[str, int]]],
    vocab_size: int,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
    num_unused: int = 100,
) -> dict[str, int]:
    """A WordPiece vocab ``{token: id}`` trained on ``(word, count)`` pairs.

    ``word_counts`` is called twice (alphabet, then training) and must yield the same pairs in
    the same order each time (sorted, e.g. by descending count then word), so it can stream
    from disk instead of holding a list. Words are basic-tokenized (no whitespace inside).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    specials = special_tokens(num_unused)
    alphabet, continued = choose_alphabet(word_counts(), limit_alphabet)
    # Exactly the ## pieces the trainer would create itself, but with ids fixed up front.
    fixed = specials + [SUBWORD_PREFIX + c for c in continued]
    if vocab_size < len(fixed) + len(alphabet):
        raise ConfigError(
            f"vocab_size={vocab_size} is too small: the special tokens, the alphabet and its "
            f"'##' pieces alone take {len(fixed) + len(alphabet)}; raise vocab.vocab_size or "
            "lower vocab.limit_alphabet / vocab.num_unused"
        )
    backend = HFTokenizer(models.WordPiece(unk_token=UNK, continuing_subword_prefix=SUBWORD_PREFIX))
    # The words are already normalized and split; whitespace splitting recovers them exactly.
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        special_tokens=fixed,
        continuing_subword_prefix=SUBWORD_PREFIX,
        show_progress=False,
    )
    texts = (chunk for word, count in word_counts() for chunk in repeated_words(word, count))
    backend.train_from_iterator(texts, trainer)
    return backend.get_vocab()


def vocab_stats(
    tokenizer: Tokenizer, word_counts: Iterable[tuple[str, int]], top: int = 30, batch: int = 10000
) -> dict[str, Any]:
    """How a vocab covers a corpus, from its word counts.

    ``unk_rate``: share of word occurrences that become ``[UNK]``; ``tokens_per_word``: mean
    word pieces per word occurrence; ``word_coverage``: share of word occurrences that are a
    single vocab token; ``used_tokens``: vocab entries used at least once; ``top_tokens``: most
    frequent tokens; ``token_length`` (min/mean/max) and ``token_length_histogram``: characters
    per vocab token (``##`` and special tokens excluded).
    """
    token_freq: Counter[int] = Counter()
    words = occurrences = unk = whole = 0
    pending: list[tuple[str, int]] = []

    def flush() -> None:
        nonlocal words, occurrences, unk, whole
        for (_, count), ids in zip(pending, tokenizer.encode_words([w for w, _ in pending]), strict=True):
            words += 1
            occurrences += count
            unk += count * (tokenizer.unk_id in ids)
            whole += count * (len(ids) == 1 and ids[0] != tokenizer.unk_id)
            for token_id in ids:
                token_freq[token_id] += count
        pending.clear()

    for pair in word_counts:
        pending.append(pair)
        if len(pending) >= batch:
            flush()
    flush()
    pieces = sum(token_freq.values())
    lengths = [len(t.removeprefix(SUBWORD_PREFIX)) for t in tokenizer.vocab if not _is_special(t)]
    return {
        "distinct_words": words,
        "words": occurrences,
        "tokens": pieces,
        "unk_rate": unk / occurrences if occurrences else 0.0,
        "tokens_per_word": pieces / occurrences if occurrences else 0.0,
        "word_coverage": whole / occurrences if occurrences else 0.0,
        "used_tokens": len(token_freq),
        "subword_share": sum(1 for t in tokenizer.vocab if Tokenizer.is_subword(t)) / len(tokenizer.vocab),
        "token_length": {
            "min": min(lengths, default=0),
            "mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "max": max(lengths, default=0),
        },
        "token_length_histogram": Histogram.of(
            lengths, range(min(lengths, default=1), max(lengths, default=0) + 2)).to_json(),
        "top_tokens": [
            [tok, count] for tok, count in
            zip(tokenizer.convert_ids_to_tokens([i for i, _ in _top(token_freq, top)]),
                [c for _, c in _top(token_freq, top)], strict=True)
        ],
    }


def _top(freq: Counter[int], n: int) -> Sequence[tuple[int, int]]:
    return sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def _is_special(token: str) -> bool:
    return token.startswith("[") and token.endswith("]") and len(token) > 2


def report_markdown(manifest: dict[str, Any]) -> str:
    """Markdown summary of a vocab stage manifest (the CLI's output and the ``vocab-report``
    artifact of flows/vocab.py, which adds a picture)."""
    cfg, counts, stats = manifest["config"], manifest["counts"], manifest["stats"]
    casing = "uncased" if cfg["lowercase"] else "cased"
    accents = "accents stripped" if cfg["strip_accents"] else "accents kept"
    origin = (f"trained on {counts.get('words', 0):,} words of {counts.get('documents', 0):,} documents"
              if counts.get("trained") else f"given: `{cfg['vocab_file']}` (validated)")
    lines = [
        f"## Vocab at `{manifest['uri']}`",
        "",
        f"- **size**: {counts['vocab_size']:,} tokens ({origin})",
        f"- **casing**: {casing}, {accents}; words over {cfg['max_input_chars_per_word']} characters -> [UNK]",
    ]
    if stats:
        length = stats["token_length"]
        lines += [
            f"- **UNK rate** on the corpus: {stats['unk_rate']:.4%} of word occurrences",
            f"- **pieces per word**: {stats['tokens_per_word']:.3f}; words that are one token: "
            f"{stats['word_coverage']:.2%}",
            f"- **tokens used** on the corpus: {stats['used_tokens']:,} of {counts['vocab_size']:,}; "
            f"`##` pieces: {stats['subword_share']:.1%} of the vocab",
            f"- **token length** (characters, without `##`): min {length['min']}, "
            f"mean {length['mean']:.2f}, max {length['max']}",
            "",
            "| rank | token | occurrences |",
            "|---:|---|---:|",
            *(f"| {i} | `{tok}` | {n:,} |" for i, (tok, n) in enumerate(stats["top_tokens"], 1)),
        ]
    return "\n".join(lines)
