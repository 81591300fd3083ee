"""Feature-based NER (the paper's CoNLL ablation): a 2-layer BiLSTM tagger on frozen BERT features.

    bertpipe finetune --task ner_bilstm --data tests/fixtures/tasks --checkpoint samples/models/minilm --output /tmp/ft

The encoder is never updated: word features (first word piece, ``concat_last_four`` — the
paper's best feature-based choice) are computed once by :mod:`bert_core.finetune.features`,
then a small BiLSTM + linear layer is trained on them with Adam. It starts from scratch, so it
gets ``EPOCHS_PER_EPOCH`` passes per fine-tuning epoch (each pass is cheap: no encoder).
Scored with conlleval like the fine-tuned ``ner`` task, so the two compare directly.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

LAYERS = "concat_last_four"
EPOCHS_PER_EPOCH = 10
HIDDEN = 128  # per direction (the paper used 768 for BERT-base; small data here)


def build_tagger(input_dim: int, num_labels: int, hidden: int = HIDDEN) -> Any:
    import torch
    from torch import nn

    class BiLSTMTagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(input_dim, hidden, num_layers=2, bidirectional=True, batch_first=True)
            self.out = nn.Linear(2 * hidden, num_labels)

        def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = nn.utils.rnn.pack_padded_sequence(feats, lengths, batch_first=True, enforce_sorted=False)
            out, _ = self.lstm(packed)
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=feats.shape[1])
            return self.out(out)  # [B, T, labels]

    return BiLSTMTagger()


def _batch(feats: list[np.ndarray], labels: list[list[int]] | None):
    import torch

    length = max(len(f) for f in feats)
    x = np.zeros((len(feats), length, feats[0].shape[1]), dtype=np.float32)
    y = np.full((len(feats), length), -100, dtype=np.int64)
    for i, f in enumerate(feats):
        x[i, : len(f)] = f
        if labels is not None:
            y[i, : len(f)] = labels[i]
    return torch.from_numpy(x), torch.tensor([len(f) for f in feats]), torch.from_numpy(y)


def train_tagger(
    feats: list[np.ndarray], labels: list[list[int]], num_labels: int, epochs: int, seed: int,
    batch_size: int = 32, lr: float = 1e-3,
) -> tuple[Any, list[float]]:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    tagger = build_tagger(feats[0].shape[1], num_labels)
    optimizer = torch.optim.Adam(tagger.parameters(), lr=lr)
    shuffle = torch.Generator().manual_seed(seed)
    losses = []
    tagger.train()
    for _ in range(epochs):
        order = torch.randperm(len(feats), generator=shuffle).tolist()
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            x, lengths, y = _batch([feats[j] for j in idx], [labels[j] for j in idx])
            loss = F.cross_entropy(tagger(x, lengths).flatten(0, 1), y.flatten(), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return tagger, losses


def predict(tagger: Any, feats: list[np.ndarray], batch_size: int = 64) -> list[list[int]]:
    import torch

    tagger.eval()
    preds = []
    with torch.no_grad():
        for i in range(0, len(feats), batch_size):
            chunk = feats[i : i + batch_size]
            x, lengths, _ = _batch(chunk, None)
            best = tagger(x, lengths).argmax(-1).numpy()
            preds += [best[k, : len(f)].tolist() for k, f in enumerate(chunk)]
    return preds


def run_feature_based_ner(
    data_dir: str, checkpoint: str, tokenizer: Any, cfg: Any, seed: int, log=None
) -> dict[str, Any]:
    """The ``ner_bilstm`` job: frozen features -> BiLSTM -> conlleval on the valid split."""
    from bert_core.finetune import conlleval, get_task, task_dir
    from bert_core.finetune.data import TaskData
    from bert_core.finetune.features import word_features
    from bert_core.finetune.ner import _find, read_conll, to_iob2
    from bert_core.model.bert import BertModel

    spec = get_task("ner_bilstm")
    folder = task_dir(data_dir, spec)
    data, counts, rejects = {}, {}, []
    for split in ("train", *spec.splits):
        sentences, bad = read_conll(_find(folder, split))
        if split == "train" and cfg.max_train_examples:
            sentences = sentences[: cfg.max_train_examples]
        data[split] = [(w, to_iob2(t)) for w, t in sentences]
        counts[f"{split}_sentences"], counts[f"{split}_rejected"] = len(sentences), len(bad)
        rejects += bad
    labels = ["O"] + sorted({t for _, tags in data["train"] for t in tags} - {"O"})
    encoder = BertModel.from_pretrained(checkpoint)
    start = time.perf_counter()
    feats = {s: word_features(encoder, tokenizer, [w for w, _ in data[s]], LAYERS, cfg.max_seq_length)
             for s in data}
    feature_seconds = time.perf_counter() - start
    y = [[labels.index(t) if t in labels else 0 for t in tags] for _, tags in data["train"]]
    epochs = max(1, math.ceil(cfg.num_train_epochs)) * EPOCHS_PER_EPOCH
    start = time.perf_counter()
    tagger, losses = train_tagger(feats["train"], y, len(labels), epochs, seed, cfg.batch_size)
    train_seconds = time.perf_counter() - start
    if log:
        log(f"bilstm: {epochs} epochs, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    metrics, files = {}, {}
    for split in spec.splits:
        pred = [[labels[i] for i in p] for p in predict(tagger, feats[split])]
        gold = [t for _, t in data[split]]
        result = conlleval.evaluate(gold, pred)
        per_type = result.pop("per_type")
        result.update({f"{t}_f1": v["f1"] for t, v in per_type.items()})
        metrics[split] = result
        lines = []
        for (words, g), p in zip(data[split], pred, strict=True):
            lines += [f"{a} {b} {c}" for a, b, c in zip(words, g, p, strict=True)] + [""]
        files[f"{split}_predictions.txt"] = "\n".join(lines) + "\n"
    task_data = TaskData(kind="token_features", num_labels=len(labels), train=[], evals={},
                         finish=lambda s, o: ({}, {}), counts=counts, rejects=rejects)
    return {
        "data": task_data, "files": files, "metrics": metrics,
        "train": {"layers": LAYERS, "epochs": epochs, "steps": len(losses),
                  "first_loss": losses[0], "last_loss": losses[-1],
                  "feature_seconds": round(feature_seconds, 3), "seconds": round(train_seconds, 3),
                  "encoder_frozen": True},
    }
