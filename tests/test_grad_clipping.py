"""Gradient clipping at ZeRO 0: the loop's own (torch's foreach clipping, on the device) against
DeepSpeed's, on real engines with gradient accumulation."""

from __future__ import annotations

import deepspeed
import torch

from bert_core.config import ModelConfig, load_config
from bert_core.model.bert import BertForPreTraining
from bert_core.pretrain.ds_config import ds_config, loop_clipping
from bert_core.pretrain.loop import backward_and_step
from tests.test_ds_config import one_rank, tiny_batch  # noqa: F401 (one_rank is a fixture)

MAX_NORM = 0.05  # well below these gradients' norm, so every step clips


def train(clipping: str) -> dict[str, torch.Tensor]:
    """Two optimizer steps of four micro-batches from the same weights; the weights after them."""
    cfg = load_config("demo", None, [
        "pretrain.procs_per_node=1", f"pretrain.gradient_clipping={MAX_NORM}", "pretrain.zero_stage=0",
        'pretrain.phases=[{"max_seq_length": 64, "max_steps": 2, "global_batch_size": 8, '
        '"micro_batch_size": 2, "learning_rate": 0.01, "warmup_steps": 0}]']).pretrain
    ds = ds_config(cfg, 0)
    max_norm = loop_clipping(cfg)
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.0 and max_norm == MAX_NORM
    if clipping == "deepspeed":
        ds, max_norm = ds | {"gradient_clipping": MAX_NORM}, 0.0
    elif clipping == "none":
        max_norm = 0.0
    torch.manual_seed(0)
    model = BertForPreTraining(ModelConfig(size="tiny", vocab_size=128, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0))
    # SGD, not AdamW: Adam's update hardly changes when every gradient is scaled alike, SGD's does
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ds = {k: v for k, v in ds.items() if k not in ("optimizer", "scheduler")}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    batch = tiny_batch()
    for _ in range(2 * engine.gradient_accumulation_steps()):
        backward_and_step(engine, engine(**batch)["loss"], max_norm)
    assert engine.global_steps == 2
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_the_loops_clipping_is_deepspeeds(one_rank):  # noqa: F811
    ours, theirs, unclipped = train("loop"), train("deepspeed"), train("none")
    for name, weight in ours.items():
        torch.testing.assert_close(weight, theirs[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.allclose(weight, unclipped[name]) for name, weight in ours.items())
