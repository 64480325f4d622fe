"""AdamW with decoupled weight decay (not on norms and biases) and the learning-rate schedule."""
from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn

from mindscale.config import TrainConfig
from mindscale.train.schedule import decays, lr_at


def lr_table(t: TrainConfig) -> Tensor:
    """Per-step learning rates; MindSpore optimizers index a 1-D tensor by their global step."""
    return Tensor(np.array([lr_at(s, t) for s in range(t.steps)], dtype=np.float32))


def build_optimizer(params: list, t: TrainConfig, learning_rate=None) -> nn.Optimizer:
    """`learning_rate`: the schedule (default: train.*'s as a per-step table)."""
    decay = [p for p in params if decays(p.name, p.shape)]
    no_decay = [p for p in params if not decays(p.name, p.shape)]
    groups = [group for group in ({"params": decay, "weight_decay": t.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}) if group["params"]]  # LoRA: no norms
    groups.append({"order_params": params})
    return nn.AdamWeightDecay(groups, learning_rate=lr_table(t) if learning_rate is None else learning_rate, beta1=t.adam_beta1, beta2=t.adam_beta2,
                              eps=t.adam_eps)
