"""Task heads over :class:`bert_core.model.bert.BertModel`: the paper's "one additional output layer".

    model = BertForTask(BertModel.from_pretrained("samples/models/minilm"), "classification", 2)

- classification / regression: dropout + linear on the pooled ``[CLS]`` vector (C labels, or 1 score)
- multiple_choice: a vector scores each ``[CLS] context [SEP] ending [SEP]``; softmax over endings
- with ``pooling="mean"`` those three read the mean of the last layer's token states instead
- span (SQuAD): start and end vectors dotted with every token state
- token (NER): dropout + linear on every token state; only first word pieces carry a label
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bert_core.finetune.errors import TaskDataError
from bert_core.model.bert import BertModel, BertOutput, init_weights

IGNORE_INDEX = -100  # label of positions that take no loss (padding, later word pieces)


class BertForTask(nn.Module):
    """An encoder plus one task layer; ``forward`` returns the task's logits.

    ``pooling="mean"`` exists because masked-LM-only pre-training never trains ``[CLS]`` or the
    pooler.
    """

    def __init__(self, bert: BertModel, kind: str, num_labels: int = 2, pooling: str = "cls") -> None:
        super().__init__()
        cfg = bert.config
        self.bert = bert
        self.kind = kind
        if pooling not in ("cls", "mean"):
            raise TaskDataError(f"pooling {pooling!r}: use cls (the pooler over [CLS]) or mean")
        self.pooling = pooling
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        out = {"classification": num_labels, "regression": 1, "multiple_choice": 1,
               "span": 2, "token": num_labels}.get(kind)
        if out is None:
            raise ValueError(f"no head for task kind {kind!r}")
        self.head = nn.Linear(cfg.hidden_size, out)
        init_weights(self.head, cfg.initializer_range)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        if self.kind == "multiple_choice":
            b, c, t = input_ids.shape  # [B, choices, T] -> one sequence per choice
            out = self.bert(input_ids.view(b * c, t), token_type_ids.view(b * c, t),
                            attention_mask.view(b * c, t))
            pooled = self.pooled(out, attention_mask.view(b * c, t))
            return self.head(self.dropout(pooled)).view(b, c)  # [B, choices]
        out = self.bert(input_ids, token_type_ids, attention_mask)
        if self.kind in ("classification", "regression"):
            logits = self.head(self.dropout(self.pooled(out, attention_mask)))  # [B, C]
            return logits.squeeze(-1) if self.kind == "regression" else logits
        if self.kind == "span":
            return self.head(out.last_hidden_state)  # [B, T, 2]: start, end
        return self.head(self.dropout(out.last_hidden_state))  # [B, T, C]

    def pooled(self, out: BertOutput, attention_mask: Tensor) -> Tensor:
        """[B, H]: the pooler over [CLS], or the mean of the real tokens' last states."""
        if self.pooling == "cls":
            return out.pooler_output
        mask = attention_mask.to(out.last_hidden_state.dtype)[..., None]  # [B, T, 1]
        return (out.last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1)


def task_loss(kind: str, logits: Tensor, labels: Tensor) -> Tensor:
    """The task's training loss; ``labels`` come from the collated batch."""
    if kind == "regression":
        return F.mse_loss(logits, labels.to(logits.dtype))
    if kind == "token":
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    if kind == "span":
        # labels [B, 2]: start and end token index (0 = [CLS] = no answer in this window)
        t = logits.shape[1]
        start, end = labels[:, 0].clamp(0, t - 1), labels[:, 1].clamp(0, t - 1)
        return (F.cross_entropy(logits[..., 0], start) + F.cross_entropy(logits[..., 1], end)) / 2
    return F.cross_entropy(logits, labels)


def mask_padding(kind: str, logits: Tensor, attention_mask: Tensor) -> Tensor:
    """Span logits at padding positions can never be chosen."""
    if kind == "span":
        return logits.masked_fill(~attention_mask.bool()[..., None], torch.finfo(logits.dtype).min)
    return logits
