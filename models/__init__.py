"""MindScale models: GPT and LLaMA, their sharding plans, recompute and checkpoint interop.

    model = build_model(cfg, layout)              # CausalLM (LoRA, recompute marks): [B, S] -> [B, S, V] fp32
    network = build_train_network(cfg, model, layout)  # (input_ids, labels, loss_mask) -> loss
    apply_sharding_plan(model, cfg, layout)       # .shard() strategies, pipeline stages, comm fusion
    weights, cfg = load_inference_weights(path, cfg)  # full weights of any checkpoint, LoRA merged

`layout` (mindscale.config.Layout) carries every parallel decision; without one, models are built
stand-alone for the device MindSpore is set to (inference, conversion, tests).
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.nn.utils import no_init_parameters

from models.lora import apply_lora, lora_enabled
from models.sharding import apply_sharding_plan, describe_plan
from models.transformer import CausalLM, CausalLMLoss, ReusedCausalLMLoss
from models.weights import (WeightsMismatch, check_weights, load_inference_weights, load_pretrained,
                            load_weights_into, resolve_model_dims, with_hf_dims)
from mindscale.config import Config, Layout

__all__ = ["CausalLM", "build_model", "standalone_layout", "build_train_network", "count_parameters", "apply_sharding_plan",
           "describe_plan", "check_weights", "load_weights_into", "load_pretrained", "WeightsMismatch",
           "with_hf_dims", "resolve_model_dims", "load_inference_weights", "lora_enabled"]


def standalone_layout(cfg: Config) -> Layout:
    """One process on the device MindSpore is set to: no strategies, the kernels that device has."""
    return Layout.of(cfg, ms.get_context("device_target"), world=1)


def build_model(cfg: Config, layout: Layout | None = None) -> CausalLM:
    """The model; with finetune.lora.rank > 0 its targeted Linears carry adapters and the rest is frozen.
    The layout's recompute marks come last, so a fully recomputed layer holds its adapters too."""
    layout = layout or standalone_layout(cfg)
    model = CausalLM(cfg.model, layout)
    if lora_enabled(cfg):
        apply_lora(model, cfg)
    model.mark_recompute(layout)
    return model


def build_train_network(cfg: Config, model: CausalLM | None = None, layout: Layout | None = None) -> nn.Cell:
    """The loss network; parameter names stay those of the model (no `model.` prefix)."""
    layout = layout or standalone_layout(cfg)
    model = model if model is not None else build_model(cfg, layout)
    return (ReusedCausalLMLoss if layout.graph_reuse == "model" else CausalLMLoss)(model)


def count_parameters(cfg: Config) -> int:
    """Parameters of the model `cfg` describes, counted on a model built without allocating weights."""
    with no_init_parameters():
        model = CausalLM(cfg.model, Layout.of(cfg, "CPU", world=1))
    return sum(int(np.prod(p.shape)) for p in model.get_parameters())
