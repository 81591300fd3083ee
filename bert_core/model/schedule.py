"""The learning-rate schedule of in-process training (fine-tuning, short pre-training runs): a
multiplier for ``torch.optim.lr_scheduler.LambdaLR``."""

from __future__ import annotations

from collections.abc import Callable


def linear_warmup_decay(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: 0 -> 1 over the warmup steps, then linearly down to 0 at the last step."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor
