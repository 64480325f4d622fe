"""The one function that applies an architecture's tensor-parallel plan to a model, and the plan as a table.

A plan (the `plan` of an architecture's entry in models/archs/) maps cell paths (`*` = one path component,
e.g. a layer index) to a parallel style, like torchtitan's `parallelize_plan`; the styles are named in
models/spec.py, and every layer class says next to its primitives how a style splits them
(`shard_strategies(style, layout)`, models/layers.py, attention.py, moe.py, ...):

    colwise    output features split over tp (wq/wk/wv, w1/w3; and the per-head or per-feature ops
               that consume those outputs: rotary, attention core, activations)
    rowwise    input features split, partial sums reduced (wo, w2); under sequence parallel the
               reduction is a reduce-scatter along tokens (out_strategy)
    vocab      vocabulary split over tp (token embedding, output head), unless parallel.vocab_emb_dp
               keeps them data-parallel (the head's logits then split over the sequence-parallel
               tokens: Layout.logit_split); the loss reduces as the logits are split
               (models.transformer.ShardedCrossEntropy)
    sequence   tokens split over dp x cp, and over tp too under sequence parallel (norms, residual
               adds)
    replicate  nothing split over tp: tokens over dp x cp, weights whole (position table, a mixture
               of experts' router, DeepSeek-V3's low-rank down-projections)
    expert     a mixture of experts (models/moe.py): routing split over the token groups, experts over
               expert_parallel (and their width over tp), the tokens AlltoAll'd between the two

`apply_sharding_plan` turns styles into `.shard()` strategies for the layout's degrees, sets
`pipeline_stage` per cell (MindSpore's attribute: the stage index, Layout.stage_of) and a gradient
`comm_fusion` group per layer. It does so only for sharded layouts (semi-auto parallel); stand-alone
and data-parallel runs (CPU) compile no strategies, so their numbers are unchanged. A plan path
that matches no cell, a planned cell without strategies and a strategy naming an op the layer does
not have are errors.
"""

from __future__ import annotations

import dataclasses
import math
import re
from operator import attrgetter

from mindspore.ops import MatMul, Primitive
from mindspore.nn.utils import no_init_parameters
from mindspore.parallel import Layout as DeviceMesh

from models.mtp import mtp_optional, mtp_plan
from models.spec import COLWISE, ROWWISE
from models.transformer import CausalLM
from mindscale.config import Config, Layout


def _pattern(path: str) -> re.Pattern:
    return re.compile("^" + re.escape(path).replace(r"\*", r"[^.]+") + "$")


def _op(cell, attr: str, path: str):
    """The primitive `attr` (a dotted path: `base.matmul`) of `cell`; naming one it lacks is an error."""
    try:
        op = attrgetter(attr)(cell)
    except AttributeError:
        op = None
    if not isinstance(op, Primitive):
        raise AttributeError(
            f"{type(cell).__name__}.shard_strategies names {attr!r}, which is not a primitive of {path or 'the model'}"
        )
    return op


def planned_strategies(model: CausalLM, cfg: Config, layout: Layout) -> list[tuple[str, str, str, tuple, tuple | None]]:
    """(cell path, style, primitive attribute, in_strategy, out_strategy) for every planned op."""
    plan, optional = cfg.model.spec.plan, cfg.model.spec.optional_plan
    if model.mtp is not None:
        plan, optional = {**plan, **mtp_plan(plan)}, optional + mtp_optional(optional)
    patterns = [(_pattern(path), path, style) for path, style in plan.items()]
    matched, rows = set(), []
    for path, cell in model.cells_and_names():
        hit = next(((key, style) for pattern, key, style in patterns if pattern.match(path)), None)
        if hit is None:
            continue
        key, style = hit
        matched.add(key)
        if not hasattr(cell, "shard_strategies"):
            raise TypeError(
                f"{path} is a {type(cell).__name__}, which the {style} style has no strategies for: "
                "build the model with the layout the plan is applied for"
            )
        for attr, (in_strategy, out_strategy) in cell.shard_strategies(style, layout).items():
            _op(cell, attr, path)
            rows.append((path, style, attr, in_strategy, out_strategy))
    unmatched = [key for key in plan if key not in matched and key not in optional]
    if unmatched:
        raise KeyError(f"the {cfg.model.arch} plan names cells the model does not have: {unmatched}")
    return rows


def parameter_splits(model: CausalLM, cfg: Config, layout: Layout) -> dict[str, tuple[tuple, str]]:
    """Parameter name -> (into how many parts the plan splits each of its dimensions (all 1 when the
    layout is not sharded), the primitive attribute that reads it). The planner sizes every rank's
    slices from this; tests check it against the shapes MindSpore's compiler gives them. A layer's
    PARAMETER_INPUTS names, per parameter, the primitive input it feeds: MindSpore slices a
    parameter as the op that reads it is sharded."""
    rows = planned_strategies(model, cfg, layout) if layout.sharded else []
    strategies = {f"{path}.{attr}" if path else attr: in_strategy for path, _s, attr, in_strategy, _o in rows}
    splits = {}
    for path, cell in model.cells_and_names():
        for leaf, (attr, index) in getattr(type(cell), "PARAMETER_INPUTS", {}).items():
            param = getattr(cell, leaf, None)
            if param is None:  # a tied head, a Linear without bias
                continue
            strategy = strategies.get(f"{path}.{attr}")
            splits[param.name] = (_parts(strategy[index]) if strategy else (1,) * len(param.shape), attr)
    return splits


def _parts(split) -> tuple:
    """Into how many parts a strategy splits each dimension: a tuple strategy is that; a device mesh's tensor map
    names axes (-1 none, a tuple several), each axis index counted from the mesh's last."""
    if not isinstance(split, DeviceMesh):
        return tuple(split)
    sizes = split._device_shape[::-1]
    return tuple(
        math.prod(sizes[a] for a in (d if isinstance(d, tuple) else (d,)) if a >= 0) for d in split._tensor_map
    )


def _comm_fusion_group(name: str, num_layers: int) -> int:
    """Gradient all-reduce fusion group: 1 = embeddings, 2 + i = layer i, num_layers + 2 = the head."""
    if name.startswith("layers."):
        return 2 + int(name.split(".")[1])
    return 1 if name.startswith(("tok_embeddings", "pos_embeddings")) else num_layers + 2


def apply_sharding_plan(model: CausalLM, cfg: Config, layout: Layout) -> list[tuple]:
    """Apply the model's plan for a sharded layout; a no-op (returns []) otherwise."""
    if not layout.sharded:
        return []
    rows = planned_strategies(model, cfg, layout)
    cells = dict(model.cells_and_names())
    for path, style, attr, in_strategy, out_strategy in rows:
        primitive = _op(cells[path], attr, path)
        if layout.nd_tp and style in (COLWISE, ROWWISE) and isinstance(primitive, MatMul):
            primitive.add_prim_attr(
                "enable_nd_tp", True
            )  # 2D/3D tensor parallel: the projections (Linear.nd_tp_strategies)
        if out_strategy is None:
            primitive.shard(in_strategy)
        else:
            primitive.shard(in_strategy=in_strategy, out_strategy=out_strategy)
    if layout.pp > 1:
        for path in ("tok_embeddings", "pos_embeddings", "norm", "output", "loss"):
            if getattr(model, path, None) is not None:
                getattr(model, path).pipeline_stage = layout.stage_of(path)
        for i, layer in enumerate(model.layers):
            layer.pipeline_stage = layout.stages_of_layers[i]
        for i, module in enumerate(model.mtp or ()):  # each module itself: a CellList's stage is not its cells'
            module.pipeline_stage = layout.stage_of(f"mtp.{i}")
    for param in model.get_parameters():
        param.comm_fusion = _comm_fusion_group(param.name, cfg.model.num_layers)
    return rows


def _split_name(mesh: DeviceMesh, dim) -> str:
    """A tensor map entry of a device mesh as its axis names: -1 = None, (1, 0) = (y,x)."""
    names = mesh._alias_name[::-1]  # the last axis is map index 0
    if isinstance(dim, tuple):
        return "(" + ",".join(names[d] for d in dim) + ")"
    return "None" if dim == -1 else names[dim]


def _fmt(strategy) -> str:
    if strategy is None:
        return "-"
    if strategy and isinstance(strategy[0], DeviceMesh):  # 2D/3D tensor parallel: axes named as in layers.tp_mesh
        return "(" + ",".join("[" + ",".join(_split_name(m, d) for d in m._tensor_map) + "]" for m in strategy) + ")"
    return str(strategy).replace(" ", "")


def _chunk_ranges(layout: Layout, stage: int) -> list[str]:
    """`a-b` per chunk the stage holds, in chunk order: one range without interleave, v ranges p chunks apart
    with it (8 layers, pp2, v2: stage 0 holds 0-1 and 4-5)."""
    ranges = []
    for chunk in range(layout.interleave):
        held = [i for i in layout.layers_of_stage(stage) if layout.chunks_of_layers[i] == chunk]
        ranges.append(f"{held[0]}-{held[-1]}" if len(held) > 1 else str(held[0]))
    return ranges


def describe_plan(cfg: Config) -> str:
    """The plan a run of `cfg` on its hardware compiles, as a table: cell, style, op, in_strategy,
    out_strategy, pipeline stage(s). Every layer shares one plan, so layers are shown once as
    `layers.*` with their stage range; then the layers each stage holds, chunk by chunk."""
    layout = Layout.of(cfg)
    parallel = cfg.parallel
    header = (
        f"sharding plan: {cfg.model.arch}, data_parallel={parallel.data_parallel} model_parallel={parallel.model_parallel} "
        f"{f'context_parallel={parallel.context_parallel} ({parallel.context_parallel_algo}) ' if parallel.context_parallel > 1 else ''}"
        f"{f'expert_parallel={parallel.expert_parallel} ' if parallel.expert_parallel > 1 else ''}"
        f"{f'tp_x={parallel.tp_x} tp_y={parallel.tp_y} ' if layout.nd_tp else ''}"
        f"{f'tp_z={parallel.tp_z} ' if layout.tp_z > 1 else ''}"
        f"pipeline_stage={parallel.pipeline_stage} "
        f"{f'pipeline_interleave={parallel.pipeline_interleave} ' if parallel.pipeline_interleave > 1 else ''}"
        f"{f'pipeline_scheduler={parallel.pipeline_scheduler} ' if parallel.pipeline_scheduler != '1f1b' else ''}"
        f"sequence_parallel={parallel.sequence_parallel} "
        f"vocab_emb_dp={parallel.vocab_emb_dp}"
    )
    if not layout.sharded:
        return header + "\n(not sharded: stand-alone or data-parallel, no strategies are compiled)"
    # one layer, or with dense first layers (DeepSeek-V3) one dense and one with experts, shown as one `layers.*`
    kinds = 2 if cfg.model.spec.moe and cfg.model.moe.dense_layers else 1
    one_layer = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model, num_layers=kinds, moe=dataclasses.replace(cfg.model.moe, dense_layers=kinds - 1)
        ),
    )
    with no_init_parameters():
        model = CausalLM(
            one_layer.model,
            dataclasses.replace(layout, stages_of_layers=(0,) * kinds, recomputed=(), graph_reuse="none"),
        )
    table = [("cell", "style", "op", "in_strategy", "out_strategy", "stage")]
    stages = layout.stages_of_layers
    layer_stage_range = f"{stages[0]}-{stages[-1]}" if stages[0] != stages[-1] else str(stages[0])
    for path, style, attr, in_strategy, out_strategy in planned_strategies(model, cfg, layout):
        shown = re.sub(r"^layers\.\d+(?=\.|$)", "layers.*", path) or "(model)"
        stage = layer_stage_range if path.startswith("layers.") else str(layout.stage_of(path))
        row = (shown, style, attr, _fmt(in_strategy), _fmt(out_strategy), stage)
        if row not in table:  # the second layer's attention and norms repeat the first's
            table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [header] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    for stage, n in enumerate(layout.layers_per_stage):
        lines.append(
            f"stage {stage}: layers {', '.join(_chunk_ranges(layout, stage))} ({n}"
            f"{f' in {layout.interleave} chunks' if layout.interleave > 1 else ''})"
        )
    lines.append(f"comm_fusion: 1 = embeddings, 2+i = layer i, {cfg.model.num_layers + 2} = final norm and output")
    return "\n".join(lines)
