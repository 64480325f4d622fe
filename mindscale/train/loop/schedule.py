"""The learning-rate schedule and the weight-decay rule, free of MindSpore so that peers (the torch
benchmark) can follow exactly the same rules without importing it."""
from __future__ import annotations

import math

from mindscale.config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate used by optimizer step `step` (0-based): linear warm-up, then decay to min_lr."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    span = max(t.steps - t.warmup_steps, 1)
    progress = min((step - t.warmup_steps) / span, 1.0)
    if t.lr_schedule == "linear":
        return t.lr - (t.lr - t.min_lr) * progress
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def decays(name: str, shape: tuple) -> bool:
    """Weight decay applies to matrices (linear and embedding weights), not to norms or biases."""
    return len(shape) >= 2 and "norm" not in name
