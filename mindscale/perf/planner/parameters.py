"""Per-rank parameters: every parameter of the model, sliced as the plan and the optimizer shard slice it.

Weights, gradients and optimizer state are exact (`stage_bytes`, checked against the dry run's compiled slices):
the model is built without weights, each parameter's slice is its shape divided by the plan's split
(models.sharding.parameter_splits), and MindSpore's parallel optimizer cuts the first dimension of every trained
parameter of at least 64 KiB over the ranks holding the same slice (`optimizer_shard`). AdamW keeps two fp32
moments whatever the parameter dtype; with param_dtype float32 the parameter is the master copy. Gradient
accumulation and pipelines keep accumulation buffers of the model-parallel slice, or of the optimizer's shard of
it with parallel.gradient_accumulation_shard (then reduce-scattered every micro batch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mindscale.config import OPTIMIZER_SHARD_MIN_KIB, Config, Layout
from mindscale.perf.planner.caches import (
    _LAYER_PARAMS,
    _MODELS,
    _STAGE_BYTES,
    _STAGE_PARAMS,
    _TABLES,
    _layout,
    _model_key,
    _slices_key,
    _stored_key,
)
from mindscale.perf.planner.sizes import DTYPE_BYTES, MOMENT_BYTES


@dataclass(frozen=True)
class ParameterSlice:
    name: str
    shape: tuple  # the full parameter
    split: tuple  # parts per dimension (the sharding plan; all 1 when not sharded)
    local: tuple  # this rank's model-parallel slice, before the optimizer shard
    stages: tuple  # the pipeline stages that hold it (an embedding_copied: the first and the last)
    trainable: bool
    itemsize: int  # stored (param dtype)
    read_itemsize: int  # as the op that reads it takes it: a MatMul in the compute dtype

    @property
    def replicas(self) -> int:
        """Split parts multiplied out: how many distinct slices exist in one stage."""
        return math.prod(self.split)


# The ops that read their weight in the compute dtype (the layer casts it first, and MindSpore's
# parallel optimizer all-gathers the cast slice): matmuls and embedding lookups; norms read fp32.
READ_IN_COMPUTE_DTYPE = ("matmul", "gather")


def _one_layer_model(cfg: Config, layout: Layout):
    """The model with its first decoder layer only, built without weights. CausalLM builds every decoder
    layer from the same (model config, layout), so layer i's parameters are layer 0's with `layers.0.`
    renamed; building the other layers cost the planner 80% of its time (126 layers of 405B)."""
    import models
    from mindspore.nn.utils import no_init_parameters

    key = (_model_key(cfg), layout.nd_tp)  # 2D tensor parallel builds other norms (models/layers.py)
    if key not in _MODELS:  # "none" builds no lazy_inline cells, and the one layer is neither recomputed nor offloaded
        kinds = len(set(_built_layers(cfg.model)))  # a mixture of experts with dense first layers: one of each
        one = dataclasses.replace(
            cfg,
            model=dataclasses.replace(
                cfg.model, num_layers=kinds, moe=dataclasses.replace(cfg.model.moe, dense_layers=kinds - 1)
            ),
        )
        with no_init_parameters():
            _MODELS[key] = models.build_model(
                one,
                dataclasses.replace(
                    layout,
                    graph_reuse="none",
                    sharded=True,
                    cpu_kernels=False,
                    stages_of_layers=(0,) * kinds,
                    chunks_of_layers=(0,) * kinds,
                    layers_per_stage=(kinds,),
                    recomputed=(),
                    offloaded=(),
                ),
            )
    return _MODELS[key]


def _built_layers(model) -> list[int]:
    """Per layer of the model, the layer of _one_layer_model whose parameters it has: 0, or (dense first layers,
    DeepSeek-V3) 0 for the dense layers and 1 for the layers with experts."""
    dense = model.moe.dense_layers if model.spec.moe else 0
    return [0 if i < dense or not dense else 1 for i in range(model.num_layers)]


def _every_layer(names: list[str], built: list[int]) -> list[tuple[str, str]]:
    """(name in the model, name in the one-layer model) of every parameter, in the model's order: the
    embeddings, the layers (layer i as the built layer built[i]), the final norm and head."""
    layer = [i for i, n in enumerate(names) if n.startswith("layers.")]
    before, after = names[: layer[0]], names[layer[-1] + 1 :]
    own = {b: [n for n in names if n.startswith(f"layers.{b}.")] for b in set(built)}
    return (
        [(n, n) for n in before]
        + [(f"layers.{i}.{n[len(f'layers.{b}.') :]}", n) for i, b in enumerate(built) for n in own[b]]
        + [(n, n) for n in after]
    )


def embedding_copied(cfg: Config, layout: Layout) -> bool:
    """Whether the last pipeline stage reads the token embedding too, a tied output head or the multi-token
    prediction's lookup (models/mtp.py): MindSpore keeps a copy of it there (the dry run's compiled slices)."""
    return layout.pp > 1 and (cfg.model.tie_embeddings or cfg.model.mtp_depth > 0)


def parameter_slices(cfg: Config, layout: Layout | None = None) -> tuple[ParameterSlice, ...]:
    """Every parameter of the model (as the trainer builds it, without weights) with the plan's split of it
    for `layout`. Cached: the search re-plans many layouts of one model."""
    from models.sharding import parameter_splits

    layout = layout or _layout(cfg)
    key = _slices_key(cfg, layout)
    if key in _TABLES:
        return _TABLES[key]
    model = _one_layer_model(cfg, layout)
    splits = parameter_splits(model, cfg, layout)
    copy = (layout.pp - 1,) if embedding_copied(cfg, layout) else ()
    pb, cb = DTYPE_BYTES[cfg.model.param_dtype], DTYPE_BYTES[cfg.model.compute_dtype]
    params = {p.name: p for p in model.get_parameters()}
    table = []
    for name, built in _every_layer(list(params), _built_layers(cfg.model)):
        p, (split, reader) = params[built], splits[built]
        stages = (layout.stage_of(name),) + (copy if name == "tok_embeddings.weight" else ())
        table.append(
            ParameterSlice(
                name,
                tuple(p.shape),
                split,
                tuple(d // s for d, s in zip(p.shape, split)),
                stages,
                p.requires_grad,
                pb,
                cb if reader.startswith(READ_IN_COMPUTE_DTYPE) else pb,
            )
        )
    _TABLES[key] = tuple(table)
    return _TABLES[key]


def optimizer_shard(p: ParameterSlice, layout: Layout) -> int:
    """Into how many parts MindSpore's parallel optimizer cuts this parameter's first dimension: all the
    ranks of the stage that hold the same slice, for parameters (frozen ones too, as compiled) of at
    least OPTIMIZER_SHARD_MIN_KIB in full whose first dimension divides (else 1: kept whole)."""
    ranks = layout.stage_devices // p.replicas
    full_bytes = math.prod(p.shape) * p.itemsize
    if not (layout.optimizer_shard and ranks > 1 and full_bytes >= OPTIMIZER_SHARD_MIN_KIB * 1024):
        return 1
    return ranks if p.local and p.local[0] % ranks == 0 else 1


def stored_shapes(cfg: Config, stage: int, layout: Layout | None = None) -> dict[str, tuple]:
    """The shape of every parameter one rank of `stage` stores, by the name MindSpore gives it: the
    weights, AdamW's moments (adam_m.*, adam_v.*) and, when the graph accumulates micro batches, the
    gradient buffers (accu_grads.*: the model-parallel slice, or with parallel.gradient_accumulation_shard
    the optimizer's shard of it). tools/dryrun.py compares these with the compiled shapes, name by name."""
    layout = layout or _layout(cfg)
    shapes = {}
    for p in parameter_slices(cfg, layout):
        if stage not in p.stages:
            continue
        shard = optimizer_shard(p, layout)
        stored = (p.local[0] // shard, *p.local[1:]) if p.local else p.local
        shapes[p.name] = stored
        if p.trainable:
            shapes[f"adam_m.{p.name}"] = shapes[f"adam_v.{p.name}"] = stored
            if layout.accumulates_in_graph:
                shapes[f"accu_grads.{p.name}"] = stored if layout.accumulation_shard else p.local
    return shapes


def stage_bytes(cfg: Config, stage: int, layout: Layout | None = None) -> dict:
    """Bytes one rank of `stage` holds: weights (every slice it stores), grads (the accumulation buffers
    when the graph keeps them, else one gradient per trained parameter as the optimizer receives it)
    and optimizer (AdamW's two moments); the same three figures tools/dryrun.py reads from the
    compiled graph, and equal to them (tests/dryrun/test_dryrun.py)."""
    layout = layout or _layout(cfg)
    key = _stored_key(cfg, layout, stage)
    if key in _STAGE_BYTES:
        return dict(_STAGE_BYTES[key])
    itemsize = DTYPE_BYTES[cfg.model.param_dtype]
    size = {
        name: math.prod(shape) * (MOMENT_BYTES if name.startswith("adam_") else itemsize)
        for name, shape in stored_shapes(cfg, stage, layout).items()
    }
    trained = {p.name for p in parameter_slices(cfg, layout) if p.trainable}
    kind = {"adam_m": "optimizer", "adam_v": "optimizer", "accu_grads": "grads"}
    out = {"weights": 0, "grads": 0, "optimizer": 0}
    for name, n in size.items():
        prefix = name.split(".", 1)[0]
        out[kind.get(prefix, "weights")] += n
        if prefix not in kind and name in trained and not layout.accumulates_in_graph:
            out["grads"] += n
    _STAGE_BYTES[key] = out
    return dict(out)


def stage_params(cfg: Config, layout: Layout | None = None) -> list[float]:
    """Parameters of one rank's model-parallel slices in each pipeline stage (before the optimizer shard)."""
    layout = layout or _layout(cfg)
    key = _slices_key(cfg, layout)
    if key not in _STAGE_PARAMS:
        out = [0] * layout.pp
        for p in parameter_slices(cfg, layout):
            for stage in p.stages:
                out[stage] += math.prod(p.local)
        _STAGE_PARAMS[key] = out
    return list(_STAGE_PARAMS[key])


def layer_slice_params(cfg: Config, layout: Layout, largest: bool = False) -> int:
    """Parameters of the largest decoder layer's slices on a rank (its experts split over ep, the rest over tp;
    the last layer: a mixture of experts' layers with experts follow its dense ones); `largest`: of its largest
    slice only."""
    key = (*_slices_key(cfg, layout), largest)
    if key not in _LAYER_PARAMS:
        last = f"layers.{cfg.model.num_layers - 1}."
        sizes = [math.prod(p.local) for p in parameter_slices(cfg, layout) if p.name.startswith(last)]
        _LAYER_PARAMS[key] = max(sizes) if largest else sum(sizes)
    return _LAYER_PARAMS[key]
