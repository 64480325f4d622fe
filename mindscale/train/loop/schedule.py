"""The learning-rate schedule and the weight-decay rule, free of MindSpore so that peers (the torch
benchmark) can follow exactly the same rules without importing it."""
from __future__ import annotations

import numpy as np

from mindscale.config import TrainConfig


def lr_at(step, t: TrainConfig):
    """Learning rate used by optimizer step `step` (0-based): linear warm-up, then decay to min_lr. `step` is
    an int (a float comes back) or a numpy array of them (an array comes back: the whole run's table is one
    call, where a Python loop over the 1.2M steps of llama3_405b took seconds at every start)."""
    s = np.asarray(step, dtype=np.float64)
    if t.lr_schedule == "constant":
        after = np.full_like(s, t.lr)
    else:
        progress = np.minimum((s - t.warmup_steps) / max(t.steps - t.warmup_steps, 1), 1.0)
        after = t.lr - (t.lr - t.min_lr) * progress if t.lr_schedule == "linear" else \
            t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + np.cos(np.pi * progress))
    lr = np.where(s < t.warmup_steps, t.lr * (s + 1) / max(t.warmup_steps, 1), after)
    return float(lr) if lr.ndim == 0 else lr


def decays(name: str, shape: tuple) -> bool:
    """Weight decay applies to matrices (linear and embedding weights), not to norms or biases."""
    return len(shape) >= 2 and "norm" not in name
