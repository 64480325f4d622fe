"""LoRA (Hu et al. 2021): y = W x + alpha/r * B A x with W frozen, A [r, in] and B [out, r] trained.

    apply_lora(model, cfg)           # wrap the cfg.finetune.lora.target_modules Linears, freeze the rest
    merge(base, adapters, lora_cfg)  # fold adapters into base weights: W + alpha/r * B @ A (for export)

Names: the wrapped layer keeps its parameter names (`layers.0.attention.wq.weight`) so base
checkpoints load unchanged; the adapters sit beside it as `layers.0.attention.wq.lora_a` / `.lora_b`.
A is initialised like PEFT's (Kaiming-uniform, a = sqrt(5)) and B at zero, so training starts
from exactly the base model.

Why not mindpet (the LoRA library MindFormers uses): its `LoRADense` subclasses `nn.Dense`, which
our models do not use (models.layers.Linear stores [out, in] weights, casts to the compute dtype
and keeps its primitives for the sharding plan), and it takes its sharding strategies as
constructor arguments in MindFormers' style; wrapping our Linear takes less code than adapting
either, and lets the adapters' strategies follow from the wrapped layer's (LoraLinear.shard_strategies).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import HeUniform, Zero, initializer

from models.layers import Linear, token_split
from models.spec import COLWISE, ROWWISE, SEQUENCE
from mindscale.config import Config, LoraConfig

ADAPTERS = ("lora_a", "lora_b")


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTERS


def lora_enabled(cfg: Config) -> bool:
    return cfg.finetune.lora.rank > 0


class LoraLinear(nn.Cell):
    """A Linear plus its low-rank update; the Linear's own weight (and bias) stay frozen."""

    def __init__(self, base: Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        out_features, in_features = base.weight.shape
        self.base = base
        self.scale = alpha / rank
        self.lora_a = Parameter(
            initializer(HeUniform(negative_slope=math.sqrt(5)), (rank, in_features), base.weight.dtype), name="lora_a"
        )
        self.lora_b = Parameter(initializer(Zero(), (out_features, rank), base.weight.dtype), name="lora_b")
        self.dropout = nn.Dropout(p=dropout) if dropout > 0 else None
        self.matmul_a = ops.MatMul(transpose_b=True)
        self.matmul_b = ops.MatMul(transpose_b=True)
        self.scale_mul = ops.Mul()
        self.lora_add = ops.Add()
        self.cast = ops.Cast()
        self.compute_dtype = base.compute_dtype
        self.cast_weight = base.cast_weight

    def construct(self, x):
        a, b = self.lora_a, self.lora_b
        if self.cast_weight:
            a, b = self.cast(a, self.compute_dtype), self.cast(b, self.compute_dtype)
        low = self.matmul_a(self.dropout(x) if self.dropout is not None else x, a)
        return self.lora_add(self.base(x), self.scale_mul(self.matmul_b(low, b), self.scale))

    PARAMETER_INPUTS = {"lora_a": ("matmul_a", 1), "lora_b": ("matmul_b", 1)}

    def regather_input(self) -> None:
        """Linear.regather_input for both matmuls that read the input: the base and the adapter's A."""
        self.base.regather_input()
        self.matmul_a.add_prim_attr("recompute_comm_op", True)

    def shard_strategies(self, style: str, layout) -> dict:
        """The wrapped Linear's strategies (as `base.*`), and adapters that follow its split: A reads the
        input as the base matmul does (whole for colwise, split over its features for rowwise, partial
        sums reduced); B writes the output as the base does (features split for colwise, whole for
        rowwise), so the low-rank update adds to the base output without a redistribution."""
        rows, tp = layout.token_rows, layout.tp
        rules = {f"base.{attr}": strategy for attr, strategy in self.base.shard_strategies(style, layout).items()}
        if style == COLWISE:
            a, b, out = ((rows, 1), (1, 1)), ((rows, 1), (tp, 1)), (rows, tp)
        elif style == ROWWISE:
            a, b, out = ((rows, tp), (1, tp)), ((rows, 1), (1, 1)), (token_split(layout, SEQUENCE), 1)
        else:
            a, b, out = ((rows, 1), (1, 1)), ((rows, 1), (1, 1)), (rows, 1)
        rules.update(
            {
                "matmul_a": (a, None),
                "matmul_b": (b, None),
                "scale_mul": ((out, ()), None),
                "lora_add": ((out, out), None),
            }
        )
        return rules


def apply_lora(model: nn.Cell, cfg: Config) -> list[str]:
    """Wrap every targeted Linear of model.layers in a LoraLinear and freeze all other parameters.
    Returns the wrapped cell paths. Names are set from the cell paths so checkpoints match."""
    lora = cfg.finetune.lora
    cells = dict(model.cells_and_names())
    wrapped = []
    for path, cell in list(cells.items()):
        parent_path, _, leaf = path.rpartition(".")
        if not (path.startswith("layers.") and isinstance(cell, Linear) and leaf in lora.target_modules):
            continue
        adapter = LoraLinear(cell, lora.rank, lora.alpha, lora.dropout)
        setattr(cells[parent_path], leaf, adapter)
        cell.weight.name = f"{path}.weight"
        if cell.bias is not None:
            cell.bias.name = f"{path}.bias"
        adapter.lora_a.name, adapter.lora_b.name = f"{path}.lora_a", f"{path}.lora_b"
        wrapped.append(path)
    for param in model.get_parameters():
        param.requires_grad = is_adapter(param.name)
    return wrapped


def merge(base: dict[str, np.ndarray], adapters: dict[str, np.ndarray], lora: LoraConfig) -> dict[str, np.ndarray]:
    """Full weights with every adapter pair folded in: W + alpha/rank * B @ A (computed in fp64)."""
    merged = {name: value for name, value in base.items() if not is_adapter(name)}
    prefixes = sorted({name.rsplit(".", 1)[0] for name in adapters if is_adapter(name)})
    for prefix in prefixes:
        a, b = adapters[f"{prefix}.lora_a"], adapters[f"{prefix}.lora_b"]
        w = merged[f"{prefix}.weight"]
        delta = (lora.alpha / a.shape[0]) * (b.astype(np.float64) @ a.astype(np.float64))
        merged[f"{prefix}.weight"] = (w.astype(np.float64) + delta).astype(w.dtype)
    return merged


def split_adapters(weights: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """(base weights, adapter weights) of a checkpoint's tensors."""
    return (
        {k: v for k, v in weights.items() if not is_adapter(k)},
        {k: v for k, v in weights.items() if is_adapter(k)},
    )


def without_lora(cfg: Config) -> Config:
    """The same config with LoRA off: the model a merged checkpoint loads into."""
    finetune = dataclasses.replace(cfg.finetune, lora=dataclasses.replace(cfg.finetune.lora, rank=0))
    return dataclasses.replace(cfg, finetune=finetune)
