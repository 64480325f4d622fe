"""MindScale models: one decoder for every registered architecture (models/archs/), its sharding
plans, recompute and checkpoint interop.

    model = build_model(cfg, layout)              # CausalLM (LoRA, recompute marks): [B, S] -> [B, S, V] fp32
    network = build_train_network(cfg, model, layout)  # (tokens [B, S+1][, loss_mask][, segment_ids]) -> loss
    apply_sharding_plan(model, cfg, layout)       # .shard() strategies, pipeline stages, comm fusion
    weights, cfg = load_inference_weights(path, cfg)  # full weights of any checkpoint, LoRA merged

`layout` (mindscale.config.Layout) carries every parallel decision; without one, models are built
stand-alone for the device MindSpore is set to (inference, conversion, tests).

The names load on first use: the architecture registry (models/spec.py, models/archs/) sits below
the config layer, which reads it, so importing this package must not import MindSpore or the config.
"""

from __future__ import annotations

import importlib

_HOME = {
    "CausalLM": "models.transformer",
    "build_model": "models.build",
    "standalone_layout": "models.build",
    "build_train_network": "models.build",
    "count_parameters": "models.build",
    "lora_enabled": "models.lora",
    "apply_sharding_plan": "models.sharding",
    "describe_plan": "models.sharding",
    **{
        name: "models.weights"
        for name in (
            "WeightsMismatch",
            "check_weights",
            "load_inference_weights",
            "load_pretrained",
            "load_weights_into",
            "resolve_model_dims",
            "with_hf_dims",
        )
    },
}
__all__ = list(_HOME)


def __getattr__(name: str):
    """A name of _HOME, or a submodule (`models.weights.held` after a bare `import models`)."""
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'models' has no attribute {name!r}") from None
