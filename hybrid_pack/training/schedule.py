"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr(step) = base * factor``: factor rises linearly over ``warmup_steps``, then follows a cosine
    from 1 down to ``min_lr_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
