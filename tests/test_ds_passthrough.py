"""``pretrain.deepspeed``: DeepSpeed settings bertpipe does not type, merged over the rendered
DeepSpeed config, reaching a real engine; unknown and owned keys refused in one line (exit 2).

    .venv/bin/python -m pytest -q tests/test_ds_passthrough.py
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from bert_core.config import config_hash, load_config, versioned
from bert_core.pretrain.ds_config import ds_config, render
from bert_core.pretrain.ds_keys import known_keys
from bert_core.pretrain.errors import PretrainConfigError
from flows.cli.main import app
from tests.test_ds_config import TINY_ONE_RANK, one_rank, tiny_batch, tiny_engine  # noqa: F401 (one_rank is a fixture)

CHECKPOINTING = ("pretrain.deepspeed.activation_checkpointing="
                 "{partition_activations: false, number_checkpoints: 2}")


def _show(*sets: str) -> tuple[int, str]:
    args = ["config", "show", "--preset", "demo"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, SystemExit | None), result.exception  # handled: no traceback
    lines = [line for line in result.output.splitlines() if line.strip()]
    return result.exit_code, lines[-1] if lines else ""


@pytest.mark.usefixtures("one_rank")
def test_a_valid_key_reaches_the_engine_config():
    engine, *_ = tiny_engine("demo", "pretrain.zero_stage=1", CHECKPOINTING,
                             "pretrain.deepspeed.zero_optimization.reduce_bucket_size=1000000")
    assert engine._config.activation_checkpointing_config.number_checkpoints == 2
    assert engine._config.activation_checkpointing_config.partition_activations is False
    assert engine._config.zero_config.reduce_bucket_size == 1_000_000
    assert engine._config.zero_optimization_stage == 1  # the typed setting is still there


@pytest.mark.usefixtures("one_rank")
def test_activation_checkpointing_recomputes_each_layer_and_leaves_the_gradients_as_they_were():
    from bert_core.pretrain.loop import build_engine

    runs = {}
    for on in (False, True):
        cfg = load_config("demo", None, [*TINY_ONE_RANK, "model.hidden_dropout_prob=0",
                                         "model.attention_probs_dropout_prob=0", *([CHECKPOINTING] if on else [])])
        engine, _ = build_engine(cfg, 0, 128)
        calls = []
        engine.module.bert.encoder.layer[0].register_forward_hook(lambda *_, calls=calls: calls.append(1))
        loss = engine(**tiny_batch())["loss"]
        engine.backward(loss)
        runs[on] = loss.item(), len(calls), [p.grad.clone() for p in engine.module.parameters()]
    (loss_off, calls_off, grads_off), (loss_on, calls_on, grads_on) = runs[False], runs[True]
    assert (calls_off, calls_on) == (1, 2)  # the layer ran again in the backward pass
    assert loss_on == pytest.approx(loss_off, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads_off, grads_on, strict=True))


@pytest.mark.usefixtures("one_rank")
def test_optimizer_offload_to_cpu_reaches_the_engine_and_steps():
    engine, *_ = tiny_engine("demo", "pretrain.zero_stage=2",
                             "pretrain.deepspeed.zero_optimization.offload_optimizer={device: cpu}")
    assert engine._config.zero_config.offload_optimizer.device == "cpu"
    assert engine.zero_cpu_offload()
    before = [p.detach().clone() for p in engine.module.parameters()]
    for _ in range(6):  # three optimizer steps of two micro-batches (the first two at warm-up lr 0)
        engine.backward(engine(**tiny_batch())["loss"])
        engine.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))


def test_the_mapping_is_merged_over_the_rendering_dict_by_dict():
    pre = load_config("demo", None, ["pretrain.zero_stage=2",
                                     "pretrain.deepspeed.zero_optimization.offload_optimizer.device=cpu"]).pretrain
    merged, rendered = ds_config(pre, 0, "RUN"), render(pre, 0, "RUN")
    assert merged["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert {k: v for k, v in merged.items() if k != "zero_optimization"} == {
        k: v for k, v in rendered.items() if k != "zero_optimization"}
    assert ds_config(load_config("demo").pretrain, 0) == render(load_config("demo").pretrain, 0)


def test_the_known_keys_come_from_deepspeed_itself():
    known = known_keys()
    assert {"zero_optimization", "activation_checkpointing", "comms_logger", "flops_profiler", "aio",
            "optimizer", "scheduler"} <= known[()]
    assert {"offload_optimizer", "offload_param", "stage3_max_live_parameters"} <= known[("zero_optimization",)]
    assert {"device", "pin_memory"} <= known[("zero_optimization", "offload_optimizer")]
    assert "number_checkpoints" in known[("activation_checkpointing",)]


@pytest.mark.parametrize("value, needle", [
    ('{"zero_optimisation": {}}',
     "pretrain.deepspeed.zero_optimisation: not a key DeepSpeed 0.19.8 reads; "
     "did you mean pretrain.deepspeed.zero_optimization?"),
    ("{zero_optimization: {offload_optimiser: {device: cpu}}}",
     "pretrain.deepspeed.zero_optimization.offload_optimiser: not a key DeepSpeed 0.19.8 reads; "
     "did you mean pretrain.deepspeed.zero_optimization.offload_optimizer?"),
    ("{zero_optimization: {offload_optimizer: {devise: cpu}}}",
     "did you mean pretrain.deepspeed.zero_optimization.offload_optimizer.device?"),
    ("{activation_checkpointing: {partition_activation: true}}",
     "did you mean pretrain.deepspeed.activation_checkpointing.partition_activations?"),
    ("{amp: {enabled: true}}", "pretrain.deepspeed.amp: DeepSpeed 0.19.8 refuses it: NVIDIA Apex AMP"),
])
def test_an_unknown_key_is_one_line_naming_the_closest_known_one(value, needle):
    code, last = _show(f"pretrain.deepspeed={value}")
    assert code == 2 and needle in last, last


@pytest.mark.parametrize("sets, needle", [
    (["pretrain.deepspeed.zero_optimization.stage=2"],
     "pretrain.deepspeed.zero_optimization.stage conflicts with pretrain.zero_stage, which sets it; "
     "set pretrain.zero_stage instead"),
    (["pretrain.deepspeed.train_micro_batch_size_per_gpu=4"],
     "conflicts with pretrain.phases[].micro_batch_size"),
    (["pretrain.deepspeed.gradient_clipping=0.5"], "conflicts with pretrain.gradient_clipping"),
    (["pretrain.deepspeed.optimizer={type: Adam, params: {lr: 0.1}}"], "conflicts with pretrain.optimizer"),
    (["pretrain.precision=bf16", "pretrain.zero_stage=1", "pretrain.deepspeed.bf16.enabled=false"],
     "pretrain.deepspeed.bf16.enabled conflicts with pretrain.precision"),
    (["pretrain.deepspeed.scheduler=null"], "pretrain.deepspeed.scheduler conflicts with pretrain.phases[]"),
    (["pretrain.deepspeed.wall_clock_breakdown=true"], "bertpipe sets wall_clock_breakdown itself"),
])
def test_a_key_a_typed_setting_sets_is_one_line_naming_both(sets, needle):
    code, last = _show(*sets)
    assert code == 2 and needle in last, last


def test_lamb_owns_the_optimizer_section_it_leaves_out():
    pre = load_config("demo", None, ["pretrain.optimizer=lamb"]).pretrain
    assert "optimizer" not in ds_config(pre, 0)
    with pytest.raises(PretrainConfigError, match="pretrain.deepspeed.optimizer.type conflicts with pretrain.optimizer"):
        ds_config(pre.model_copy(update={"deepspeed": {"optimizer": {"type": "Adam"}}}), 0)


def test_config_show_prints_the_mapping_and_the_merged_deepspeed_config():
    result = CliRunner().invoke(app, ["config", "show", "--preset", "demo", "--json", "--set", CHECKPOINTING])
    assert result.exit_code == 0, result.output
    assert '"number_checkpoints": 2' in result.output and '"deepspeed": {' in result.output
    result = CliRunner().invoke(app, ["config", "show", "--preset", "demo", "--deepspeed", "--set", CHECKPOINTING])
    assert result.exit_code == 0, result.output
    assert "activation_checkpointing:\n  partition_activations: false\n  number_checkpoints: 2" in result.output
    assert "train_micro_batch_size_per_gpu: 32" in result.output


def test_the_version_changes_only_when_set():
    pre = load_config("demo").pretrain
    assert "deepspeed" not in versioned(pre)  # a version stored before the field keeps its hash
    one = load_config("demo", None, [CHECKPOINTING]).pretrain
    two = load_config("demo", None, [CHECKPOINTING.replace("number_checkpoints: 2", "number_checkpoints: 3")]).pretrain
    assert versioned(one)["deepspeed"] == {"activation_checkpointing": {"partition_activations": False,
                                                                         "number_checkpoints": 2}}
    assert len({config_hash(pre), config_hash(one), config_hash(two)}) == 3
