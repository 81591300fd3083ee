"""GLUE tasks (TSV as distributed by GLUE) and the real ``sentiment`` sample: readers + metrics.

Each reader returns ``(examples, rejects)``: a malformed line never stops a run and is never
dropped silently (``kept + rejected = read``). Single sentences and pairs are encoded as
``[CLS] A [SEP] B [SEP]`` by :func:`encode_pairs`.

    bertpipe finetune --task mrpc --data glue_data --checkpoint runs/demo/hf --output finetune/demo
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from bert_core import storage
from bert_core.finetune import metrics as M
from bert_core.finetune.errors import TaskDataError, TaskFileMissing


@dataclass(frozen=True)
class Example:
    guid: str
    text_a: str
    text_b: str | None
    label: Any  # str class name, or float for STS-B


@dataclass(frozen=True)
class Reject:
    file: str
    line: int
    reason: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.file, "id": self.line, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True)
class GlueSpec:
    """Where a task's columns are: by header name (or index when the file has no header)."""

    folder: str
    labels: tuple[str, ...]  # empty = regression
    text_a: str | int
    text_b: str | int | None
    label: str | int | None  # None: an unlabelled (test) file
    header: bool = True
    dev_files: tuple[str, ...] = ("dev.tsv",)
    index: str | None = None  # the column that names a row (test files); else file-line


GLUE: dict[str, GlueSpec] = {
    "cola": GlueSpec("CoLA", ("0", "1"), 3, None, 1, header=False),
    "sst2": GlueSpec("SST-2", ("0", "1"), "sentence", None, "label"),
    "mrpc": GlueSpec("MRPC", ("0", "1"), "#1 String", "#2 String", "Quality"),
    "stsb": GlueSpec("STS-B", (), "sentence1", "sentence2", "score"),
    "qqp": GlueSpec("QQP", ("0", "1"), "question1", "question2", "is_duplicate"),
    "mnli": GlueSpec(
        "MNLI", ("contradiction", "entailment", "neutral"), "sentence1", "sentence2", "gold_label",
        dev_files=("dev_matched.tsv", "dev_mismatched.tsv"),
    ),
    "qnli": GlueSpec("QNLI", ("entailment", "not_entailment"), "question", "sentence", "label"),
    "rte": GlueSpec("RTE", ("entailment", "not_entailment"), "sentence1", "sentence2", "label"),
    "wnli": GlueSpec("WNLI", ("0", "1"), "sentence1", "sentence2", "label"),
}


def read_tsv(uri: str, spec: GlueSpec) -> tuple[list[Example], list[Reject]]:
    """One GLUE TSV. No quoting (GLUE text contains bare quotes), tab-separated."""
    # MRPC as Microsoft ships it starts with a byte-order mark.
    lines = storage.read_text(uri).lstrip("\ufeff").splitlines()
    examples: list[Example] = []
    rejects: list[Reject] = []
    header: list[str] = []
    if spec.header and lines:
        header, lines = lines[0].split("\t"), lines[1:]
    width = len(header) if header else None

    def column(key: str | int) -> int:
        if isinstance(key, int):
            return key
        if key not in header:
            raise TaskDataError(
                f"{uri}: header has no column {key!r} (has {header}); is this the GLUE "
                f"{spec.folder} file?"
            )
        return header.index(key)

    cols = [column(spec.text_a), column(spec.text_b) if spec.text_b is not None else None,
            column(spec.label) if spec.label is not None else None,
            column(spec.index) if spec.index is not None else None]
    first = 2 if spec.header else 1
    for n, line in enumerate(lines, first):
        if not line.strip():
            continue
        fields = line.split("\t")
        if width is not None and len(fields) != width:
            rejects.append(Reject(uri, n, "bad_columns", f"{len(fields)} columns, header has {width}"))
            continue
        try:
            text_a = fields[cols[0]]
            text_b = fields[cols[1]] if cols[1] is not None else None
            raw = fields[cols[2]].strip() if cols[2] is not None else None
            guid = fields[cols[3]].strip() if cols[3] is not None else f"{uri.rsplit('/', 1)[-1]}-{n}"
        except IndexError:
            rejects.append(Reject(uri, n, "bad_columns", f"only {len(fields)} columns"))
            continue
        if raw is None:
            label: Any = None
        elif spec.labels:
            if raw not in spec.labels:
                rejects.append(Reject(uri, n, "unknown_label", f"{raw!r} not in {spec.labels}"))
                continue
            label = raw
        else:
            try:
                label = float(raw)
            except ValueError:
                rejects.append(Reject(uri, n, "bad_score", f"{raw!r} is not a number"))
                continue
        examples.append(Example(guid, text_a, text_b, label))
    return examples, rejects


def read_glue(task: str, folder: str, split: str) -> tuple[list[Example], list[Reject]]:
    """``split`` is ``train`` or one of the task's dev file stems (``dev``, ``dev_matched``...).

    Files, as in the GLUE download (``<data>/<folder>/``): CoLA, SST-2, MRPC, STS-B, QQP, MNLI
    (``dev_matched.tsv`` + ``dev_mismatched.tsv``), QNLI, RTE, WNLI: ``train.tsv`` and ``dev.tsv``.
    """
    return read_tsv(glue_file(task, folder, split), GLUE[task])


def glue_file(task: str, folder: str, split: str) -> str:
    """The TSV of ``split`` in ``folder``; :class:`TaskFileMissing` when it is not there."""
    spec = GLUE[task]
    uri = storage.join(folder, f"{split}.tsv")
    if not storage.exists(uri):
        raise TaskFileMissing(
            f"{uri} does not exist; put the GLUE {spec.folder} files (train.tsv, "
            f"{', '.join(spec.dev_files)}) in {folder}"
        )
    return uri


# GLUE's test files (labels withheld): submission file name -> test file stem, per task. MNLI's
# diagnostic set (AX) is GLUE's diagnostic/diagnostic.tsv, predicted by the MNLI model.
TEST_FILES: dict[str, dict[str, str]] = {
    "cola": {"CoLA": "test"}, "sst2": {"SST-2": "test"}, "mrpc": {"MRPC": "test"},
    "stsb": {"STS-B": "test"}, "qqp": {"QQP": "test"},
    "mnli": {"MNLI-m": "test_matched", "MNLI-mm": "test_mismatched"},
    "qnli": {"QNLI": "test"}, "rte": {"RTE": "test"}, "wnli": {"WNLI": "test"},
}


def test_spec(task: str) -> GlueSpec:
    """Where a task's test file keeps its columns: a header, the row's ``index`` (QQP: ``id``)
    first, the texts named as in dev (CoLA's test file, unlike its dev file, has a header with
    ``sentence``), no label. AX (``diagnostic.tsv``) reads with MNLI's."""
    spec = GLUE[task]
    text_a, text_b = ("sentence", None) if task == "cola" else (spec.text_a, spec.text_b)
    return replace(spec, text_a=text_a, text_b=text_b, label=None, header=True,
                   index="id" if task == "qqp" else "index")


def read_test(task: str, uri: str) -> tuple[list[Example], list[Reject]]:
    """A GLUE test file: examples whose ``guid`` is the file's index and ``label`` None."""
    return read_tsv(uri, test_spec(task))


# --------------------------------------------------------------------------- sentiment


SENTIMENT_LABELS = ("negative", "positive")


SENTIMENT_PERCENT = {"dev": 15, "test": 15}  # the rest is train


def sentiment_split(key: str) -> str:
    """``train``, ``dev`` or ``test`` for an example id, the same on every machine and run.

    A stable hash of the id puts 15% in dev (selection) and 15% in test (the reported score),
    the rest in train.
    """
    # A stable hash, not Python's salted hash(): the split must be the same on every machine.
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100
    if bucket < SENTIMENT_PERCENT["dev"]:
        return "dev"
    return "test" if bucket < SENTIMENT_PERCENT["dev"] + SENTIMENT_PERCENT["test"] else "train"


def sentiment_files(folder: str) -> list[str]:
    """Every ``*.txt`` in ``folder``; :class:`TaskFileMissing` when there is none."""
    files = storage.glob(storage.join(folder, "*.txt"))
    if not files:
        raise TaskFileMissing(
            f"no *.txt in {folder}; expected vaderSentiment ground-truth files "
            "(`bertpipe samples fetch` puts them in samples/tasks/sentiment)"
        )
    return files


def read_sentiment(folder: str, split: str) -> tuple[list[Example], list[Reject]]:
    """Every ``*.txt`` in ``folder`` (vaderSentiment ``*_GroundTruth.txt``); its train, dev or test part.

    Lines are ``id<TAB>mean rating<TAB>text``; label = sign of the mean rating, and neutral
    (0) ratings are rejected with reason ``neutral``.
    """
    files = sentiment_files(folder)
    if split not in ("train", "dev", "test"):
        raise ValueError(f"sentiment has splits train, dev and test, not {split!r}")
    examples, rejects = [], []
    for uri in files:
        stem = uri.rsplit("/", 1)[-1].split("_")[0]
        for n, line in enumerate(storage.read_text(uri).splitlines(), 1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 3:
                rejects.append(Reject(uri, n, "bad_columns", f"{len(fields)} columns, need 3"))
                continue
            guid = f"{stem}:{fields[0]}"
            if sentiment_split(guid) != split:
                continue
            try:
                rating = float(fields[1])
            except ValueError:
                rejects.append(Reject(uri, n, "bad_rating", f"{fields[1]!r} is not a number"))
                continue
            if rating == 0:
                rejects.append(Reject(uri, n, "neutral", "mean rating 0 has no sentiment sign"))
                continue
            examples.append(Example(guid, "\t".join(fields[2:]), None, SENTIMENT_LABELS[rating > 0]))
    return examples, rejects


# --------------------------------------------------------------------------- encoding + metrics


def encode_pairs(
    tokenizer: Any, examples: Sequence[Example], max_seq_length: int
) -> dict[str, list[list[int]]]:
    """``[CLS] A [SEP] (B [SEP])``, truncating the longer segment first (as run_classifier.py)."""
    a_ids = tokenizer.encode_batch([e.text_a for e in examples])
    b_ids = tokenizer.encode_batch([e.text_b or "" for e in examples])
    out: dict[str, list[list[int]]] = {"input_ids": [], "token_type_ids": []}
    for e, a, b in zip(examples, a_ids, b_ids, strict=True):
        a, b = list(a), list(b) if e.text_b is not None else []
        budget = max_seq_length - (3 if e.text_b is not None else 2)
        while len(a) + len(b) > budget:
            (a if len(a) > len(b) else b).pop()
        ids = [tokenizer.cls_id, *a, tokenizer.sep_id]
        types = [0] * len(ids)
        if e.text_b is not None:
            ids += [*b, tokenizer.sep_id]
            types += [1] * (len(b) + 1)
        out["input_ids"].append(ids)
        out["token_type_ids"].append(types)
    return out


def encode_examples(tokenizer: Any, examples: list[Example], labels: Sequence[str],
                    max_seq_length: int) -> list[dict[str, Any]]:
    """Examples as fine-tuning features: ``input_ids``, ``token_type_ids`` (:func:`encode_pairs`)
    and ``label``, its index in ``labels`` (the value itself when ``labels`` is empty: regression)."""
    enc = encode_pairs(tokenizer, examples, max_seq_length)
    return [{"input_ids": i, "token_type_ids": t, "label": labels.index(e.label) if labels else e.label}
            for i, t, e in zip(enc["input_ids"], enc["token_type_ids"], examples, strict=True)]


def glue_metrics(task: str, labels: Sequence, preds: Sequence) -> dict[str, float]:
    """The paper's metric(s) for a task; ``labels``/``preds`` are class ids or scores (STS-B)."""
    if task == "cola":
        return {"mcc": M.matthews_corrcoef(labels, preds), "accuracy": M.accuracy(labels, preds)}
    if task == "stsb":
        return {"pearson": M.pearson(labels, preds), "spearman": M.spearman(labels, preds)}
    if task in ("mrpc", "qqp"):
        return {"f1": M.f1_binary(labels, preds), "accuracy": M.accuracy(labels, preds)}
    return {"accuracy": M.accuracy(labels, preds)}


def prepare(task: str, folder: str, tokenizer: Any, cfg: Any) -> Any:
    """Read + encode train and dev splits -> :class:`TaskData` (``cfg`` is a FinetuneConfig)."""
    import numpy as np

    from bert_core.finetune import get_task
    from bert_core.finetune.data import TaskData, training_subset

    spec = get_task(task)
    task = spec.base  # a learning-curve point (sentiment@300) reads and scores as its task
    labels = list(SENTIMENT_LABELS) if task == "sentiment" else list(GLUE[task].labels)
    read = (lambda s: read_sentiment(folder, s)) if task == "sentiment" else \
        (lambda s: read_glue(task, folder, s))
    counts: dict[str, int] = {}
    all_rejects: list[dict[str, Any]] = []
    examples: dict[str, list[Example]] = {}
    for split in ("train", *spec.splits):
        ex, rejects = read(split)
        if split == "train":
            ex = training_subset(spec, ex)  # before the cap: the same draw whatever the cap
            ex = ex[: cfg.max_train_examples] if cfg.max_train_examples else ex
        examples[split] = ex
        counts[f"{split}_examples"] = len(ex)
        counts[f"{split}_rejected"] = len(rejects)
        all_rejects += [r.as_dict() for r in rejects]
    if not examples["train"]:
        raise TaskDataError(f"task {task}: no training examples in {folder}")

    def encode(ex: list[Example]) -> list[dict[str, Any]]:
        return encode_examples(tokenizer, ex, labels, cfg.max_seq_length)

    def finish(split: str, outputs: list[Any]) -> tuple[dict[str, float], dict[str, Any]]:
        ex = examples[split]
        out = np.stack(outputs)
        if labels:
            pred = out.argmax(-1)
            gold = [labels.index(e.label) for e in ex]
            names = [labels[p] for p in pred]
        else:
            pred, gold, names = out, [e.label for e in ex], [float(p) for p in out]
        result = glue_metrics(task, gold, pred)
        # GLUE's submission layout: index<TAB>prediction (the index here is the example's guid).
        tsv = "index\tprediction\n" + "".join(f"{e.guid}\t{n}\n" for e, n in zip(ex, names, strict=True))
        return result, {f"{split}_predictions.tsv": tsv}

    return TaskData(
        kind="regression" if not labels else "classification",
        num_labels=max(len(labels), 1),
        train=encode(examples["train"]),
        evals={s: encode(examples[s]) for s in spec.splits},
        finish=finish,
        counts=counts,
        rejects=all_rejects,
        labels=tuple(labels),
    )
