"""The DeepSpeed config dict, rendered from ``PretrainConfig`` and one phase (never a hand-written JSON).

    python -c "from bert_core.config import load_config; from bert_core.pretrain.ds_config import ds_config; import json; c = load_config('demo'); print(json.dumps(ds_config(c.pretrain, 0, '/tmp/run'), indent=1))"

Batch sizes, precision, ZeRO stage, clipping (the loop's own at ZeRO 0), AdamW (always torch's, fused on GPU: nothing to
compile at start-up), the linear warm-up and decay, a monitor. LAMB is torch-optimizer's
per-tensor ``Lamb``, built here outside DeepSpeed.

``pretrain.deepspeed`` is merged over that (dicts merged key by key) for the settings bertpipe does
not type (offload, activation checkpointing, communication, profiling). ``check_deepspeed`` refuses
a key DeepSpeed does not read (``ds_keys``) and a key the rendering above already sets, naming the
typed setting that sets it: every key path ``render`` writes for the config is owned.
"""

from __future__ import annotations

from typing import Any

from bert_core.config import PretrainConfig, PretrainPhase, _deep_merge
from bert_core.pretrain.errors import PretrainConfigError

# Which typed setting writes a DeepSpeed key (the longest matching prefix names it); a key with no
# entry is owned by the rendering itself.
OWNERS: dict[str, str] = {
    "train_batch_size": "pretrain.phases[].global_batch_size",
    "train_micro_batch_size_per_gpu": "pretrain.phases[].micro_batch_size",
    "gradient_accumulation_steps": "pretrain.phases[].global_batch_size / micro_batch_size",
    "gradient_clipping": "pretrain.gradient_clipping",
    "zero_optimization.stage": "pretrain.zero_stage",
    "seed": "pretrain.seed",
    "scheduler": "pretrain.phases[].learning_rate/warmup_steps/max_steps",
    "optimizer": "pretrain.optimizer",
    "optimizer.params.lr": "pretrain.phases[].learning_rate",
    "optimizer.params.betas": "pretrain.adam_beta1/adam_beta2",
    "optimizer.params.eps": "pretrain.adam_epsilon",
    "optimizer.params.weight_decay": "pretrain.weight_decay",
    "optimizer.params.fused": "pretrain.accelerator",
    "bf16": "pretrain.precision", "fp16": "pretrain.precision",
    "torch_autocast": "pretrain.precision", "data_types": "pretrain.precision",
    "wandb": "pretrain.monitor", "csv_monitor": "pretrain.monitor", "tensorboard": "pretrain.monitor",
}


def gradient_accumulation_steps(cfg: PretrainConfig, phase: PretrainPhase) -> int:
    return phase.global_batch_size // (phase.micro_batch_size * cfg.world_size)


def loop_clipping(cfg: PretrainConfig) -> float:
    """The gradient norm the training loop clips to itself (0: none, or DeepSpeed's own): at ZeRO 0
    without loss scaling, where DeepSpeed's clipping builds tensors from host values every step,
    torch's foreach clipping computes the same on the device (``loop.backward_and_step``)."""
    return cfg.gradient_clipping if cfg.zero_stage == 0 and cfg.precision != "fp16" else 0.0


def uses_client_optimizer(cfg: PretrainConfig) -> bool:
    """LAMB: torch-optimizer's per-tensor Lamb, built outside DeepSpeed (whose FusedLamb needs a
    compiler and computes its trust ratio per flattened group)."""
    return cfg.optimizer == "lamb"


def ds_config(cfg: PretrainConfig, phase_index: int, run_dir: str | None = None) -> dict[str, Any]:
    """The config dict for ``deepspeed.initialize(config=...)`` for phase ``phase_index``: the
    rendering of the typed settings with ``pretrain.deepspeed`` merged over it."""
    check_deepspeed(cfg)
    return _deep_merge(render(cfg, phase_index, run_dir), cfg.deepspeed)


def check_deepspeed(cfg: PretrainConfig) -> None:
    """Refuse, in one line, the keys of ``pretrain.deepspeed`` that DeepSpeed does not read and
    those that the typed settings already set (for any phase)."""
    if not cfg.deepspeed:
        return
    from bert_core.pretrain.ds_keys import check_keys

    problems = check_keys(cfg.deepspeed)
    owned = {path for i in range(len(cfg.phases)) for path in _leaf_paths(render(cfg, i, "RUN"))}
    if uses_client_optimizer(cfg):
        owned.add("optimizer")  # LAMB is built outside DeepSpeed, which refuses a second optimizer
    for path in _leaf_paths(cfg.deepspeed):
        hit = next((o for o in sorted(owned) if o == path or o.startswith(path + ".")
                    or path.startswith(o + ".")), None)
        if hit is None:
            continue
        owner = _owner(hit if hit.startswith(path) else path)
        problems.append(
            f"pretrain.deepspeed.{path} conflicts with {owner}, which sets it; set {owner} instead"
            if owner else f"pretrain.deepspeed.{path}: bertpipe sets {hit} itself "
            "(bert_core/pretrain/ds_config.py); leave it out")
    if problems:
        raise PretrainConfigError("; ".join(problems))


def _owner(path: str) -> str | None:
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in OWNERS:
            return OWNERS[".".join(parts[:n])]
    return None


def _leaf_paths(node: dict[str, Any], prefix: str = "") -> list[str]:
    """``a.b.c`` for every value of a nested dict that is not itself a dict (an empty dict, which
    a merge leaves as it was, has none)."""
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out += _leaf_paths(value, path + ".") if isinstance(value, dict) else [path]
    return out


def render(cfg: PretrainConfig, phase_index: int, run_dir: str | None = None) -> dict[str, Any]:
    """The DeepSpeed config the typed settings give for phase ``phase_index``, before
    ``pretrain.deepspeed``.

    bf16 at ZeRO 0 is torch autocast over fp32 weights (DeepSpeed's ``torch_autocast``, gradients
    reduced in fp32); at ZeRO >= 1 it is DeepSpeed's bf16 weights with fp32 master weights and fp32
    gradient accumulation. DeepSpeed's throughput timers stay off: they synchronize the device on
    every micro-batch, and the loop reports its own rates.
    """
    phase = cfg.phases[phase_index]
    out: dict[str, Any] = {
        "train_batch_size": phase.global_batch_size,
        "train_micro_batch_size_per_gpu": phase.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(cfg, phase),
        "gradient_clipping": 0.0 if loop_clipping(cfg) else cfg.gradient_clipping,
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,  # our own metrics.jsonl reports progress
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False}},
        "seed": cfg.seed,
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": phase.max_steps,
                "warmup_min_lr": 0.0,
                "warmup_max_lr": phase.learning_rate,
                # DeepSpeed refuses 0 (and warms up over at least 2 steps anyway)
                "warmup_num_steps": max(1, phase.warmup_steps),
                "warmup_type": "linear",
            },
        },
    }
    if cfg.precision == "bf16" and cfg.zero_stage == 0:
        # An empty list of "lower precision safe modules": every gradient is reduced in fp32.
        out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    elif cfg.precision == "bf16":
        out["bf16"] = {"enabled": True}
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    elif cfg.precision == "fp16":
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if not uses_client_optimizer(cfg):
        out["optimizer"] = _optimizer_section(cfg, phase)
    if cfg.monitor == "wandb":
        # one W&B run per phase, grouped by the run folder's name
        group = run_dir.rstrip("/").rsplit("/", 1)[-1] if run_dir else None
        out["wandb"] = {"enabled": True, "project": "bertpipe", "group": group}
    elif cfg.monitor != "none" and run_dir:
        section = "csv_monitor" if cfg.monitor == "csv" else "tensorboard"
        out[section] = {"enabled": True, "output_path": f"{run_dir.rstrip('/')}/monitor/",
                        "job_name": f"phase{phase_index + 1}"}
    return out


def _optimizer_section(cfg: PretrainConfig, phase: PretrainPhase) -> dict[str, Any]:
    """AdamW: DeepSpeed passes every param but ``torch_adam`` and ``adam_w_mode`` on to
    ``torch.optim.AdamW`` (``fused`` included)."""
    params: dict[str, Any] = {
        "lr": phase.learning_rate,
        "betas": [cfg.adam_beta1, cfg.adam_beta2],
        "eps": cfg.adam_epsilon,
        "weight_decay": cfg.weight_decay,
        "torch_adam": True,
        "adam_w_mode": True,
    }
    if cfg.accelerator == "gpu":
        params["fused"] = True
    return {"type": "AdamW", "params": params}


def client_optimizer(cfg: PretrainConfig, phase: PretrainPhase, groups: list[dict[str, Any]]) -> Any:
    """LAMB from torch-optimizer: per-tensor trust ratios, plain torch ops on any device."""
    import torch_optimizer

    return torch_optimizer.Lamb(groups, lr=phase.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
