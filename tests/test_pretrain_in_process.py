"""In-process pre-training's seeded random init: arm B's weights and a run's start."""

from __future__ import annotations

import torch

from bert_core.config import ModelConfig
from bert_core.pretrain.in_process import random_init


def weights(model) -> torch.Tensor:
    return model.state_dict()["bert.embeddings.word_embeddings.weight"].clone()


def test_random_init_is_the_seeds():
    config = ModelConfig(size="tiny", vocab_size=120, pre_layer_norm=True)
    model = random_init(config, seed=42)
    assert torch.equal(weights(model), weights(random_init(config, seed=42)))
    assert not torch.equal(weights(model), weights(random_init(config, seed=43)))
