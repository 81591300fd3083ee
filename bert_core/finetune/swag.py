"""SWAG multiple choice (the CSV files of the SWAG release): four endings, accuracy.

    bertpipe finetune --task swag --data swagaf/data --checkpoint runs/demo/hf --output finetune/demo

Each example gives four sequences ``[CLS] sent1 [SEP] sent2 ending_i [SEP]``; the head scores
each ``[CLS]`` with one vector and a softmax over the four picks the ending (the paper's setup).
Files: ``<folder>/train.csv`` and ``val.csv`` with the columns ``sent1, sent2, ending0..3, label``.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np

from bert_core import storage
from bert_core.finetune.errors import TaskDataError, TaskFileMissing
from bert_core.finetune.glue import Example, encode_pairs

N_CHOICES = 4


def swag_file(folder: str, split: str) -> str:
    """The csv of ``split`` in ``folder``; :class:`TaskFileMissing` when it is not there."""
    uri = storage.join(folder, f"{split}.csv")
    if not storage.exists(uri):
        raise TaskFileMissing(f"{uri} does not exist; expected SWAG's train.csv / val.csv")
    return uri


def read_swag(uri: str) -> tuple[list[tuple[str, str, list[str], int]], list[dict[str, Any]]]:
    """Rows ``(id, context, [4 endings prefixed with sent2], label)`` and rejects."""
    reader = csv.DictReader(io.StringIO(storage.read_text(uri)))
    need = {"sent1", "sent2", "label", *(f"ending{i}" for i in range(N_CHOICES))}
    missing = need - set(reader.fieldnames or [])
    if missing:
        raise TaskDataError(f"{uri}: missing columns {sorted(missing)}; is this a SWAG csv?")
    rows, rejects = [], []
    for n, row in enumerate(reader, 2):
        try:
            label = int(row["label"])
        except (TypeError, ValueError):
            label = -1
        endings = [row.get(f"ending{i}") for i in range(N_CHOICES)]
        if not 0 <= label < N_CHOICES or any(e is None for e in endings):
            rejects.append({"source": uri, "id": n, "reason": "bad_row",
                            "detail": f"label {row.get('label')!r} / endings {endings}"})
            continue
        key = row.get("video-id") or row.get("") or str(n)
        rows.append((f"{key}-{n}", row["sent1"], [f"{row['sent2']} {e}".strip() for e in endings], label))
    return rows, rejects


def prepare(folder: str, tokenizer: Any, cfg: Any, splits: tuple[str, ...] = ("val",)) -> Any:
    from bert_core.finetune.data import TaskData

    data, counts, rejects = {}, {}, []
    for split in ("train", *splits):
        rows, bad = read_swag(swag_file(folder, split))
        if split == "train" and cfg.max_train_examples:
            rows = rows[: cfg.max_train_examples]
        data[split] = rows
        counts[f"{split}_examples"], counts[f"{split}_rejected"] = len(rows), len(bad)
        rejects += bad

    def encode(rows: list) -> list[dict[str, Any]]:
        pairs = [Example(r[0], r[1], ending, None) for r in rows for ending in r[2]]
        enc = encode_pairs(tokenizer, pairs, cfg.max_seq_length)
        return [
            {"input_ids": enc["input_ids"][i * N_CHOICES : (i + 1) * N_CHOICES],
             "token_type_ids": enc["token_type_ids"][i * N_CHOICES : (i + 1) * N_CHOICES],
             "label": r[3]}
            for i, r in enumerate(rows)
        ]

    def finish(split: str, outputs: list[Any]) -> tuple[dict[str, float], dict[str, Any]]:
        rows = data[split]
        pred = np.stack(outputs).argmax(-1)
        gold = np.array([r[3] for r in rows])
        text = "id,pred,label\n" + "".join(f"{r[0]},{p},{r[3]}\n" for r, p in zip(rows, pred, strict=True))
        return {"accuracy": float((pred == gold).mean()) if len(gold) else 0.0}, {f"{split}_predictions.csv": text}

    return TaskData(kind="multiple_choice", num_labels=N_CHOICES, train=encode(data["train"]),
                    evals={s: encode(data[s]) for s in splits}, finish=finish, counts=counts,
                    rejects=rejects)
