"""A bf16 run's DeepSpeed checkpoints through our weights-only reads (``weights_only_loads``):
what DeepSpeed's ``BF16_Optimizer`` (ZeRO 1) and its ZeRO-2 optimizer pickle is on the
allow-list, so a resume loads the newest checkpoint with none skipped and continues exactly,
and the export consolidates the fp32 master weights. bf16 on CPU is slow, so the model is tiny.

    .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from bert_core.config import load_config
from bert_core.model.checkpoint import _deepspeed_checkpoint_types
from bert_core.model.export import load_deepspeed_state_dict
from bert_core.model.weight_decay import param_groups
from bert_core.pretrain.ds_config import ds_config
from bert_core.pretrain.loop import checkpoint_dir, resume, save_checkpoint

TINY = ["model.size=custom", "model.hidden_size=32", "model.num_attention_heads=2", "model.intermediate_size=64",
        "model.num_hidden_layers=1", "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
        "pretrain.nodes=1", "pretrain.procs_per_node=1", "pretrain.monitor=none", "pretrain.precision=bf16",
        "pretrain.phases=[{max_seq_length: 128, max_steps: 10, global_batch_size: 4, micro_batch_size: 2, "
        "learning_rate: 1.0e-3, warmup_steps: 1}]", "instances.lengths=[{max_seq_length: 128}]"]


@pytest.fixture
def one_rank(monkeypatch):
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    deepspeed.init_distributed(dist_backend="gloo")  # once per process; later calls return


def engine_of(zero_stage: int, seed: int):
    import deepspeed

    from bert_core.model.bert import BertForPreTraining

    cfg = load_config("bert-base-128", None, [*TINY, f"pretrain.zero_stage={zero_stage}"])
    torch.manual_seed(seed)
    model = BertForPreTraining(cfg.model.model_copy(update={"vocab_size": 128}))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01),
                                      config=ds_config(cfg.pretrain, 0))
    return engine


def optimizer_step(engine, batch) -> float:
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        engine.step()
    return loss.float().item()


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_bf16_checkpoint_resumes_and_exports_weights_only(zero_stage, one_rank, tmp_path: Path, capsys):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(5, 128, (2, 16), generator=g), "token_type_ids": torch.zeros(2, 16, dtype=torch.long),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
        "masked_lm_positions": torch.tensor([[1, 2, 3]] * 2), "masked_lm_ids": torch.randint(5, 128, (2, 3), generator=g),
        "masked_lm_weights": torch.ones(2, 3), "next_sentence_label": torch.tensor([0, 1]),
    }
    run = str(tmp_path / "run")
    first = engine_of(zero_stage, seed=0)
    assert isinstance(first.optimizer, BF16_Optimizer) == (zero_stage == 1)
    for _ in range(2):
        optimizer_step(first, batch)
    save_checkpoint(first, checkpoint_dir(run, 0), 2, {"step": 2, "loader": {"position": 8}}, rank=0)

    # everything DeepSpeed pickled into the step's files is on the allow-list
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in _deepspeed_checkpoint_types()}
    files = sorted(Path(checkpoint_dir(run, 0), "step2").glob("*.pt"))
    assert any("optim_states" in f.name for f in files)
    for f in files:
        assert set(torch.serialization.get_unsafe_globals_in_checkpoint(str(f))) <= allowed, f.name

    exported = load_deepspeed_state_dict(checkpoint_dir(run, 0))
    expected_third = optimizer_step(first, batch)
    resumed = engine_of(zero_stage, seed=5)  # other weights, until the checkpoint loads
    capsys.readouterr()
    client = resume(resumed, run, 0, rank=0)
    assert (client["step"], client["loader"]) == (2, {"position": 8})  # beside DeepSpeed's own keys
    assert "skipped" not in capsys.readouterr().out
    weights = dict(resumed.module.named_parameters())
    for name, value in exported.items():
        assert value.dtype == torch.float32
        if name in weights:  # the bf16 weights are the rounded fp32 master weights
            assert torch.equal(value.to(torch.bfloat16), weights[name].detach()), name
    assert optimizer_step(resumed, batch) == expected_third
