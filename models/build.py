"""Building a model and its loss network for a config and a layout."""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.nn.utils import no_init_parameters

from models.lora import apply_lora, lora_enabled
from models.transformer import CausalLM, NextTokenLoss, ReusedNextTokenLoss
from mindscale.config import Config, Layout


def standalone_layout(cfg: Config) -> Layout:
    """One process on the device MindSpore is set to: no strategies, the kernels that device has."""
    return Layout.of(cfg, ms.get_context("device_target"), world=1)


def build_model(cfg: Config, layout: Layout | None = None) -> CausalLM:
    """The model; with finetune.lora.rank > 0 its targeted Linears carry adapters and the rest is frozen.
    The layout's recompute and offload marks come last, so a fully recomputed or offloaded layer holds its
    adapters too."""
    layout = layout or standalone_layout(cfg)
    model = CausalLM(cfg.model, layout)
    if lora_enabled(cfg):
        apply_lora(model, cfg)
    model.mark_recompute(layout)
    model.mark_offload(layout)
    return model


def build_train_network(cfg: Config, model: CausalLM | None = None, layout: Layout | None = None) -> nn.Cell:
    """The loss network, (tokens [B, S + 1][, loss_mask][, segment_ids]) -> loss (NextTokenLoss); parameter
    names stay those of the model (no `model.` prefix)."""
    layout = layout or standalone_layout(cfg)
    model = model if model is not None else build_model(cfg, layout)
    network = ReusedNextTokenLoss if layout.graph_reuse == "model" else NextTokenLoss
    return network(model, layout, cfg.model.moe.aux_loss_coeff)


def count_parameters(cfg: Config) -> int:
    """Parameters of the model `cfg` describes, counted on a model built without allocating weights."""
    with no_init_parameters():
        model = CausalLM(cfg.model, Layout.of(cfg, "CPU", world=1))
    return sum(int(np.prod(p.shape)) for p in model.get_parameters())
