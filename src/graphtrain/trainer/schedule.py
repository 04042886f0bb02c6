"""Learning-rate schedule: linear warmup, then decay to ``lr * min_lr_ratio``.

`lr_at(step, cfg, total_steps)` is a pure function of the 0-based optimizer step, so a resumed run
needs no scheduler state: the checkpoint's step is enough.

    warmup   step < warmup_steps         lr * (step + 1) / warmup_steps
    decay    warmup_steps <= step        min_lr + (lr - min_lr) * shape(progress)
             progress = (step - warmup_steps) / (total_steps - 1 - warmup_steps), clamped to [0, 1]
             so the last step (total_steps - 1) runs at exactly lr * min_lr_ratio.

    shape    cosine: (1 + cos(pi * p)) / 2    linear: 1 - p    poly: (1 - p) ** poly_power
             constant: the peak lr throughout (min_lr_ratio is ignored)
"""

from __future__ import annotations

import math

from graphtrain.config.sections import OptimConfig

SCHEDULES = ("cosine", "linear", "poly", "constant")


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate for 0-based optimizer step `step` of a `total_steps`-step run."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    peak = cfg.lr
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    min_lr = peak * cfg.min_lr_ratio
    decay_steps = total_steps - 1 - cfg.warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.schedule == "linear":
        shape = 1.0 - progress
    elif cfg.schedule == "poly":
        shape = (1.0 - progress) ** cfg.poly_power
    else:  # the config's Literal type makes this unreachable
        raise AssertionError(f"unknown schedule {cfg.schedule!r}; expected one of {SCHEDULES}")
    return min_lr + (peak - min_lr) * shape


def set_lr(optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (groups keep their own weight decay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
