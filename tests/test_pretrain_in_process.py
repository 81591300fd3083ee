"""In-process pre-training: the seeded random init and masked-LM steps on tiny real instances."""

from __future__ import annotations

import torch

from benchmarks.quality.search import train_mlm
from bert_core.config import ModelConfig, PretrainConfig, PretrainPhase
from bert_core.pretrain.data import read_vocab, vocab_file_of
from bert_core.pretrain.in_process import random_init
from tests.test_data import make_instances


def weights(model) -> torch.Tensor:
    return model.state_dict()["bert.embeddings.word_embeddings.weight"].clone()


def test_random_init_is_the_seeds_and_steps_move_it(tmp_path, samples_dir):
    instances = make_instances(tmp_path, samples_dir, num_shards=1, masking="dynamic", max_docs=8)
    config = ModelConfig(size="tiny", vocab_size=len(read_vocab(vocab_file_of(instances))), pre_layer_norm=True)
    model = random_init(config, seed=42)
    assert torch.equal(weights(model), weights(random_init(config, seed=42)))
    assert not torch.equal(weights(model), weights(random_init(config, seed=43)))

    start = weights(model)
    phase = PretrainPhase(max_seq_length=64, max_steps=3, global_batch_size=4, micro_batch_size=4, learning_rate=1e-3,
                          warmup_steps=1)
    run = PretrainConfig(phases=[phase], procs_per_node=1, seed=42)
    log = train_mlm(model, instances, run, masking={"masked_lm_prob": 0.25}, log_every=2)
    assert [row["step"] for row in log] == [0, 2] and all(row["loss"] > 0 for row in log)
    assert 0 < (weights(model) - start).abs().max() < 0.1
