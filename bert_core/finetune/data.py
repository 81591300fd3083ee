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


def training_subset(task: Any, examples: Sequence[Any]) -> list[Any]:
    """The ``task.train_size`` training examples of a learning-curve task (``<task>@<n>``), all
    of them for any other: one stratified draw seeded by the task's name, so every checkpoint
    and seed trains on the same examples."""
    import random
    import zlib

    if not task.train_size:
        return list(examples)
    if task.train_size > len(examples):
        raise ValueError(f"task {task.name}: asks for {task.train_size} training examples, the "
                         f"training split has {len(examples)}; choose a smaller size")
    rng = random.Random(zlib.crc32(task.name.encode()))
    return stratified_subset(examples, task.train_size, rng, label=lambda e: e.label)


def stratified_subset(rows: Sequence[Any], size: int, rng: Any, label: Callable[[Any], Any]) -> list[Any]:
    """``size`` of ``rows`` drawn by ``rng`` (a ``random.Random``), each ``label(row)`` kept in
    its share (largest remainder, every label at least once where ``size`` allows); rows keep
    their order. All rows when ``size`` is not below their count."""
    if size >= len(rows):
        return list(rows)
    by_label: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        by_label.setdefault(label(row), []).append(i)
    exact = {label: size * len(ix) / len(rows) for label, ix in by_label.items()}
    take = {label: max(1, int(x)) if size >= len(by_label) else int(x) for label, x in exact.items()}
    for label in sorted(exact, key=lambda k: (exact[k] - int(exact[k]), len(by_label[k])), reverse=True):
        if sum(take.values()) >= size:
            break
        take[label] += 1
    while sum(take.values()) > size:  # the minimum of one per label overshot: trim the largest
        take[max(take, key=take.get)] -= 1
    kept = sorted(i for label, ix in by_label.items() for i in rng.sample(ix, take[label]))
    return [rows[i] for i in kept]


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
