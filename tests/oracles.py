"""Test oracles: google-research/bert's ``create_pretraining_data.py``, one instance at a time.

    from oracles import create_instances_from_document   (tests/ is on the test path)

The reference's loops, transcribed on token ids instead of token strings, with its draws in its
order: the full shuffle of the candidates, one coin per truncated token, ``randint`` for every
choice. The library (``bert_core.instances``) follows the same rules with fewer draws, so the
tests compare distributions of the two, not instances. Packing without NSP (RoBERTa's
DOC-SENTENCES) has no reference script; :func:`create_packed_instances_from_document` is the
plain loop of its rule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bert_core.instances.pairs import NO_NSP, VocabIds

Document = Sequence[Sequence[int]]


@dataclass
class Instance:
    """One row of the instances contract (unpadded; segment ids are 0 before ``len_a``, 1 after)."""

    input_ids: list[int]
    len_a: int
    masked_lm_positions: list[int]
    masked_lm_ids: list[int]
    next_sentence_label: int  # 1 = random next, 0 = actual next, -1 = no NSP


def truncate_seq_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int,
                      rng: random.Random) -> None:
    """The reference's loop: one token at a time off the longer side (B on a tie), front or
    back by a coin."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        assert len(trunc_tokens) >= 1
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


def create_masked_lm_predictions(tokens: Sequence[int], masked_lm_prob: float,
                                 max_predictions_per_seq: int, vocab: VocabIds, rng: random.Random,
                                 whole_word_mask: bool = False) -> tuple[list[int], list[int], list[int]]:
    """The reference's masking: ``(output_ids, positions, labels)``."""
    cand_indexes: list[list[int]] = []
    for i, token in enumerate(tokens):
        if token in (vocab.cls_id, vocab.sep_id):
            continue
        if whole_word_mask and cand_indexes and token in vocab.subword_ids:
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
    rng.shuffle(cand_indexes)
    output_tokens = list(tokens)
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))
    masked: list[int] = []
    covered: set[int] = set()
    for index_set in cand_indexes:
        if len(masked) >= num_to_predict:
            break
        if len(masked) + len(index_set) > num_to_predict:
            continue
        if any(index in covered for index in index_set):
            continue
        for index in index_set:
            covered.add(index)
            if rng.random() < 0.8:
                output_tokens[index] = vocab.mask_id
            elif rng.random() < 0.5:
                output_tokens[index] = tokens[index]
            else:
                output_tokens[index] = rng.randint(0, vocab.vocab_size - 1)
            masked.append(index)
    masked.sort()
    return output_tokens, masked, [tokens[i] for i in masked]


def _target_seq_length(max_num_tokens: int, short_seq_prob: float, rng: random.Random) -> int:
    if rng.random() < short_seq_prob:
        return rng.randint(2, max_num_tokens)
    return max_num_tokens


def _instance(tokens_a: list[int], tokens_b: list[int] | None, label: int, masked_lm_prob: float,
              max_predictions_per_seq: int, vocab: VocabIds, rng: random.Random,
              whole_word_mask: bool, mask: bool) -> Instance:
    tokens = [vocab.cls_id, *tokens_a, vocab.sep_id]
    len_a = len(tokens)
    if tokens_b is not None:
        tokens += [*tokens_b, vocab.sep_id]
    positions: list[int] = []
    labels: list[int] = []
    if mask:
        tokens, positions, labels = create_masked_lm_predictions(
            tokens, masked_lm_prob, max_predictions_per_seq, vocab, rng, whole_word_mask)
    return Instance(tokens, len_a, positions, labels, label)


def create_instances_from_document(
    all_documents: Sequence[Document], document_index: int, max_seq_length: int,
    short_seq_prob: float, masked_lm_prob: float, max_predictions_per_seq: int, vocab: VocabIds,
    rng: random.Random, whole_word_mask: bool = False, mask: bool = True,
) -> list[Instance]:
    """The reference's MLM + NSP instances of one document (one pass)."""
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = _target_seq_length(max_num_tokens, short_seq_prob, rng)
    instances = []
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
                    label = 1
                    target_b_length = target_seq_length - len(tokens_a)
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
                    i -= len(current_chunk) - a_end  # put the unused sentences back
                else:
                    label = 0
                    tokens_b = [t for sentence in current_chunk[a_end:] for t in sentence]
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                assert tokens_a and tokens_b
                instances.append(_instance(tokens_a, tokens_b, label, masked_lm_prob,
                                           max_predictions_per_seq, vocab, rng, whole_word_mask, mask))
            current_chunk = []
            current_length = 0
        i += 1
    return instances


def create_packed_instances_from_document(
    document: Document, max_seq_length: int, short_seq_prob: float, masked_lm_prob: float,
    max_predictions_per_seq: int, vocab: VocabIds, rng: random.Random,
    whole_word_mask: bool = False, mask: bool = True,
) -> list[Instance]:
    """No NSP: consecutive whole sentences packed while they fit the target, a sentence longer
    than the limit alone trimmed like :func:`truncate_seq_pair`."""
    max_num_tokens = max_seq_length - 2
    target_seq_length = _target_seq_length(max_num_tokens, short_seq_prob, rng)
    instances = []
    chunk: list[int] = []
    for k, sentence in enumerate(document):
        chunk.extend(sentence)
        following = document[k + 1] if k + 1 < len(document) else None
        if following is None or len(chunk) + len(following) > target_seq_length:
            truncate_seq_pair(chunk, [], max_num_tokens, rng)
            instances.append(_instance(chunk, None, NO_NSP, masked_lm_prob, max_predictions_per_seq,
                                       vocab, rng, whole_word_mask, mask))
            chunk = []
    return instances
