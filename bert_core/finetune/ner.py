"""NER on CoNLL-2003 column files: reader, first-word-piece labelling, conlleval F1.

    bertpipe finetune --task ner --data conll2003 --checkpoint runs/demo/hf --output finetune/demo

As in the paper, each word's label sits on its first word piece; the other pieces take no loss.
Sentences longer than the sequence are split at word boundaries, never truncated.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bert_core import storage
from bert_core.finetune import conlleval
from bert_core.finetune.errors import TaskFileMissing
from bert_core.finetune.heads import IGNORE_INDEX

Sentence = tuple[list[str], list[str]]  # words, tags

FILE_NAMES = {"train": ("train.txt", "eng.train"), "valid": ("valid.txt", "eng.testa", "dev.txt"),
              "test": ("test.txt", "eng.testb")}


def read_conll(uri: str) -> tuple[list[Sentence], list[dict[str, Any]]]:
    """Sentences ``(words, tags)`` and one reject per dropped sentence (kept + rejected = read).

    A sentence with any line whose last column is not ``O``, ``B-TYPE`` or ``I-TYPE`` is dropped
    whole; its reject names the first such line (``id`` = line number).

    Files: ``<folder>/train.txt`` and ``valid.txt`` (``eng.train`` / ``eng.testa`` also work), one
    token per line ``word POS chunk NER`` (any number of columns; the tag is the last), blank lines
    between sentences, ``-DOCSTART-`` lines between documents. Tags may be IOB1 (CoNLL-2003 as
    published) or IOB2.
    """
    sentences: list[Sentence] = []
    rejects: list[dict[str, Any]] = []
    words: list[str] = []
    tags: list[str] = []
    bad: list[tuple[int, str]] = []  # (line number, line) of the sentence's bad lines

    def flush() -> None:
        nonlocal words, tags, bad
        if bad:
            # The whole sentence goes: a sentence with a hole would train on wrong neighbours.
            n, line = bad[0]
            more = f" ({len(bad)} bad lines in this sentence)" if len(bad) > 1 else ""
            rejects.append({"source": uri, "id": n, "reason": "bad_tag",
                            "detail": f"{line!r}: last column must be O, B-TYPE or I-TYPE{more}"})
        elif words:
            sentences.append((words, tags))
        words, tags, bad = [], [], []

    for n, line in enumerate(storage.read_text(uri).splitlines(), 1):
        fields = line.split()
        if not fields:
            flush()
            continue
        if fields[0] == "-DOCSTART-":
            flush()
            continue
        tag = fields[-1]
        if len(fields) < 2 or not (tag == "O" or tag[:2] in ("B-", "I-")):
            bad.append((n, line))
            continue
        words.append(fields[0])
        tags.append(tag)
    flush()
    return sentences, rejects


def to_iob2(tags: list[str]) -> list[str]:
    """IOB1 -> IOB2: an I- that starts a chunk becomes B-.

    Training uses IOB2, which names the same chunks, so conlleval's score is unchanged.
    """
    out = []
    prev = "O"
    for tag in tags:
        if tag.startswith("I-") and (prev == "O" or prev[2:] != tag[2:]):
            tag = "B-" + tag[2:]
        out.append(tag)
        prev = tag
    return out


def chunks(tags: list[str]) -> list[tuple[str, int, int]]:
    """The entities one sentence's tags name: ``(type, first word, last word + 1)``, found as
    conlleval.pl finds chunks (IOB1 or IOB2; an ``I-`` after ``O`` opens one)."""
    out: list[tuple[str, int, int]] = []
    start, prev_tag, prev_type = None, "O", ""
    for i, tag in enumerate([*tags, "O"]):
        prefix, kind = tag.split("-", 1) if "-" in tag else (tag, "")
        if start is not None and conlleval.end_of_chunk(prev_tag, prefix, prev_type, kind):
            out.append((prev_type, start, i))
            start = None
        if conlleval.start_of_chunk(prev_tag, prefix, prev_type, kind):
            start = i
        prev_tag, prev_type = prefix, kind
    return out


def _find(folder: str, split: str) -> str:
    for name in FILE_NAMES.get(split, (f"{split}.txt",)):
        uri = storage.join(folder, name)
        if storage.exists(uri):
            return uri
    raise TaskFileMissing(
        f"{folder}: no {split} file ({' or '.join(FILE_NAMES.get(split, (split,)))}); "
        "expected CoNLL-2003 column files"
    )


def encode_sentences(
    sentences: list[Sentence], tokenizer: Any, label_ids: dict[str, int], max_seq_length: int
) -> list[dict[str, Any]]:
    """Features ``[CLS] pieces [SEP]`` with the label on each word's first piece."""
    budget = max_seq_length - 2
    features = []
    for s_index, (words, tags) in enumerate(sentences):
        pieces = [p or [tokenizer.unk_id] for p in tokenizer.encode_words(words)]
        start = 0
        while start < len(words):
            ids, labels, firsts = [tokenizer.cls_id], [IGNORE_INDEX], []
            end = start
            while end < len(words) and (len(ids) - 1 + len(pieces[end]) <= budget or end == start):
                word_pieces = pieces[end][:budget]  # one absurdly long word: keep its first pieces
                firsts.append(len(ids))
                labels += [label_ids.get(tags[end], IGNORE_INDEX)] + [IGNORE_INDEX] * (len(word_pieces) - 1)
                ids += word_pieces
                end += 1
            ids.append(tokenizer.sep_id)
            labels.append(IGNORE_INDEX)
            features.append({"input_ids": ids, "token_type_ids": [0] * len(ids), "label": labels,
                             "sentence": s_index, "first_word": start, "firsts": firsts})
            start = end
    return features


def prepare(folder: str, tokenizer: Any, cfg: Any, splits: tuple[str, ...] = ("valid",)) -> Any:
    from bert_core.finetune.data import TaskData

    data: dict[str, list[Sentence]] = {}
    counts, rejects = {}, []
    schemes = set()
    for split in ("train", *splits):
        sentences, bad = read_conll(_find(folder, split))
        if split == "train" and cfg.max_train_examples:
            sentences = sentences[: cfg.max_train_examples]
        converted = [(w, to_iob2(t)) for w, t in sentences]
        if any(t != c for (_, t), (_, c) in zip(sentences, converted, strict=True)):
            schemes.add("IOB1")
        data[split] = converted
        counts[f"{split}_sentences"] = len(converted)
        counts[f"{split}_rejected"] = len(bad)
        rejects += bad
    labels = ["O"] + sorted({t for _, tags in data["train"] for t in tags} - {"O"})
    label_ids = {t: i for i, t in enumerate(labels)}
    encoded = {s: encode_sentences(data[s], tokenizer, label_ids, cfg.max_seq_length) for s in data}

    def finish(split: str, outputs: list[Any]) -> tuple[dict[str, float], dict[str, Any]]:
        sentences = data[split]
        preds = [["O"] * len(words) for words, _ in sentences]
        for f, logits in zip(encoded[split], outputs, strict=True):
            best = np.asarray(logits).argmax(-1)
            for k, pos in enumerate(f["firsts"]):
                preds[f["sentence"]][f["first_word"] + k] = labels[int(best[pos])]
        result = conlleval.evaluate([t for _, t in sentences], preds)
        per_type = result.pop("per_type")
        result.update({f"{t}_f1": v["f1"] for t, v in per_type.items()})
        lines = []
        for (words, gold), guess in zip(sentences, preds, strict=True):
            lines += [f"{w} {g} {p}" for w, g, p in zip(words, gold, guess, strict=True)] + [""]
        # conlleval.pl's input format: `perl conlleval.pl < valid_predictions.txt`
        return result, {f"{split}_predictions.txt": "\n".join(lines) + "\n"}

    counts["iob1_input"] = int("IOB1" in schemes)
    return TaskData(kind="token", num_labels=len(labels), train=encoded["train"],
                    evals={s: encoded[s] for s in splits}, finish=finish,
                    counts=counts, rejects=rejects, labels=tuple(labels))
