"""What every task reader hands the training loop: encoded features + a way to score outputs.

A feature is a dict: ``input_ids`` / ``token_type_ids`` (lists, or one list per choice for
multiple choice) and ``label`` (class id, score, ``[start, end]`` or a list per token). Batches
are padded to their longest sequence only (dynamic padding: the paper's fixed 128/384 would
waste most of the compute on short GLUE sentences).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bert_core.finetune.errors import TaskDataError
from bert_core.finetune.heads import IGNORE_INDEX

# finish(split, outputs) -> (metrics, {file name: JSON-able predictions})
Finish = Callable[[str, list[Any]], tuple[dict[str, float], dict[str, Any]]]


@dataclass
class TaskData:
    kind: str
    num_labels: int
    train: list[dict[str, Any]]
    evals: dict[str, list[dict[str, Any]]]
    finish: Finish
    counts: dict[str, int] = field(default_factory=dict)  # examples read/kept/rejected per split
    rejects: list[dict[str, Any]] = field(default_factory=list)
    labels: tuple[str, ...] = ()  # class / tag names by id (classification, token); empty otherwise


SUBSAMPLE_SEED = 20240601


def training_subset(task: Any, examples: Sequence[Any]) -> list[Any]:
    """The ``task.train_size`` training examples of a learning-curve task (``<task>@<n>``), all
    of them for any other: draw 0 of :func:`subsample` for the task, so every checkpoint and seed
    trains on the same examples."""
    if not task.train_size:
        return list(examples)
    if task.train_size > len(examples):
        raise TaskDataError(f"task {task.name}: asks for {task.train_size} training examples, the "
                         f"training split has {len(examples)}; choose a smaller size")
    return subsample(examples, task.train_size, task.base)


def subsample(examples: Sequence[Any], size: int | None, task: str, draw: int = 0) -> list[Any]:
    """Draw number ``draw`` of ``size`` labelled examples (``.label``) of ``task``, stratified by
    label; ``None`` means all of them. The same (task, size, draw) always gives the same examples."""
    import numpy as np

    if size is None or size >= len(examples):
        return list(examples)
    rng = np.random.default_rng([SUBSAMPLE_SEED, size, draw, sum(task.encode())])
    return stratified_subset(examples, size, rng, label=lambda e: e.label)


def stratified_subset(rows: Sequence[Any], size: int, rng: Any, label: Callable[[Any], Any]) -> list[Any]:
    """``size`` of ``rows`` drawn by ``rng`` (a ``numpy.random.Generator``), each ``label(row)``
    kept in its share, rounded (every label at least once where ``size`` allows; the commonest
    label takes what rounding leaves over); rows keep their order. All rows when ``size`` is not
    below their count."""
    if size >= len(rows):
        return list(rows)
    by_label: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        by_label.setdefault(label(row), []).append(i)
    labels = sorted(by_label)
    least = 1 if size >= len(labels) else 0
    take = {lab: max(least, round(size * len(by_label[lab]) / len(rows))) for lab in labels}
    take[max(labels, key=lambda lab: len(by_label[lab]))] += size - sum(take.values())
    kept = [i for lab in labels for i in rng.choice(by_label[lab], take[lab], replace=False).tolist()]
    return [rows[i] for i in sorted(kept)]


def _pad(rows: Sequence[Sequence[int]], value: int, length: int) -> list[list[int]]:
    return [list(r) + [value] * (length - len(r)) for r in rows]


def collate(kind: str, features: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad a list of features into tensors ``input_ids``, ``token_type_ids``, ``attention_mask``, ``labels``."""
    if kind == "multiple_choice":
        length = max(len(ids) for f in features for ids in f["input_ids"])
        ids = [_pad(f["input_ids"], pad_id, length) for f in features]
        types = [_pad(f["token_type_ids"], 0, length) for f in features]
        mask = [_pad([[1] * len(x) for x in f["input_ids"]], 0, length) for f in features]
    else:
        length = max(len(f["input_ids"]) for f in features)
        ids = _pad([f["input_ids"] for f in features], pad_id, length)
        types = _pad([f["token_type_ids"] for f in features], 0, length)
        mask = _pad([[1] * len(f["input_ids"]) for f in features], 0, length)
    batch = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "token_type_ids": torch.tensor(types, dtype=torch.long),
        "attention_mask": torch.tensor(mask, dtype=torch.long),
    }
    labels = [f.get("label") for f in features]
    if kind == "token":
        batch["labels"] = torch.tensor(_pad(labels, IGNORE_INDEX, length), dtype=torch.long)
    elif kind == "regression":
        batch["labels"] = torch.tensor(labels, dtype=torch.float32)
    elif all(lab is not None for lab in labels):
        batch["labels"] = torch.tensor(labels, dtype=torch.long)
    return batch


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on ``device``. For CUDA it is pinned first, so the copy runs without making
    the host wait (``non_blocking``); on CPU the tensors are the batch's own."""
    pin = device.type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=pin) for k, v in batch.items()}
