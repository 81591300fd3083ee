"""Next-sentence pairs of documents of tokenized sentences, as token ranges.

    bertpipe instances --corpus CORPUS_URI --vocab VOCAB_URI --output OUT_URI
    (bert_core.instances.batch.instance_spans calls pair_spans / packed_spans here once per
    document, pass and length)

Every function takes its RNG; :func:`rng_for` derives one from ``(seed, doc_id, dupe_index, ...)``
so the output never depends on which worker ran a document, or in what order.
"""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# The rules:
#
# The pairs of google-research/bert's ``create_pretraining_data.py``, rule by rule, on token ids
# instead of token strings. Same rules, same distributions, fewer draws (so one seed gives pairs
# distributed like the reference's, not the very same ones; ``tests/oracles.py`` holds the
# reference's loops and the tests compare the two):
#
# - per document and pass: ``target_seq_length = max_seq_length - 3``, or with probability
#   ``short_seq_prob`` a random length in ``[2, max_seq_length - 3]``;
# - chunks of whole sentences grow until they reach the target (or the document ends);
#   ``a_end`` is random in ``[1, len(chunk) - 1]`` (1 for a one-sentence chunk);
# - with probability 0.5 (always for a one-sentence chunk) B is read from a random *other*
#   document starting at a random sentence, and the chunk's unused sentences are put back;
# - :func:`truncate_spans` trims the longer side, front or back with probability 0.5: which
#   side loses how many tokens depends only on the lengths (:func:`trim_counts`), and how many of
#   them come off the front is one Binomial(n, 1/2) draw instead of n coin flips;
# - the instance is ``[CLS] A [SEP] B [SEP]``, masked by ``bert_core.instances.masking``.
#
# Why spans: a segment of consecutive whole sentences is a token range of the document, so
# :func:`pair_spans` decides a pair with a few integers and draws (chunk ends found by bisecting
# the sentence offsets of a :class:`DocumentPool`) and copies no token; the job then builds and
# masks whole batches of pairs with numpy (``bert_core.instances.batch``).
#
# ``next_sentence_prediction: false`` (RoBERTa's ablation) uses :func:`packed_spans` instead:
# whole sentences packed up to the target length as one segment, no B,
# ``next_sentence_label = -1``.

if TYPE_CHECKING:
    from bert_core.vocab.tokenization import Tokenizer

Document = Sequence[Sequence[int]]  # sentences of token ids

# next_sentence_label values
ACTUAL_NEXT = 0
RANDOM_NEXT = 1
NO_NSP = -1


@dataclass(frozen=True)
class VocabIds:
    """What the algorithm needs of a vocab: special ids, its size, and which ids are ``##`` pieces."""

    cls_id: int
    sep_id: int
    mask_id: int
    vocab_size: int
    subword_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> VocabIds:
        subwords = frozenset(i for t, i in tokenizer.vocab.items() if t.startswith("##"))
        return cls(tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id, tokenizer.vocab_size, subwords)


def rng_for(seed: int, *parts: object) -> random.Random:
    """A ``random.Random`` seeded from ``(seed, *parts)`` by sha256: same parts, same draws, anywhere."""
    key = "\x1f".join(str(p) for p in (seed, *parts)).encode("utf-8")
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def stable_hash(*parts: object) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` is salted per process)."""
    key = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def trim_counts(len_a: int, len_b: int, max_num_tokens: int) -> tuple[int, int]:
    """How many tokens the reference's truncation loop removes from A and from B.

    The loop removes one token at a time from the longer side (B on a tie) until the pair fits,
    so which side loses a token depends only on the lengths: first the longer side down to the
    shorter one's length, then B, A, B, A, ... (B first on a tie).
    """
    excess = len_a + len_b - max_num_tokens
    if excess <= 0:
        return 0, 0
    gap = abs(len_a - len_b)
    if excess <= gap:
        return (excess, 0) if len_a > len_b else (0, excess)
    rest = excess - gap
    if len_a > len_b:
        return gap + rest // 2, (rest + 1) // 2
    return rest // 2, gap + (rest + 1) // 2


def _front_removals(removed: int, rng: random.Random) -> int:
    """Of ``removed`` tokens, how many the loop took from the front: each one independently with
    probability 0.5, i.e. Binomial(removed, 1/2), drawn as the popcount of ``removed`` random
    bits (one draw instead of one per token)."""
    return rng.getrandbits(removed).bit_count() if removed else 0


def truncate_spans(a0: int, a1: int, b0: int, b1: int, max_num_tokens: int,
                   rng: random.Random) -> tuple[int, int, int, int]:
    """Trim the pair of token ranges ``[a0, a1)`` and ``[b0, b1)`` to ``max_num_tokens``:
    always the longer side (B on a tie), each token from the front or the back with
    probability 0.5, so neither end of a segment is favoured. The reference's token-by-token
    loop in two draws (:func:`trim_counts`, :func:`_front_removals`)."""
    if a1 - a0 + b1 - b0 <= max_num_tokens:
        return a0, a1, b0, b1
    removed_a, removed_b = trim_counts(a1 - a0, b1 - b0, max_num_tokens)
    front_a = _front_removals(removed_a, rng)
    front_b = _front_removals(removed_b, rng)
    return a0 + front_a, a1 - (removed_a - front_a), b0 + front_b, b1 - (removed_b - front_b)


def _target_seq_length(max_num_tokens: int, short_seq_prob: float, rng: random.Random) -> int:
    # Mostly fill the sequence (padding is wasted compute), sometimes shorter so pre-training
    # also sees the short inputs of fine-tuning. A rough target; max_seq_length is the hard limit.
    if rng.random() < short_seq_prob:
        return rng.randint(2, max_num_tokens)
    return max_num_tokens


# --------------------------------------------------------------------------- spans


@dataclass
class DocumentPool:
    """Tokenized documents laid end to end: what random-next B segments are drawn from.

    ``tokens`` holds every token of every document; sentence ``s`` is
    ``tokens[sentence_offsets[s]:sentence_offsets[s + 1]]`` and document ``d`` is sentences
    ``doc_first[d] .. doc_first[d + 1] - 1``. Segments of consecutive whole sentences are then
    token ranges, so pairs are made from a few integers (:func:`pair_spans`) and their tokens are
    copied once, for a whole batch, by numpy (``bert_core.instances.batch``).
    """

    tokens: Sequence[int]  # numpy int32 array in the job; any sequence works
    sentence_offsets: list[int]
    doc_first: list[int]

    def __len__(self) -> int:
        return len(self.doc_first) - 1

    @classmethod
    def from_documents(cls, documents: Sequence[Document]) -> DocumentPool:
        """From documents as lists of sentences of ids (tests, small corpora)."""
        offsets, first, tokens = [0], [0], []
        for document in documents:
            for sentence in document:
                tokens.extend(sentence)
                offsets.append(len(tokens))
            first.append(len(offsets) - 1)
        return cls(tokens, offsets, first)

    @classmethod
    def from_marked(cls, documents: Sequence[bytes], end_mark: int = -1) -> DocumentPool:
        """From documents as the bytes of C int arrays, each sentence's ids followed by
        ``end_mark`` (``Tokenizer.encode_document_bytes``): all documents decoded at once, and
        sentences without tokens dropped (as the reference drops empty lines)."""
        import numpy as np

        ids = np.frombuffer(b"".join(documents), dtype=np.intc)
        is_mark = ids == end_mark
        ends = np.flatnonzero(is_mark)
        lengths = np.diff(ends, prepend=-1) - 1
        keep = lengths > 0
        # sentences (kept ones) before each document's first element
        doc_starts = np.zeros(len(documents), dtype=np.int64)
        np.cumsum([len(d) // ids.itemsize for d in documents[:-1]], out=doc_starts[1:])
        kept_before = np.concatenate([[0], np.cumsum(keep)])
        first = kept_before[np.searchsorted(ends, doc_starts)].tolist() + [int(keep.sum())]
        offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
        np.cumsum(lengths[keep], out=offsets[1:])
        return cls(ids[~is_mark].astype(np.int32), offsets.tolist(), first)


Span = tuple[int, int, int, int, int]  # (a0, a1, b0, b1, next_sentence_label): token ranges of A and B


def pair_spans(
    pool: DocumentPool, document_index: int, max_seq_length: int, short_seq_prob: float,
    rng: random.Random,
) -> list[Span]:
    """The MLM + NSP pairs of one document (one pass) as token ranges of ``pool`` (the rules of
    the module docstring; truncation included). ``pool`` is where random-next B segments come
    from: the whole corpus in the reference, the document's bucket in Beam."""
    off, first = pool.sentence_offsets, pool.doc_first
    n_docs = len(first) - 1
    max_num_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    target_seq_length = _target_seq_length(max_num_tokens, short_seq_prob, rng)
    start, end = first[document_index], first[document_index + 1]
    uniform, random_bits = rng.random, rng.getrandbits

    # Segments are whole sentences, never an arbitrary split point, which would make the
    # next-sentence task too easy. A chunk is sentences chunk_start..i, where i is the first
    # sentence that brings it to the target (a bisect over the offsets, not a loop), or the last.
    spans: list[Span] = []
    chunk_start = start
    while chunk_start < end:
        i = bisect_left(off, off[chunk_start] + target_seq_length, chunk_start + 1, end) - 1
        n_chunk = i + 1 - chunk_start
        # randint(1, n_chunk - 1) and friends as int(random() * n): uniform to within 2**-53
        a_end = 1 + int(uniform() * (n_chunk - 1)) if n_chunk >= 2 else 1
        a0, a1 = off[chunk_start], off[chunk_start + a_end]
        if n_chunk == 1 or uniform() < 0.5:
            label = RANDOM_NEXT
            target_b_length = target_seq_length - (a1 - a0)
            # Ten tries at another document; a one-document pool falls back to itself.
            for _ in range(10):
                random_document_index = int(uniform() * n_docs)
                if random_document_index != document_index:
                    break
            r_start, r_end = first[random_document_index], first[random_document_index + 1]
            j = r_start + int(uniform() * (r_end - r_start))  # the random start sentence
            # B: sentences j.. until it reaches target_b_length (at least one) or the document ends
            b0 = off[j]
            b1 = off[bisect_left(off, b0 + target_b_length, j + 1, r_end)]
            # The chunk's sentences after A were not used: put them back.
            i = chunk_start + a_end - 1
        else:
            label = ACTUAL_NEXT
            b0, b1 = a1, off[i + 1]
        if a1 - a0 + b1 - b0 > max_num_tokens:  # truncate_spans, inline (it runs for most pairs)
            removed_a, removed_b = trim_counts(a1 - a0, b1 - b0, max_num_tokens)
            front_a = random_bits(removed_a).bit_count() if removed_a else 0
            front_b = random_bits(removed_b).bit_count() if removed_b else 0
            a0, a1 = a0 + front_a, a1 - (removed_a - front_a)
            b0, b1 = b0 + front_b, b1 - (removed_b - front_b)
        if a1 <= a0 or b1 <= b0:  # the reference asserts; only an empty sentence gets here
            raise ValueError(
                f"document {document_index}: empty segment (a={a1 - a0}, b={b1 - b0}); "
                "documents must not contain sentences without tokens"
            )
        spans.append((a0, a1, b0, b1, label))
        chunk_start = i + 1
    return spans


def packed_spans(
    pool: DocumentPool, document_index: int, max_seq_length: int, short_seq_prob: float,
    rng: random.Random,
) -> list[Span]:
    """No NSP (RoBERTa's DOC-SENTENCES): whole consecutive sentences packed up to the target
    length as one segment (B empty, label ``NO_NSP``). A sentence longer than the limit alone is
    trimmed front or back like :func:`truncate_spans`; nothing crosses a document boundary."""
    off, first = pool.sentence_offsets, pool.doc_first
    max_num_tokens = max_seq_length - 2  # [CLS], [SEP]
    target_seq_length = _target_seq_length(max_num_tokens, short_seq_prob, rng)
    start, end = first[document_index], first[document_index + 1]
    spans: list[Span] = []
    if start == end:
        return spans
    chunk_start = start
    for s in range(start + 1, end + 1):
        # emit the chunk when the next sentence would overflow it (or the document ends)
        if s == end or off[s + 1] - off[chunk_start] > target_seq_length:
            a0, a1, _, _ = truncate_spans(off[chunk_start], off[s], 0, 0, max_num_tokens, rng)
            spans.append((a0, a1, 0, 0, NO_NSP))
            chunk_start = s
    return spans
