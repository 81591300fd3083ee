"""Masked-LM + next-sentence instances from documents of tokenized sentences.

    bertpipe instances --corpus CORPUS_URI --vocab VOCAB_URI --output OUT_URI
    (beam_jobs/create_instances.py runs bert_core.instances.batch.create_instance_batch, which
    calls pair_spans / packed_spans here once per document, pass and length)

The algorithm of google-research/bert's ``create_pretraining_data.py``, rule by rule, on token
ids instead of token strings. Same rules, same distributions, fewer draws (so one seed gives
instances distributed like the reference's, not the very same ones):

- per document and pass: ``target_seq_length = max_seq_length - 3``, or with probability
  ``short_seq_prob`` a random length in ``[2, max_seq_length - 3]``;
- chunks of whole sentences grow until they reach the target (or the document ends);
  ``a_end`` is random in ``[1, len(chunk) - 1]`` (1 for a one-sentence chunk);
- with probability 0.5 (always for a one-sentence chunk) B is read from a random *other*
  document starting at a random sentence, and the chunk's unused sentences are put back;
- :func:`truncate_seq_pair` trims the longer side, front or back with probability 0.5: which
  side loses how many tokens depends only on the lengths (:func:`trim_counts`), and how many of
  them come off the front is one Binomial(n, 1/2) draw instead of n coin flips;
- ``[CLS] A [SEP] B [SEP]``, then :func:`create_masked_lm_predictions`: candidates are all
  tokens but ``[CLS]``/``[SEP]`` (whole-word groups of ``##`` pieces with ``whole_word_mask``),
  ``num_to_predict = min(max_predictions_per_seq, max(1, round(len * masked_lm_prob)))``,
  80% ``[MASK]`` / 10% unchanged / 10% a random id from the whole vocab, positions sorted.

Why spans: a segment of consecutive whole sentences is a token range of the document, so
:func:`pair_spans` decides a pair with a few integers and draws (chunk ends found by bisecting
the sentence offsets of a :class:`DocumentPool`) and copies no token; the job then builds and
masks whole batches of pairs with numpy (``bert_core.instances.batch``), which made instance
creation several times cheaper than a Python loop per instance. :func:`create_instances_from_document`
keeps the one-instance-at-a-time form (tests, small tools) on the same spans.

``next_sentence_prediction: false`` (RoBERTa's ablation) uses :func:`packed_spans` /
:func:`create_packed_instances_from_document` instead: whole sentences packed up to the target
length as one segment, no B, ``next_sentence_label = -1``.

Every function takes its RNG; :func:`rng_for` derives one from ``(seed, doc_id, dupe_index, ...)``
so the output never depends on which worker ran a document, or in what order.
"""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    def from_tokenizer(cls, tokenizer) -> VocabIds:  # noqa: ANN001 - bert_core.vocab.tokenization.Tokenizer
        subwords = frozenset(i for t, i in tokenizer.vocab.items() if t.startswith("##"))
        return cls(tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id, tokenizer.vocab_size, subwords)


@dataclass
class Instance:
    """One row of the instances contract (unpadded; segment ids are 0 before ``len_a``, 1 after)."""

    input_ids: list[int]
    len_a: int  # tokens of [CLS] A [SEP]; == len(input_ids) when there is no B
    masked_lm_positions: list[int]
    masked_lm_ids: list[int]
    next_sentence_label: int  # 1 = random next, 0 = actual next, -1 = no NSP


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
    return bin(rng.getrandbits(removed)).count("1") if removed else 0


def truncate_seq_pair(
    tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: random.Random
) -> None:
    """Trim the pair in place to ``max_num_tokens``: always the longer side (B on a tie), from the
    front or the back with probability 0.5 each, so neither end of a segment is favoured.

    Same distribution as the reference's token-by-token loop, in two draws (:func:`trim_counts`,
    :func:`_front_removals`); the job trims spans the same way (:func:`_trimmed`).
    """
    removed_a, removed_b = trim_counts(len(tokens_a), len(tokens_b), max_num_tokens)
    for tokens, removed in ((tokens_a, removed_a), (tokens_b, removed_b)):
        front = _front_removals(removed, rng)
        del tokens[:front]
        del tokens[len(tokens) - (removed - front):]


def _trimmed(a0: int, a1: int, b0: int, b1: int, max_num_tokens: int,
             rng: random.Random) -> tuple[int, int, int, int]:
    """:func:`truncate_seq_pair` on token ranges ``[a0, a1)`` and ``[b0, b1)``."""
    if a1 - a0 + b1 - b0 <= max_num_tokens:
        return a0, a1, b0, b1
    removed_a, removed_b = trim_counts(a1 - a0, b1 - b0, max_num_tokens)
    front_a = _front_removals(removed_a, rng)
    front_b = _front_removals(removed_b, rng)
    return a0 + front_a, a1 - (removed_a - front_a), b0 + front_b, b1 - (removed_b - front_b)


def create_masked_lm_predictions(
    input_ids: Sequence[int],
    masked_lm_prob: float,
    max_predictions_per_seq: int,
    vocab: VocabIds,
    rng: random.Random,
    whole_word_mask: bool = False,
) -> tuple[list[int], list[int], list[int]]:
    """Choose the positions to predict and corrupt them: ``(output_ids, positions, labels)``.

    Also the loader's dynamic masking (``masking: dynamic``), applied each epoch.

    The reference shuffles every candidate and then walks the list until the budget is spent.
    We draw the same uniformly random order lazily (a forward Fisher-Yates, one draw per
    candidate looked at), which stops after about ``num_to_predict`` draws instead of shuffling
    all of them: the same distribution of instances, not the same draws.
    """
    cls_id, sep_id = vocab.cls_id, vocab.sep_id
    if whole_word_mask:
        # a "##" piece joins the group of the word it continues
        groups: list[list[int]] = []
        subword_ids = vocab.subword_ids
        for i, token in enumerate(input_ids):
            if token == cls_id or token == sep_id:
                continue
            if groups and token in subword_ids:
                groups[-1].append(i)
            else:
                groups.append([i])
        candidates: list = groups
    else:
        candidates = [i for i, token in enumerate(input_ids) if token != cls_id and token != sep_id]

    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(input_ids) * masked_lm_prob))))
    output_ids = list(input_ids)
    positions: list[int] = []
    n = len(candidates)
    k = 0
    # Groups never overlap, so the reference's "already covered" check can never fire here.
    while k < n and len(positions) < num_to_predict:
        pick = k + int(rng.random() * (n - k))
        candidates[k], candidates[pick] = candidates[pick], candidates[k]
        chosen = candidates[k]
        k += 1
        if whole_word_mask:
            # a whole word that would overshoot the budget is skipped, not split
            if len(positions) + len(chosen) > num_to_predict:
                continue
        else:
            chosen = (chosen,)
        for index in chosen:
            if rng.random() < 0.8:
                output_ids[index] = vocab.mask_id
            elif rng.random() < 0.5:
                pass  # 10%: keep the original token (it is still predicted)
            else:
                output_ids[index] = rng.randint(0, vocab.vocab_size - 1)
            positions.append(index)

    positions.sort()
    return output_ids, positions, [input_ids[p] for p in positions]


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
    def from_arrays(cls, documents: Sequence[tuple[Sequence[int], Sequence[int]]]) -> DocumentPool:
        """From ``(tokens, sentence_lengths)`` per document (numpy arrays, as the job carries them)."""
        import numpy as np

        lengths = [np.asarray(n, dtype=np.int64) for _, n in documents]
        offsets = np.zeros(sum(len(n) for n in lengths) + 1, dtype=np.int64)
        if len(offsets) > 1:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        first = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum([len(n) for n in lengths], out=first[1:])
        tokens = (np.concatenate([np.asarray(t, dtype=np.int32) for t, _ in documents])
                  if documents else np.zeros(0, np.int32))
        return cls(tokens, offsets.tolist(), first.tolist())


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
    uniform = rng.random

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
        a0, a1, b0, b1 = _trimmed(a0, a1, b0, b1, max_num_tokens, rng)
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
    trimmed front or back like :func:`truncate_seq_pair`; nothing crosses a document boundary."""
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
            a0, a1, _, _ = _trimmed(off[chunk_start], off[s], 0, 0, max_num_tokens, rng)
            spans.append((a0, a1, 0, 0, NO_NSP))
            chunk_start = s
    return spans


def span_instance(pool: DocumentPool, span: Span, vocab: VocabIds) -> tuple[list[int], int]:
    """``[CLS] A [SEP] (B [SEP])`` of one span: ``(input_ids, len_a)``."""
    a0, a1, b0, b1, label = span
    tokens = pool.tokens
    input_ids = [vocab.cls_id, *(int(t) for t in tokens[a0:a1]), vocab.sep_id]
    len_a = len(input_ids)
    if label != NO_NSP:
        input_ids += [*(int(t) for t in tokens[b0:b1]), vocab.sep_id]
    return input_ids, len_a


def _instances_of_spans(pool: DocumentPool, spans: list[Span], masked_lm_prob: float,
                        max_predictions_per_seq: int, vocab: VocabIds, rng: random.Random,
                        whole_word_mask: bool, mask: bool) -> list[Instance]:
    instances = []
    for span in spans:
        input_ids, len_a = span_instance(pool, span, vocab)
        positions: list[int] = []
        labels: list[int] = []
        if mask:
            input_ids, positions, labels = create_masked_lm_predictions(
                input_ids, masked_lm_prob, max_predictions_per_seq, vocab, rng, whole_word_mask)
        instances.append(Instance(input_ids, len_a, positions, labels, span[4]))
    return instances


def create_instances_from_document(
    all_documents: Sequence[Document] | DocumentPool,
    document_index: int,
    max_seq_length: int,
    short_seq_prob: float,
    masked_lm_prob: float,
    max_predictions_per_seq: int,
    vocab: VocabIds,
    rng: random.Random,
    whole_word_mask: bool = False,
    mask: bool = True,
) -> list[Instance]:
    """MLM + NSP instances of one document (one pass), one at a time: :func:`pair_spans`, then
    :func:`create_masked_lm_predictions` with the same ``rng``. ``all_documents`` (documents or
    a :class:`DocumentPool`, which saves rebuilding it per call) is where random-next B
    segments come from. The job makes the same pairs and masks whole batches with numpy
    (``bert_core.instances.batch``)."""
    pool = all_documents if isinstance(all_documents, DocumentPool) else DocumentPool.from_documents(all_documents)
    spans = pair_spans(pool, document_index, max_seq_length, short_seq_prob, rng)
    return _instances_of_spans(pool, spans, masked_lm_prob, max_predictions_per_seq, vocab, rng,
                               whole_word_mask, mask)


def create_packed_instances_from_document(
    document: Document,
    max_seq_length: int,
    short_seq_prob: float,
    masked_lm_prob: float,
    max_predictions_per_seq: int,
    vocab: VocabIds,
    rng: random.Random,
    whole_word_mask: bool = False,
    mask: bool = True,
) -> list[Instance]:
    """No NSP: :func:`packed_spans` of one document, masked like
    :func:`create_instances_from_document`."""
    pool = DocumentPool.from_documents([document])
    spans = packed_spans(pool, 0, max_seq_length, short_seq_prob, rng)
    return _instances_of_spans(pool, spans, masked_lm_prob, max_predictions_per_seq, vocab, rng,
                               whole_word_mask, mask)
