"""Fine-tuning: the task registry. Each task = a reader of the dataset's published format,
a head over :class:`bert_core.model.bert.BertModel`, and the task's official metric.

    bertpipe finetune --task squad --data tests/fixtures/tasks --checkpoint samples/models/minilm --output /tmp/ft

``TASKS`` maps a task name to its :class:`Task`; :func:`get_task` looks one up with a helpful
error; :func:`task_dir` finds a task's folder under ``--data`` and :func:`task_files` its files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from bert_core.finetune.errors import TaskFileMissing, UnknownTask

Kind = Literal["classification", "regression", "span", "token", "multiple_choice", "token_features"]


@dataclass(frozen=True)
class Task:
    name: str
    kind: Kind
    folder: str  # sub-folder of data_dir, named as the dataset's own download names it
    metric: str  # the headline metric (the paper's), a key of metrics.json
    splits: tuple[str, ...]  # evaluation splits (file stems); train is always "train"
    description: str
    # The labelled held-out split reported once the setting is chosen on splits[0]; None when the
    # task has none (GLUE/SQuAD test labels are not public), and then splits[0] is reported too.
    final_split: str | None = None
    train_size: int | None = None  # train on this many training examples (``<task>@<n>``)

    @property
    def base(self) -> str:
        """The registered task this one is a learning-curve point of (itself when it is not)."""
        return self.name.split("@")[0]

    @property
    def selection_metric(self) -> str:
        """The flat metric name a setting is chosen by: the headline metric on the dev split."""
        return f"{self.splits[0]}/{self.metric}"

    @property
    def final_metric(self) -> str:
        return f"{self.final_split or self.splits[0]}/{self.metric}"

    @property
    def final_label(self) -> str:
        """The final split as a report names it: honest when it is the selection split."""
        return self.final_split or f"{self.splits[0]} (also used for selection)"

    @property
    def percent_scale(self) -> bool:
        """True when the task's metrics are already on 0-100 (SQuAD's script, conlleval)."""
        return self.kind in ("span", "token", "token_features")


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("cola", "classification", "CoLA", "mcc", ("dev",), "CoLA acceptability (Matthews corr.)"),
        Task("sst2", "classification", "SST-2", "accuracy", ("dev",), "SST-2 sentiment"),
        Task("mrpc", "classification", "MRPC", "f1", ("dev",), "MRPC paraphrase (F1/acc)"),
        Task("stsb", "regression", "STS-B", "spearman", ("dev",), "STS-B similarity (Pearson/Spearman)"),
        Task("qqp", "classification", "QQP", "f1", ("dev",), "QQP duplicate questions (acc/F1)"),
        Task("mnli", "classification", "MNLI", "accuracy", ("dev_matched", "dev_mismatched"),
             "MNLI entailment (matched/mismatched acc)"),
        Task("qnli", "classification", "QNLI", "accuracy", ("dev",), "QNLI question entailment"),
        Task("rte", "classification", "RTE", "accuracy", ("dev",), "RTE entailment"),
        Task("wnli", "classification", "WNLI", "accuracy", ("dev",), "WNLI coreference entailment"),
        Task("sentiment", "classification", "sentiment", "accuracy", ("dev", "test"),
             "real product-review and tweet sentiment (vaderSentiment ground truth)", final_split="test"),
        Task("squad", "span", "squad", "f1", ("dev",), "SQuAD v1.1 (EM/F1, official script)"),
        Task("squad_v2", "span", "squad_v2", "f1", ("dev",), "SQuAD v2.0 (EM/F1, tuned null threshold)"),
        Task("ner", "token", "ner", "f1", ("valid",), "CoNLL-2003 NER (conlleval F1)"),
        Task("ner_bilstm", "token_features", "ner", "f1", ("valid",),
             "CoNLL-2003 NER, feature-based: BiLSTM on frozen BERT features (paper's ablation)"),
        Task("swag", "multiple_choice", "swag", "accuracy", ("val",), "SWAG multiple choice"),
    )
}


def get_task(name: str) -> Task:
    """The registered task ``name``, or ``<task>@<n>``: that classification task on ``n`` of its
    training examples.

    The subsample is stratified and the same for every checkpoint and seed: a point of the
    learning curve, reported as a task of its own.
    """
    base, at, size = name.lower().partition("@")
    try:
        task = TASKS[base]
    except KeyError:
        raise UnknownTask(f"unknown task {name!r}; registered tasks: {', '.join(sorted(TASKS))}") from None
    if not at:
        return task
    if not size.isdigit() or int(size) < 1:
        raise UnknownTask(f"task {name!r}: after '@' comes the number of training examples, e.g. {base}@300")
    if task.kind != "classification":
        raise UnknownTask(f"task {name!r}: a training-set size applies to classification tasks only "
                          f"({base} is {task.kind}); use finetune.max_train_examples to cap it")
    return replace(task, name=f"{base}@{int(size)}", train_size=int(size),
                   description=f"{task.description}, {int(size)} training examples")


def task_dir(data_dir: str, task: Task) -> str:
    """``<data_dir>/<folder>`` if it exists; else ``data_dir`` itself when it is a task's own
    folder (``--data`` may name it directly). A folder of task folders without this task's is
    an error naming the missing folder."""
    from bert_core import storage

    sub = storage.join(data_dir, task.folder)
    if storage.exists(sub):
        return sub
    folders = {t.folder for t in TASKS.values()}
    has_other_tasks = any(storage.exists(storage.join(data_dir, f)) for f in folders)
    if storage.exists(data_dir) and not has_other_tasks:
        return storage.to_uri(data_dir)
    raise TaskFileMissing(
        f"no data for task {task.name!r}: {sub} does not exist; put the {task.description} "
        f"files there"
    )


def task_files(data_dir: str, name: str) -> list[str]:
    """The files a job of task ``name`` reads under ``data_dir``, found as its reader finds them
    and without reading them; :class:`TaskFileMissing` (or :class:`UnknownTask`) when one is not there."""
    task = get_task(name)
    folder = task_dir(data_dir, task)
    splits = ("train", *task.splits)
    if task.base == "sentiment":
        from bert_core.finetune.glue import sentiment_files

        return sentiment_files(folder)
    if task.kind in ("classification", "regression"):
        from bert_core.finetune.glue import glue_file

        return [glue_file(task.base, folder, split) for split in splits]
    if task.kind == "span":
        from bert_core.finetune.squad import _find_files

        return sorted(set(_find_files(folder)[:2]))
    if task.kind in ("token", "token_features"):
        from bert_core.finetune.ner import _find

        return [_find(folder, split) for split in splits]
    from bert_core.finetune.swag import swag_file

    return [swag_file(folder, split) for split in splits]
