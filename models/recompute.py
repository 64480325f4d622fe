"""Activation recompute: none, selective (Korthikanti et al. 2022) or full, on chosen layers.

* full: `Cell.recompute()` on each chosen TransformerBlock: only its input is kept; everything
  inside is recomputed in the backward pass (`recompute.comm` also recomputes its tensor-parallel
  communication, MindSpore's `mp_comm_recompute`).
* selective: `Primitive.recompute()` on the ops whose outputs are large and cheap to recompute:
  the attention core (QK^T, the fp32 scores and mask, softmax, scores x V; the S x S tensors) and
  the MLP activation (SiLU/GELU and the SwiGLU product). The flash core keeps no S x S tensors,
  so under flash attention only the activations are recomputed.

Chosen layers: `recompute.layers` via training.config.recompute_layer_counts, the first n layers of
every pipeline stage (MindFormers' per-stage list).
"""
from __future__ import annotations

from mindspore import nn

from training.config import Config, recompute_layer_counts, stage_layer_counts

# Sub-cell path inside a TransformerBlock -> primitive attributes recomputed by `selective`.
SELECTIVE = {
    "attention.core": ("bmm_qk", "scores_fp32", "mask_add", "softmax", "probs_cast", "bmm_pv"),
    "feed_forward": ("act", "gate_mul"),
}


def recomputed_layers(cfg: Config) -> list[int]:
    """Global indices of the layers recomputed: the first n of each pipeline stage."""
    per_stage = stage_layer_counts(cfg.model.num_layers, cfg.parallel.pipeline_stage, cfg.parallel.stage_offset)
    chosen, start = [], 0
    for held, n in zip(per_stage, recompute_layer_counts(cfg)):
        chosen += range(start, start + n)
        start += held
    return chosen


def _sub_cell(cell: nn.Cell, path: str) -> nn.Cell:
    for name in path.split("."):
        cell = getattr(cell, name)
    return cell


def apply_recompute(model: nn.Cell, cfg: Config) -> list[int]:
    """Mark recompute on `model.layers` per cfg.recompute; returns the recomputed layer indices."""
    mode = cfg.recompute.mode
    if mode == "none":
        return []
    layers = recomputed_layers(cfg)
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
