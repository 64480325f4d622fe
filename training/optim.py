"""AdamW with decoupled weight decay (not on norms and biases) and the learning-rate schedule."""
from __future__ import annotations

import math

import numpy as np
from mindspore import Tensor, nn

from training.config import TrainConfig


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


def lr_table(t: TrainConfig) -> Tensor:
    """Per-step learning rates; MindSpore optimizers index a 1-D tensor by their global step."""
    return Tensor(np.array([lr_at(s, t) for s in range(t.steps)], dtype=np.float32))


def decays(name: str, shape: tuple) -> bool:
    """Weight decay applies to matrices (linear and embedding weights), not to norms or biases."""
    return len(shape) >= 2 and "norm" not in name


def build_optimizer(params: list, t: TrainConfig) -> nn.Optimizer:
    decay = [p for p in params if decays(p.name, p.shape)]
    no_decay = [p for p in params if not decays(p.name, p.shape)]
    groups = [group for group in ({"params": decay, "weight_decay": t.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}) if group["params"]]  # LoRA: no norms
    groups.append({"order_params": params})
    return nn.AdamWeightDecay(groups, learning_rate=lr_table(t), beta1=t.adam_beta1, beta2=t.adam_beta2,
                              eps=t.adam_eps)
