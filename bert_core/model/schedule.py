"""Learning-rate schedules: the multiplier of in-process training (fine-tuning, short pre-training
runs) for ``torch.optim.lr_scheduler.LambdaLR``, and the rate of each DeepSpeed pre-training step."""

from __future__ import annotations

from collections.abc import Callable


def linear_warmup_decay(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: 0 -> 1 over the warmup steps, then linearly down to 0 at the last step."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def warmup_iterations(warmup_steps: int) -> int:
    """The warm-up length DeepSpeed's ``WarmupLR`` uses: at least 2 iterations."""
    return max(2, warmup_steps)


def warmup_decay_lr(peak: float, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning rate of pre-training step ``k`` (1-based): DeepSpeed's ``WarmupDecayLR`` as
    ``pretrain.ds_config`` renders it and the loop steps it (update ``k`` runs at the schedule's
    iteration ``k - 1``). Linear from 0 to ``peak`` over ``W = warmup_iterations(warmup_steps)``
    iterations, then linear to 0 at ``total_steps``. Up to iteration ``W`` (step ``W + 1``) the
    rate does not depend on ``total_steps``; after it, it does."""
    warmup = warmup_iterations(warmup_steps)

    def lr(step: int) -> float:
        i = step - 1
        if i < warmup:
            return peak * i / warmup
        return peak * max(0.0, (total_steps - i) / max(1.0, total_steps - warmup))

    return lr
