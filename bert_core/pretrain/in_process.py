"""Pre-training in this process, without DeepSpeed: the seeded random init every run starts from
(and the baseline that fine-tuning compares with), and masked-LM steps for short runs and studies
that train many small models side by side.

    python -c "from bert_core.config import ModelConfig; from bert_core.pretrain.in_process import random_init; \
print(random_init(ModelConfig(size='tiny', vocab_size=99), seed=42).config.hidden_size)"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from bert_core.config import ModelConfig, PretrainConfig


def random_init(config: ModelConfig, seed: int) -> Any:
    """A ``BertForPreTraining`` of ``config`` with the weights a pre-training run of ``seed``
    starts from."""
    import torch

    from bert_core.model.bert import BertForPreTraining

    torch.manual_seed(seed)
    return BertForPreTraining(config)


def train_mlm(model: Any, instances: str, config: PretrainConfig, phase_index: int = 0, device: str = "cpu",
              masking: dict[str, Any] | None = None, log_every: int = 500,
              on_step: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """The phase's ``max_steps`` optimizer steps on ``instances`` in this process: batches of its
    ``global_batch_size`` at its length, AdamW with the config's betas, epsilon and weight decay
    (matrices only), linear warmup then linear decay, gradient clipping; ``masking`` overrides
    fields of the instances' dynamic masking. The loss and masked-LM accuracy every ``log_every``
    steps and at the last."""
    import torch

    from bert_core.model.schedule import linear_warmup_decay
    from bert_core.model.weight_decay import param_groups
    from bert_core.pretrain.data import PretrainingLoader, to_device

    phase = config.phases[phase_index]
    model.to(device).train()
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=phase.learning_rate,
                                  betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(phase.warmup_steps, phase.max_steps))
    loader = PretrainingLoader(instances, max_seq_length=phase.max_seq_length,
                               micro_batch_size=phase.global_batch_size, seed=config.seed + phase_index)
    if masking:
        loader.masking = replace(loader.masking, **masking)
    batches = iter(loader)
    log = []
    for step in range(phase.max_steps):
        result = model(**to_device(next(batches), device))
        result["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clipping)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step:
            on_step(step)
        if step % log_every == 0 or step == phase.max_steps - 1:
            log.append({"step": step, "loss": float(result["mlm_loss"]), "mlm_acc": float(result["mlm_acc"])})
    return log


def short_run(max_seq_length: int, steps: int, batch_size: int, learning_rate: float, weight_decay: float,
              seed: int) -> PretrainConfig:
    """One phase of ``steps`` at ``max_seq_length``, ``batch_size`` sequences a step, warmup over
    a tenth of the steps: the config :func:`train_mlm` reads for a short run."""
    from bert_core.config import PretrainPhase

    phase = PretrainPhase(max_seq_length=max_seq_length, max_steps=steps, global_batch_size=batch_size,
                          micro_batch_size=batch_size, learning_rate=learning_rate,
                          warmup_steps=max(1, steps // 10))
    return PretrainConfig(phases=[phase], procs_per_node=1, weight_decay=weight_decay, seed=seed)
