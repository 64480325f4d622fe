"""Activation recompute: none, selective (Korthikanti et al. 2022) or full, on chosen layers.

* full: `Cell.recompute()` on each chosen TransformerBlock: only its input is kept; everything
  inside is recomputed in the backward pass (`recompute.comm` also recomputes its tensor-parallel
  communication, MindSpore's `mp_comm_recompute`).
* selective: `Primitive.recompute()` on the ops whose outputs are large and cheap to recompute:
  the attention core (QK^T, the fp32 scores and mask, softmax, scores x V; the S x S tensors) and
  the MLP activation (SiLU/GELU and the SwiGLU product). The flash core keeps no S x S tensors,
  so under flash attention only the activations are recomputed.

Chosen layers: `recompute.layers`, the first n layers of every pipeline stage (MindFormers'
per-stage list), as mindscale.config.layout resolves them.
"""
from __future__ import annotations

from mindspore import nn

from mindscale.config import Config
from mindscale.config import Layout

# Sub-cell path inside a TransformerBlock -> primitive attributes recomputed by `selective`.
SELECTIVE = {
    "attention.core": ("bmm_qk", "scores_fp32", "mask_add", "softmax", "probs_cast", "bmm_pv"),
    "feed_forward": ("act", "gate_mul"),
}


def _sub_cell(cell: nn.Cell, path: str) -> nn.Cell:
    for name in path.split("."):
        cell = getattr(cell, name)
    return cell


def apply_recompute(model: nn.Cell, cfg: Config, layout: Layout) -> list[int]:
    """Mark recompute on `model.layers` per cfg.recompute; returns the recomputed layer indices."""
    mode = layout.recompute
    if mode == "none":
        return []
    layers = list(layout.recomputed)
    for index in layers:
        block = model.layers[index]
        if mode == "full":
            block.recompute(mp_comm_recompute=cfg.recompute.comm)
            continue
        for path, names in SELECTIVE.items():
            cell = _sub_cell(block, path)
            for name in names:
                primitive = getattr(cell, name, None)
                if primitive is not None:
                    primitive.recompute()
    return layers
