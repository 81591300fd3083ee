"""Which parameters get weight decay: the optimizer groups shared by pre-training and fine-tuning.

    python -c "from bert_core.model.bert import BertForPreTraining; from bert_core.config import ModelConfig; \
from bert_core.model.weight_decay import param_groups; \
print([len(g['params']) for g in param_groups(BertForPreTraining(ModelConfig(size='tiny', vocab_size=99)), 0.01)])"

The rule goes by shape, as nanoGPT's does: matrices (Linear and embedding weights, ``ndim >= 2``)
decay; vectors (biases and every LayerNorm weight and bias, ``ndim < 2``) never do. It needs no
list of names, so a norm of any name (the pre-LN encoder's final ``bert.encoder.ln``, a
fine-tuning head's own layers) lands in the right group.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def decays(param: nn.Parameter) -> bool:
    """Matrices decay; biases and LayerNorm parameters (vectors) do not."""
    return param.ndim >= 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups over the trainable parameters: ``[decayed, not decayed]``."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]
