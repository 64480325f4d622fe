"""AdamW with decoupled weight decay (not on norms and biases) and the learning-rate schedule."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn
from mindspore.common.initializer import initializer

from mindscale.config import TrainConfig
from mindscale.train.loop.schedule import decays, lr_at


def lr_table(t: TrainConfig) -> Tensor:
    """Per-step learning rates; MindSpore optimizers index a 1-D tensor by their global step."""
    return Tensor(lr_at(np.arange(t.steps), t).astype(np.float32))


def fp32_state(params: ParameterTuple, prefix: str) -> ParameterTuple:
    """Zeros in fp32 shaped like `params`, named <prefix>.<name>, each registered as a clone of its
    parameter, as Parameter.clone does (which keeps the parameter's dtype): the parallel compiler then
    slices and shards it like the parameter (it finds a parameter's clones in `cloned_obj`). MindFormers'
    AdamW builds its fp32 state the same way."""
    state = []
    for param in params:
        moment = Parameter(initializer("zeros", param.shape, ms.float32))
        moment.param_info = param.param_info.clone()
        info = param.param_info
        info.cloned_obj = [*getattr(info, "cloned_obj", []), moment]
        param.param_info = info
        moment.name = f"{prefix}.{param.name}"
        state.append(moment)
    return ParameterTuple(state)


class AdamW(nn.AdamWeightDecay):
    """MindSpore's AdamWeightDecay with both moments in fp32 whatever the parameter dtype. Its own moments
    take the parameter's: with param_dtype float16 the second moment (g², averaged) would flush to zero
    below 6e-8 and overflow above 65504."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.moments1 = fp32_state(self._parameters, "adam_m")
        self.moments2 = fp32_state(self._parameters, "adam_v")


def build_optimizer(params: list, t: TrainConfig, learning_rate=None) -> nn.Optimizer:
    """`learning_rate`: the schedule (default: train.*'s as a per-step table)."""
    decay = [p for p in params if decays(p.name, p.shape)]
    no_decay = [p for p in params if not decays(p.name, p.shape)]
    groups = [
        group
        for group in ({"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if group["params"]
    ]  # LoRA: no norms
    groups.append({"order_params": params})
    return AdamW(
        groups,
        learning_rate=lr_table(t) if learning_rate is None else learning_rate,
        beta1=t.adam_beta1,
        beta2=t.adam_beta2,
        eps=t.adam_eps,
    )
