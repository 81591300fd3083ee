"""Masked-LM + next-sentence instances from documents of tokenized sentences.

    bertpipe instances --corpus CORPUS_URI --vocab VOCAB_URI --output OUT_URI
    (beam_jobs/create_instances.py calls these functions once per document, pass and length)

The algorithm of google-research/bert's ``create_pretraining_data.py``, rule by rule, on token
ids instead of token strings. Pair creation and truncation make the reference's draws in the
reference's order; masking picks from the same distribution with fewer draws (see
:func:`create_masked_lm_predictions`), so one seed gives instances distributed like the
reference's, not the very same ones:

- per document and pass: ``target_seq_length = max_seq_length - 3``, or with probability
  ``short_seq_prob`` a random length in ``[2, max_seq_length - 3]``;
- chunks of whole sentences grow until they reach the target (or the document ends);
  ``a_end`` is random in ``[1, len(chunk) - 1]`` (1 for a one-sentence chunk);
- with probability 0.5 (always for a one-sentence chunk) B is read from a random *other*
  document starting at a random sentence, and the chunk's unused sentences are put back;
- :func:`truncate_seq_pair` trims the longer side, front or back with probability 0.5;
- ``[CLS] A [SEP] B [SEP]``, then :func:`create_masked_lm_predictions`: candidates are all
  tokens but ``[CLS]``/``[SEP]`` (whole-word groups of ``##`` pieces with ``whole_word_mask``),
  ``num_to_predict = min(max_predictions_per_seq, max(1, round(len * masked_lm_prob)))``,
  80% ``[MASK]`` / 10% unchanged / 10% a random id from the whole vocab, positions sorted.

``next_sentence_prediction: false`` (RoBERTa's ablation) uses
:func:`create_packed_instances_from_document` instead: whole sentences packed up to the target
length as one segment, no B, ``next_sentence_label = -1``.

Every function takes its RNG; :func:`rng_for` derives one from ``(seed, doc_id, dupe_index, ...)``
so the output never depends on which worker ran a document, or in what order.
"""

from __future__ import annotations

import hashlib
import random
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
    def from_tokenizer(cls, tokenizer) -> VocabIds:  # noqa: ANN001 - bert_core.tokenization.Tokenizer
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


def truncate_seq_pair(
    tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: random.Random
) -> None:
    """Trim the pair in place to ``max_num_tokens``: always the longer side (B on a tie), from the
    front or the back with probability 0.5 each, so neither end of a segment is favoured."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


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


def _finish(
    tokens_a: list[int],
    tokens_b: list[int] | None,
    next_sentence_label: int,
    masked_lm_prob: float,
    max_predictions_per_seq: int,
    vocab: VocabIds,
    rng: random.Random,
    whole_word_mask: bool,
    mask: bool,
) -> Instance:
    """``[CLS] A [SEP] (B [SEP])``, masked now (static) or left for the loader (dynamic)."""
    input_ids = [vocab.cls_id, *tokens_a, vocab.sep_id]
    len_a = len(input_ids)
    if tokens_b is not None:
        input_ids += [*tokens_b, vocab.sep_id]
    positions: list[int] = []
    labels: list[int] = []
    if mask:
        input_ids, positions, labels = create_masked_lm_predictions(
            input_ids, masked_lm_prob, max_predictions_per_seq, vocab, rng, whole_word_mask
        )
    return Instance(input_ids, len_a, positions, labels, next_sentence_label)


def _target_seq_length(max_num_tokens: int, short_seq_prob: float, rng: random.Random) -> int:
    # Mostly fill the sequence (padding is wasted compute), sometimes shorter so pre-training
    # also sees the short inputs of fine-tuning. A rough target; max_seq_length is the hard limit.
    if rng.random() < short_seq_prob:
        return rng.randint(2, max_num_tokens)
    return max_num_tokens


def create_instances_from_document(
    all_documents: Sequence[Document],
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
    """MLM + NSP instances of one document (one pass). ``all_documents`` is where random-next B
    segments come from (the whole corpus in the reference, the document's bucket in Beam)."""
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    target_seq_length = _target_seq_length(max_num_tokens, short_seq_prob, rng)

    # Segments are whole sentences, never an arbitrary split point, which would make the
    # next-sentence task too easy.
    instances: list[Instance] = []
    current_chunk: list[Sequence[int]] = []
    current_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = rng.randint(1, len(current_chunk) - 1)
                tokens_a = [t for sentence in current_chunk[:a_end] for t in sentence]

                tokens_b: list[int] = []
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    label = RANDOM_NEXT
                    target_b_length = target_seq_length - len(tokens_a)
                    # Ten tries at another document; a one-document pool falls back to itself.
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    # The chunk's sentences after A were not used: put them back.
                    i -= len(current_chunk) - a_end
                else:
                    label = ACTUAL_NEXT
                    for sentence in current_chunk[a_end:]:
                        tokens_b.extend(sentence)
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                if not tokens_a or not tokens_b:  # the reference asserts; only an empty sentence gets here
                    raise ValueError(
                        f"document {document_index}: empty segment (a={len(tokens_a)}, b={len(tokens_b)}); "
                        "documents must not contain sentences without tokens"
                    )
                instances.append(
                    _finish(tokens_a, tokens_b, label, masked_lm_prob, max_predictions_per_seq,
                            vocab, rng, whole_word_mask, mask)
                )
            current_chunk = []
            current_length = 0
        i += 1
    return instances


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
    """No NSP (RoBERTa's DOC-SENTENCES): whole consecutive sentences packed up to the target length
    as one segment ``[CLS] A [SEP]``. A sentence longer than the limit alone is trimmed front or
    back like :func:`truncate_seq_pair`; nothing crosses a document boundary."""
    max_num_tokens = max_seq_length - 2  # [CLS], [SEP]
    target_seq_length = _target_seq_length(max_num_tokens, short_seq_prob, rng)
    instances: list[Instance] = []
    chunk: list[int] = []
    for sentence in document:
        if chunk and len(chunk) + len(sentence) > target_seq_length:
            instances.append(_pack(chunk, max_num_tokens, masked_lm_prob, max_predictions_per_seq,
                                   vocab, rng, whole_word_mask, mask))
            chunk = []
        chunk.extend(sentence)
    if chunk:
        instances.append(_pack(chunk, max_num_tokens, masked_lm_prob, max_predictions_per_seq,
                               vocab, rng, whole_word_mask, mask))
    return instances


def _pack(chunk: list[int], max_num_tokens: int, masked_lm_prob: float, max_predictions_per_seq: int,
          vocab: VocabIds, rng: random.Random, whole_word_mask: bool, mask: bool) -> Instance:
    truncate_seq_pair(chunk, [], max_num_tokens, rng)
    return _finish(chunk, None, NO_NSP, masked_lm_prob, max_predictions_per_seq, vocab, rng,
                   whole_word_mask, mask)
