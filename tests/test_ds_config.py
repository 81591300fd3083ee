"""The rendered DeepSpeed config of every preset, GPU ones included, as DeepSpeed 0.19 reads it:
its own config parser at the preset's world size, then a real one-rank engine on CPU with the
preset's precision, ZeRO stage and optimizer settings (a tiny model), stepping twice.

    .venv/bin/python -m pytest -q tests/test_ds_config.py
"""

from __future__ import annotations

import socket

import pytest
import torch

from bert_core.config import ConfigError, load_config, preset_names
from bert_core.model.weight_decay import param_groups
from bert_core.pretrain.ds_config import client_optimizer, ds_config, uses_client_optimizer

# A tiny model (vocab 128 rows) on one rank, two micro-batches of 2 per optimizer step.
TINY_ONE_RANK = ["model.size=custom", "model.hidden_size=32", "model.num_attention_heads=2",
                 "model.intermediate_size=64", "model.num_hidden_layers=1",
                 "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
                 "pretrain.nodes=1", "pretrain.procs_per_node=1", "pretrain.monitor=none",
                 "pretrain.phases=[{max_seq_length: 128, max_steps: 10, global_batch_size: 4, "
                 "micro_batch_size: 2, learning_rate: 1.0e-3, warmup_steps: 1}]",
                 "instances.lengths=[{max_seq_length: 128}]"]


def tiny_engine(preset: str, *sets: str, seed: int = 0):
    """A real DeepSpeed engine of the tiny model with ``preset``'s settings (and ``sets``)."""
    import deepspeed

    from bert_core.model.bert import BertForPreTraining

    cfg = load_config(preset, None, [*TINY_ONE_RANK, *sets])
    pre = cfg.pretrain
    torch.manual_seed(seed)
    model = BertForPreTraining(cfg.model.model_copy(update={"vocab_size": 128}))
    groups = param_groups(model, pre.weight_decay)
    client = client_optimizer(pre, pre.phases[0], groups) if uses_client_optimizer(pre) else None
    return deepspeed.initialize(model=model, model_parameters=groups, optimizer=client, config=ds_config(pre, 0))


def tiny_batch() -> dict[str, torch.Tensor]:
    """Two sequences of 16 tokens with 3 masked positions each, seeded."""
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(5, 128, (2, 16), generator=g), "token_type_ids": torch.zeros(2, 16, dtype=torch.long),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
        "masked_lm_positions": torch.tensor([[1, 2, 3]] * 2), "masked_lm_ids": torch.randint(5, 128, (2, 3), generator=g),
        "masked_lm_weights": torch.ones(2, 3), "next_sentence_label": torch.tensor([0, 1]),
    }


class DataParallel:
    """What DeepSpeedConfig asks of an ``mpu``: the data-parallel world size of the preset."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


@pytest.fixture
def one_rank(monkeypatch):
    """This process as rank 0 of 1 (gloo), as an engine built outside the launcher needs."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    deepspeed.init_distributed(dist_backend="gloo")  # once per process; later calls return


@pytest.mark.parametrize("preset", preset_names())
def test_deepspeed_parses_every_preset(preset, one_rank):
    from deepspeed.runtime.config import DeepSpeedConfig

    pre = load_config(preset).pretrain
    for i, phase in enumerate(pre.phases):
        ds = DeepSpeedConfig(ds_config(pre, i, "/runs/x"), mpu=DataParallel(pre.world_size))
        assert ds.train_batch_size == phase.global_batch_size
        assert ds.train_micro_batch_size_per_gpu == phase.micro_batch_size
        assert ds.bfloat16_config.enabled == (pre.precision == "bf16")
        assert ds.zero_optimization_stage == pre.zero_stage
        if pre.precision == "bf16":
            assert ds.grad_accum_dtype == "fp32"
        if not uses_client_optimizer(pre):
            assert ds.optimizer_name == "adamw" and ds.optimizer_params["torch_adam"] is True
            assert ds.optimizer_params.get("fused", False) == (pre.accelerator == "gpu")


@pytest.mark.parametrize("preset", preset_names())
def test_engine_of_every_preset_steps(preset, one_rank):
    """A GPU preset's settings build and step a real engine here: bf16 at ZeRO 1 is DeepSpeed's
    BF16_Optimizer accumulating fp32 gradients, AdamW is torch's (fused on GPU presets)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    pre = load_config(preset, None, TINY_ONE_RANK).pretrain
    engine, optimizer, _, scheduler = tiny_engine(preset)
    model = engine.module
    if pre.precision == "bf16":
        assert isinstance(optimizer, BF16_Optimizer)
        assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    inner = getattr(optimizer, "optimizer", optimizer)
    assert isinstance(inner, torch.optim.AdamW)
    assert inner.defaults["fused"] == (True if pre.accelerator == "gpu" else None)
    batch = tiny_batch()
    scheduler.step()  # as bert_core.pretrain.loop does on a fresh phase: update k uses iteration k - 1
    before = model.bert.embeddings.word_embeddings.weight.detach().float().clone()
    losses = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    assert engine.global_steps == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(before, model.bert.embeddings.word_embeddings.weight.detach().float())


@pytest.mark.parametrize(("sets", "words"), [
    (["pretrain.optimizer=lamb", "pretrain.zero_stage=1"], ["optimizer=lamb", "zero_stage=1", "per layer"]),
    (["pretrain.optimizer=lamb", "pretrain.zero_stage=2", "pretrain.precision=bf16"], ["optimizer=lamb"]),
    (["pretrain.compile_mode=reduce-overhead"], ["compile: true"]),
    (["pretrain.compile=true", "pretrain.compile_mode=reduce-overhead"], ["token_buckets"]),
    (["pretrain.compile=true", "pretrain.compile_mode=reduce-overhead", "pretrain.token_buckets=8",
      "pretrain.procs_per_node=1", 'pretrain.phases=[{"max_seq_length": 128, "max_steps": 10, '
      '"global_batch_size": 512, "micro_batch_size": 128}]'], ["phases[0] taking 4 micro-batches", "CUDA graphs"]),
])
def test_refused_where_deepspeed_cannot_be_right(sets, words):
    with pytest.raises(ConfigError) as err:
        load_config("bert-base-128", None, sets)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_lamb_is_torch_optimizers_per_tensor_lamb_on_gpu_too():
    import torch_optimizer

    pre = load_config("bert-base-128", None, ["pretrain.optimizer=lamb", "pretrain.zero_stage=0",
                                              "pretrain.precision=fp32"]).pretrain
    ds = ds_config(pre, 0)
    assert "optimizer" not in ds and "bf16" not in ds
    groups = [{"params": [torch.nn.Parameter(torch.ones(3))], "weight_decay": 0.01}]
    assert isinstance(client_optimizer(pre, pre.phases[0], groups), torch_optimizer.Lamb)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_bf16_at_zero_0_is_torch_autocast_over_fp32_weights(optimizer, one_rank):
    """bf16 without ZeRO: no BF16_Optimizer (no per-parameter gradient copies, no host reads in the
    step), fp32 weights and gradients, the forward under autocast; LAMB's per-tensor trust ratio
    then runs in bf16 too. DeepSpeed's throughput timers (a device sync per micro-batch) are off."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    sets = ["pretrain.precision=bf16", "pretrain.zero_stage=0", f"pretrain.optimizer={optimizer}"]
    pre = load_config("bert-base-128", None, [*TINY_ONE_RANK, *sets]).pretrain
    ds = ds_config(pre, 0)
    assert "bf16" not in ds and ds["torch_autocast"]["dtype"] == "bfloat16"
    assert ds["timers"] == {"throughput": {"enabled": False}}
    engine, optimizer_, _, _ = tiny_engine("bert-base-128", *sets)
    assert not isinstance(optimizer_, BF16_Optimizer) and not engine.bfloat16_enabled()
    assert not engine.tput_timer.config.enabled
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    batch = tiny_batch()
    losses = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.global_steps == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in engine.module.parameters())


def test_mlm_loss_chunk_reaches_the_engines_model(one_rank):
    """pretrain.mlm_loss_chunk reaches the model build_engine puts in the engine (not its config:
    the exported config.json is the same without it), and under bf16 autocast the chunked loss
    and gradients are the unchunked ones to bf16 rounding."""
    from bert_core.model.checkpoint import hf_config_from_model
    from bert_core.pretrain.loop import build_engine

    batch = tiny_batch()
    results = []
    for chunk in (0, 4):  # 4 rows do not divide the batch's 6 predictions
        sets = ["pretrain.precision=bf16", "pretrain.zero_stage=0", f"pretrain.mlm_loss_chunk={chunk}"]
        config = load_config("bert-base-128", None, [*TINY_ONE_RANK, *sets])
        engine, _ = build_engine(config, 0, vocab_size=128)
        assert engine.module.mlm_loss_chunk == chunk
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        results.append((loss.item(), {n: p.grad.clone() for n, p in engine.module.named_parameters()},
                        hf_config_from_model(engine.module.config)))
        engine.destroy()
    (loss_full, grads_full, exported_full), (loss_chunked, grads_chunked, exported_chunked) = results
    assert exported_chunked == exported_full
    assert loss_chunked == pytest.approx(loss_full, rel=1e-3)
    # bf16 keeps 8 bits of mantissa (rounding 4e-3): each chunk rounds its own partial sums
    for name, grad in grads_full.items():
        assert (grads_chunked[name] - grad).norm() <= 1e-2 * grad.norm(), name
