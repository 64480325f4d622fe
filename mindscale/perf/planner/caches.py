"""The planner's caches, in one place: what a search asks again and again of the same config or model.

A search re-plans thousands of candidate configs of a few models. What a config object derives (its Layout, its
model key, its config tree, a layer's kept bytes) is kept per config object (`_per_config`; the planner never
changes a config, with_overrides makes new ones). What is built from the model's parameters (the one-layer model,
the parameter slices, each stage's stored bytes, gradient traffic and parameter counts) is kept under a key of
everything it depends on (`_model_key`, `_slices_key`, `_stored_key`), so a recompute variant of a layout reuses
its layout's tables.
"""

from __future__ import annotations

import dataclasses

from mindscale.config import Config, Layout

# Derived per config object, by _per_config:
_PER_CONFIG: dict[tuple[str, int], tuple[Config, object]] = {}


def _per_config(name: str, cfg: Config, derive):
    """derive(cfg), kept per config object (the planner never changes a config; with_overrides makes new ones): a
    search asks each candidate's layout and model key thousands of times."""
    key = (name, id(cfg))
    hit = _PER_CONFIG.get(key)
    if hit is None or hit[0] is not cfg:
        if len(_PER_CONFIG) > 8192:
            _PER_CONFIG.clear()
        hit = _PER_CONFIG[key] = (cfg, derive(cfg))
    return hit[1]


def _layout(cfg: Config) -> Layout:
    return _per_config("layout", cfg, Layout.of)


# Built from the model's parameters, each under the key of what it depends on (the functions below):
_MODELS: dict[str, object] = {}  # parameters._one_layer_model, by _model_key
_TABLES: dict[tuple, tuple] = {}  # parameters.parameter_slices, by _slices_key
_STAGE_BYTES: dict[tuple, dict] = {}  # parameters.stage_bytes, by _stored_key
_GRADIENT_BYTES: dict[tuple, tuple] = {}  # communication.gradient_reduce_bytes, by _stored_key
_STAGE_PARAMS: dict[tuple, list] = {}  # parameters.stage_params, by _slices_key
_LAYER_PARAMS: dict[tuple, int] = {}  # parameters.layer_slice_params, by _slices_key


def _model_key(cfg: Config) -> str:
    """What the parameters of one decoder layer and of the ends depend on (dataclass reprs: a fifth of the
    search's time went to dataclasses.asdict + json before); not the number of layers."""
    return _per_config("model key", cfg, lambda c: repr((dataclasses.replace(c.model, num_layers=1), c.finetune.lora)))


def _slices_key(cfg: Config, layout: Layout) -> tuple:
    """What parameter_slices depends on."""
    return (
        _model_key(cfg),
        cfg.model.num_layers,
        layout.sharded,
        layout.tp,
        layout.tp_x,  # 2D tensor parallel splits the norms too
        layout.tp_y,
        layout.ep,
        layout.vocab_parallel,
        layout.pp,
        layout.stages_of_layers,
    )


def _stored_key(cfg: Config, layout: Layout, stage: int) -> tuple:
    """What a stage's stored bytes and gradient traffic depend on: not recompute, which the search varies
    most (the tables are asked for every recompute variant of a layout)."""
    return (
        _slices_key(cfg, layout),
        layout.dp,
        layout.cp,
        layout.optimizer_shard,
        layout.accumulation_shard,
        layout.accumulates_in_graph,
        stage,
    )  # cp: the optimizer shards over the stage's dp x cp x tp ranks
