"""The DeepSpeed config dict, rendered from ``PretrainConfig`` and one phase (never a hand-written JSON).

    python -c "from bert_core.config import load_config; from bert_core.pretrain.ds_config import ds_config; \
import json; c = load_config('demo'); print(json.dumps(ds_config(c.pretrain, 0, '/tmp/run'), indent=1))"

- batch: ``train_batch_size`` = the phase's global batch, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps`` = global / (micro x ranks) (the config validates divisibility);
- precision fp32 / bf16 / fp16 (dynamic loss scaling), ZeRO stage, gradient clipping; bf16
  names its gradient accumulation dtype, fp32, rather than leaving it to DeepSpeed's default
  (the model's dtype): at ZeRO 1 DeepSpeed then runs its ``BF16_Optimizer`` (fp32 master weights,
  fp32 gradients), at ZeRO 2 its ZeRO optimizer accumulating in fp32. ZeRO 0 has no fp32
  accumulation for bf16 (DeepSpeed refuses the mix), so the config asks for ZeRO >= 1 with bf16;
- AdamW with the paper's settings (β 0.9/0.999, ε 1e-6, weight decay 0.01) in DeepSpeed's
  optimizer section, always torch's ``AdamW`` (``torch_adam: true``): nothing is compiled when
  the engine starts (DeepSpeed's FusedAdam needs nvcc and ninja), and on GPU ``fused: true``
  gives torch's one-kernel CUDA update;
- LAMB: torch-optimizer's ``Lamb`` (a maintained library), built by :func:`client_optimizer`
  on CPU and GPU alike, with no optimizer section in the config. Its trust ratio is per tensor,
  i.e. per layer as in the LAMB paper; ZeRO would hand it flat partitions instead, so the
  config refuses LAMB with ZeRO >= 1;
- ``WarmupDecayLR`` with ``warmup_type: linear`` (its default warms up on a log curve): linear
  warmup to the peak, then linear decay to 0 at ``max_steps``;
- a CSV or TensorBoard monitor under ``<run>/monitor``.

Weight decay skips biases and LayerNorm parameters: the optimizer gets the two groups of
:func:`bert_core.model.weight_decay.param_groups`.
"""

from __future__ import annotations

from typing import Any

from bert_core.config import PretrainConfig, PretrainPhase


def gradient_accumulation_steps(cfg: PretrainConfig, phase: PretrainPhase) -> int:
    return phase.global_batch_size // (phase.micro_batch_size * cfg.world_size)


def uses_client_optimizer(cfg: PretrainConfig) -> bool:
    """LAMB: torch-optimizer's per-tensor Lamb, built outside DeepSpeed (whose FusedLamb needs a
    compiler and computes its trust ratio per flattened group)."""
    return cfg.optimizer == "lamb"


def ds_config(cfg: PretrainConfig, phase_index: int, run_dir: str | None = None) -> dict[str, Any]:
    """The config dict for ``deepspeed.initialize(config=...)`` for phase ``phase_index``."""
    phase = cfg.phases[phase_index]
    out: dict[str, Any] = {
        "train_batch_size": phase.global_batch_size,
        "train_micro_batch_size_per_gpu": phase.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(cfg, phase),
        "gradient_clipping": cfg.gradient_clipping,
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,  # our own metrics.jsonl reports progress
        "wall_clock_breakdown": False,
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
    if cfg.precision == "bf16":
        out["bf16"] = {"enabled": True}
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    elif cfg.precision == "fp16":
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if not uses_client_optimizer(cfg):
        out["optimizer"] = _optimizer_section(cfg, phase)
    if cfg.monitor != "none" and run_dir:
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
