"""A bf16 run's DeepSpeed checkpoints through our weights-only reads (``weights_only_loads``):
what DeepSpeed's ``BF16_Optimizer`` (ZeRO 1) and its ZeRO-2 optimizer pickle is on the
allow-list, so a resume loads the newest checkpoint with none skipped and continues exactly,
and the export consolidates the fp32 master weights. bf16 on CPU is slow, so the model is tiny.

    .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bert_core.model.checkpoint import _deepspeed_checkpoint_types
from bert_core.model.export import load_deepspeed_state_dict
from bert_core.pretrain.checkpoints import fp32_master_model, resume, save_checkpoint
from bert_core.pretrain.run_folder import checkpoint_dir

sys.path.insert(0, str(Path(__file__).parent))
from test_ds_config import one_rank, tiny_batch, tiny_engine  # noqa: E402, F401 (one_rank: a fixture)


def optimizer_step(engine, batch) -> float:
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        engine.step()
    return loss.float().item()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("zero_stage", [1])  # the presets' stage
def test_bf16_checkpoint_resumes_and_exports_weights_only(zero_stage, tmp_path: Path, capsys):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    batch = tiny_batch()
    run = str(tmp_path / "run")
    first = tiny_engine("bert-base-128", f"pretrain.zero_stage={zero_stage}")[0]
    assert isinstance(first.optimizer, BF16_Optimizer) == (zero_stage == 1)
    for _ in range(2):
        optimizer_step(first, batch)
    save_checkpoint(first, run, 0, 2, {"step": 2, "loader": {"position": 8}}, rank=0)

    # everything DeepSpeed pickled into the step's files is on the allow-list
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in _deepspeed_checkpoint_types()}
    files = sorted(Path(checkpoint_dir(run, 0), "step2").glob("*.pt"))
    assert any("optim_states" in f.name for f in files)
    for f in files:
        assert set(torch.serialization.get_unsafe_globals_in_checkpoint(str(f))) <= allowed, f.name

    exported = load_deepspeed_state_dict(checkpoint_dir(run, 0))
    expected_third = optimizer_step(first, batch)
    resumed = tiny_engine("bert-base-128", f"pretrain.zero_stage={zero_stage}", seed=5)[0]  # other weights
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

    # the run's export takes the fp32 master weights, not the bf16 copy the engine trains
    master = dict(fp32_master_model(resumed).named_parameters())
    for name, p in resumed.module.named_parameters():
        assert master[name].dtype == torch.float32
        assert torch.equal(master[name].detach().to(torch.bfloat16), p.detach()), name
    assert any(not torch.equal(master[n].detach(), p.detach().float()) for n, p in resumed.module.named_parameters())
