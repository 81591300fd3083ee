"""One fine-tuning job of the quality benchmark with the product's loop, and its scores.

    from benchmarks.quality.finetune import finetune_examples
    scores = finetune_examples(checkpoint, {"train": train, "dev": dev}, "dev", labels, {"learning_rate": 1e-3}, seed=1)

A setting is ``FinetuneConfig`` fields plus ``epochs`` and ``min_steps``: a job takes
``max(epochs x steps per epoch, min_steps)`` steps, so that a 100-example subsample trains long
enough. Scores are accuracy and macro-F1, 0-100.
"""

from __future__ import annotations

import math

import numpy as np

from benchmarks.quality.spec import SETTING_DEFAULTS
from bert_core.config import FinetuneConfig
from bert_core.finetune.grid import Setting


def encoded(checkpoint: str, parts: dict[str, list], labels: tuple[str, ...], max_seq_length: int):
    """Every part in the checkpoint's vocab, and its padding id."""
    from bert_core.finetune.glue import encode_examples
    from bert_core.vocab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(checkpoint))
    return {k: encode_examples(tokenizer, v, labels, max_seq_length) for k, v in parts.items()}, tokenizer.pad_id


def scores(labels: list[int], pred: list[int]) -> dict[str, float]:
    """Accuracy (the product's) and macro-F1, 0-100; macro-F1 is the protocol's own measure (the
    product reports each task's paper metric), so it is computed here."""
    import sklearn.metrics

    from bert_core.finetune.metrics import accuracy

    return {"accuracy": 100 * accuracy(labels, pred),
            "macro_f1": 100 * float(sklearn.metrics.f1_score(labels, pred, average="macro", zero_division=0))}


def product_setting(setting: dict):
    """A protocol setting as the product's grid names it (``bert_core.finetune.grid.Setting``)."""
    s = SETTING_DEFAULTS | setting
    return Setting(s["learning_rate"], s["batch_size"], s["epochs"], s["pooling"], s["layerwise_lr_decay"])


def finetune(checkpoint: str, data: dict[str, list], split: str, num_labels: int, setting: dict, seed: int,
             pad_id: int = 0) -> dict[str, float]:
    """Fine-tune on ``data["train"]`` (encoded features) at ``setting``; scores on ``data[split]``."""
    import torch

    from bert_core.finetune.data import TaskData
    from bert_core.finetune.train import train_and_predict

    s = SETTING_DEFAULTS | setting
    torch.set_num_threads(1)
    steps_per_epoch = math.ceil(len(data["train"]) / s["batch_size"])
    epochs = max(s["epochs"], s["min_steps"] / steps_per_epoch)
    cfg = FinetuneConfig(learning_rate=s["learning_rate"], num_train_epochs=epochs, batch_size=s["batch_size"],
                         max_seq_length=s["max_seq_length"], threads=1, pooling=s["pooling"],
                         reinit_layers=s["reinit_layers"], layerwise_lr_decay=s["layerwise_lr_decay"])
    task = TaskData(kind="classification", num_labels=num_labels, train=data["train"], evals={split: data[split]},
                    finish=lambda s, o: ({}, {}))
    out = train_and_predict(task, str(checkpoint), cfg, seed, pad_id)
    pred = np.stack(out["outputs"][split]).argmax(-1).tolist()
    return scores([f["label"] for f in data[split]], pred)


def finetune_examples(checkpoint: str, parts: dict[str, list], split: str, labels: tuple[str, ...], setting: dict,
                      seed: int) -> dict[str, float]:
    """:func:`finetune` on examples, encoded in the checkpoint's vocab within the job: a job read
    from the cache needs no checkpoint."""
    data, pad_id = encoded(checkpoint, parts, labels, 64)
    return finetune(checkpoint, data, split, len(labels), setting, seed, pad_id)
