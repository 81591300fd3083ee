"""The seeded random init every pre-training run starts from, and the same weights saved as a
checkpoint: the baseline that fine-tuning compares a pre-trained model with.

    python -c "from bert_core.config import ModelConfig; from bert_core.pretrain.in_process import random_init; \
print(random_init(ModelConfig(size='tiny', vocab_size=99), seed=42).config.hidden_size)"
"""

from __future__ import annotations

from typing import Any

from bert_core.config import ModelConfig


def random_init(config: ModelConfig, seed: int) -> Any:
    """A ``BertForPreTraining`` of ``config`` with the weights a pre-training run of ``seed``
    starts from."""
    import torch

    from bert_core.model.bert import BertForPreTraining

    torch.manual_seed(seed)
    return BertForPreTraining(config)


def save_random_init(config: ModelConfig, seed: int, output: str, vocab_file: str, lowercase: bool = True) -> Any:
    """:func:`random_init` of ``config`` and ``seed`` written to ``output`` as a transformers-layout
    checkpoint with ``vocab_file``; the model."""
    from bert_core.model.checkpoint import save_pretrained

    model = random_init(config, seed)
    save_pretrained(model, output, vocab_file=vocab_file, lowercase=lowercase)
    return model
