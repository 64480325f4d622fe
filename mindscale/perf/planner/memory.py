"""One device's memory per pipeline stage (`stage_memory`) and the budget a plan must fit (`memory_budget_gib`).

What the rank stores of its parameters is exact (parameters.py); its activations are what each forward in flight
(schedule.py) keeps of its layers (activations.py); the rest is estimated:
* Transient: a compute-dtype copy of the weights when it differs from the parameter dtype or the optimizer shard
  all-gathers them (MindSpore gathers each weight once at the start of the step and holds it to its end, for
  every micro batch); the last stage's copy of the token table as MindSpore gathers it (_copied_table_bytes); and
  the backward's weight gradients: one layer's before their reduce-scatter, or, when the graph accumulates them
  into whole buffers, one weight's at a time.
* The multi-token-prediction modules on the last stage (activations.mtp_activation_bytes).
* Where MindSpore runs the step as many kernel graphs (over schedule.ONE_GRAPH_CALLS calls of the layer graph),
  the views each layer call in flight keeps beside the tensors they view (_split_views_bytes).
* On the last stage, the larger of what it holds at its loss (below) and a fully recomputed layer's
  rematerialised activations, which its backward builds after the loss's tensors are freed.
* The step's end, where whole accumulation buffers are reduce-scattered for the optimizer shard (_step_end_bytes):
  when it holds more than the layers' phase, it is the stage's transient and no activation lives.
* The loss's peak on the last stage, per logit of one micro batch: the fp32 logits (whole on each rank of a tp
  group unless split, Layout.logit_split), the labels' fp32 one-hot and their product (vocabulary or tokens
  split over t): 4 / parts + 8 / t bytes. That is what MindSpore's plan of the step holds there
  (models/transformer.py, TokenCrossEntropy; `tools/dryrun.py --memory`, docs/dryrun.md): three fp32
  [tokens, vocabulary] tensors, the compute-dtype logits freed by then.
"""

from __future__ import annotations

import math

from mindscale.config import Config, Layout
from mindscale.perf.planner.activations import (
    _model_layer_activation_bytes,
    _stage_layer_roles,
    local_tokens,
    mtp_activation_bytes,
    mtp_modules_on,
    offload_resident_bytes,
    offloaded_layer_bytes,
    rematerialised_bytes,
)
from mindscale.perf.planner.caches import _layout, _per_config
from mindscale.perf.planner.parameters import (
    embedding_copied,
    layer_slice_params,
    optimizer_shard,
    parameter_slices,
    stage_bytes,
    stage_params,
    stored_shapes,
)
from mindscale.perf.planner.schedule import ONE_GRAPH_CALLS, chunk_forwards, in_flight_forwards, layer_graph_calls
from mindscale.perf.planner.sizes import DTYPE_BYTES, GIB

LOSS_LOGIT_BYTES = 4  # the loss computes in fp32


def _in_flight_bytes(layout: Layout, stage: int, per_layer: list[float]) -> float:
    """Bytes the stage holds at its peak when its i-th layer (in order, chunk 0 first) keeps per_layer[i] per
    micro batch: each chunk forward in flight (in_flight_forwards) holds its chunk's layers."""
    chunks = [0.0] * layout.interleave
    for i, layer in enumerate(layout.layers_of_stage(stage)):
        chunks[layout.chunks_of_layers[layer]] += per_layer[i]
    in_flight = in_flight_forwards(layout.pp, layout.interleave, layout.micro_steps, stage)
    forwards = chunk_forwards(layout.pp, layout.interleave, in_flight, layout.micro_steps)
    return sum(held * times for held, times in zip(chunks, forwards))


def stage_host_bytes(cfg: Config, stage: int, offloaded: int | None = None) -> float:
    """Host memory one rank of `stage` fills at its peak with offloaded activations: every chunk forward in flight
    holds its offloaded layers' moved bytes there (offload.layers; 0 without)."""
    layout = _layout(cfg)
    roles = _stage_layer_roles(layout, stage, None, offloaded)
    if "offloaded" not in roles:
        return 0.0
    moved = offloaded_layer_bytes(cfg, layout)
    return _in_flight_bytes(layout, stage, [moved if role == "offloaded" else 0.0 for role in roles])


def stage_memory(cfg: Config, stage: int, recomputed: int | None = None, offloaded: int | None = None) -> dict:
    """Memory breakdown (bytes) of one device of pipeline stage `stage`.

    weights, grads, optimizer: what the rank stores (stage_bytes, exact). transient: what lives only
    during the step, estimated: the compute-dtype copy of the weights (and, with the optimizer shard,
    their all-gathered slices) and the backward's weight gradients (module docstring).
    `recomputed` and `offloaded` override the numbers of recomputed and offloaded layers of this stage (used
    by the search). An offloaded layer keeps only offload_resident_bytes on the device; while any layer
    offloads, two layers' moved bytes are on the device on their way (one leaving in a forward, one
    prefetched for a backward)."""
    model, hw = cfg.model, cfg.hardware
    layout = _layout(cfg)
    stored = stage_bytes(cfg, stage, layout)
    pb, cb = DTYPE_BYTES[model.param_dtype], DTYPE_BYTES[model.compute_dtype]
    params = stage_params(cfg, layout)[stage]
    # The backward's weight gradients: a layer's wait for their reduce-scatter, unless the graph accumulates them
    # into whole buffers (reduce-scattered once the step's backward is done), where each is added as it is computed:
    # then one at a time, the largest in the compute dtype (MindSpore's plan of deepseek_v3_671b, docs/planner.md).
    whole_buffers = layout.accumulates_in_graph and not layout.accumulation_shard
    gradients = (
        layer_slice_params(cfg, layout, largest=True) * cb
        if whole_buffers
        else layer_slice_params(cfg, layout) * pb
        if layout.optimizer_shard
        else 0
    )
    transient = (params * cb if (cb != pb or layout.optimizer_shard) else 0) + gradients
    transient += _copied_table_bytes(cfg, layout, stage)

    roles = _stage_layer_roles(layout, stage, recomputed, offloaded)
    flash = layout.attention == "flash"
    # per config: a search's bisections ask them of one config for each number of recomputed or offloaded layers
    kept = _per_config("kept", cfg, lambda c: _model_layer_activation_bytes(c, "none", flash))
    resident = {
        "kept": kept,
        "offloaded": offload_resident_bytes(cfg) if "offloaded" in roles else 0.0,
        "recomputed": _per_config(
            "recomputed", cfg, lambda c: _model_layer_activation_bytes(c, layout.recompute, flash)
        )
        if "recomputed" in roles
        else 0.0,
    }
    activations = _in_flight_bytes(layout, stage, [resident[role] for role in roles])
    # one fully recomputed layer at a time during backward
    remat = rematerialised_bytes(cfg, flash) if "recomputed" in roles and layout.recompute == "full" else 0.0
    if "offloaded" in roles:
        activations += 2 * offloaded_layer_bytes(cfg, layout)  # one layer's on its way out, one's prefetched back
    if layer_graph_calls(layout.pp, layout.interleave, layout.micro_steps) > ONE_GRAPH_CALLS:
        activations += _in_flight_bytes(layout, stage, [_split_views_bytes(cfg, layout)] * len(roles))
    if stage == layout.pp - 1:
        # a recomputed layer's backward runs after the loss's and the modules' backward freed their tensors: the
        # stage's peak is the larger of the two (MindSpore's plan of deepseek_v3_671b's last stage, docs/planner.md)
        activations += max(remat, _loss_bytes(cfg, layout, stage))
    else:
        activations += remat
    end = _step_end_bytes(cfg, layout, stage, stored) if whole_buffers and layout.optimizer_shard else 0.0
    if end > transient + activations:  # the step's end is its busier phase: no activation lives there
        transient, activations = end, 0.0
    reserve = (hw.memory_gib - hw.memory_pool_gib) * GIB  # outside MindSpore's pool: runtime, HCCL buffers
    parts = {**stored, "transient": transient, "activations": activations, "reserve": reserve}
    parts["total"] = sum(parts.values())
    return parts


def _split_views_bytes(cfg: Config, layout: Layout) -> float:
    """What a layer call in flight holds more when MindSpore runs the step as many kernel graphs (over
    ONE_GRAPH_CALLS calls of the layer graph): the layer's forward is then a graph of its own, and a kept tensor and
    its kept view (the flash-attention output and the reshape `wo` reads) are two buffers where the one graph has one.
    Per micro batch, in the compute dtype: one [S, H] tensor without tensor parallel, none where the backward
    recomputes the view (Layout.recomputes_attention_view); with tensor parallel, an [S, H/t] tensor and an [S/t, H]
    one (sequence parallel) or [S, H] one (without). Fitted on the executed level-1 steps of the llama2_7b and
    llama2_13b twins at t = 1, 2 and 4, which held 0.89-1.05 of it more (docs/planner.md, "One kernel graph or
    many"); at t = 1 with the view recomputed, 7 MiB less than the one-graph step. 2D and 3D tensor parallel, whose
    stream is split as under sequence parallel, are counted so: not measured."""
    if layout.recomputes_attention_view:
        return 0.0
    t = layout.tp
    per_token = cfg.model.hidden_size * DTYPE_BYTES[cfg.model.compute_dtype]
    views = 1.0 if t == 1 else 1 / t + (1 / t if layout.sp or layout.nd_tp else 1.0)
    return local_tokens(cfg) * per_token * views


def _step_end_bytes(cfg: Config, layout: Layout, stage: int, stored: dict) -> float:
    """What the step's end holds beyond the stored bytes when whole accumulation buffers are reduce-scattered for
    the optimizer shard: every gradient's reduce-scattered slice (the stored weights' bytes) and two copies of the
    largest buffer (its cast and scaled copies for the gradient norm). MindSpore's plan of llama2_7b's twin (two
    layers, 64 tokens) peaks there: 2,232 MiB stored + 318 + 2 x 500 = its 3,550 MiB used; full-size layers'
    activations outweigh it."""
    buffers = [
        math.prod(shape) for name, shape in stored_shapes(cfg, stage, layout).items() if name.startswith("accu_grads.")
    ]
    largest = max(buffers, default=0) * DTYPE_BYTES[cfg.model.param_dtype]
    return stored["weights"] + 2 * largest


def _copied_table_bytes(cfg: Config, layout: Layout, stage: int) -> float:
    """What the last stage's copy of the token table (parameters.embedding_copied) holds beyond the compute-dtype copy
    the transient counts for it. Under the optimizer shard MindSpore receives the first stage's stored slice and
    all-gathers it in the stored dtype (communication.tied_embedding_exchange_bytes), held for the step; a tied head
    also keeps its compute-dtype cast for its backward, multi-token prediction's lookup only while it gathers rows
    (MindSpore's plans of gpt3_13b's, llama3_2_3b's and deepseek_v3_671b's last stages, docs/planner.md)."""
    if stage != layout.pp - 1 or not embedding_copied(cfg, layout):
        return 0.0
    [table] = [p for p in parameter_slices(cfg, layout) if p.name == "tok_embeddings.weight"]
    if optimizer_shard(table, layout) == 1:
        return 0.0
    pb, cb = table.itemsize, table.read_itemsize
    held = pb + (cb if cfg.model.tie_embeddings and cb != pb else 0)
    return math.prod(table.local) * (held - cb)


def _loss_bytes(cfg: Config, layout: Layout, stage: int) -> float:
    """What the last stage holds at its loss beyond the layers' kept activations: the final norm's input, the loss's
    peak (module docstring) and the multi-token-prediction modules of each forward of the last chunk in flight."""
    model, sb, t = cfg.model, local_tokens(cfg), layout.tp
    held = sb * model.hidden_size * 4 / (t if layout.sp or layout.nd_tp else 1)  # final norm input (split stream)
    # the fp32 logits (Layout.logit_split: whole on each rank of a tp group unless split), the one-hot and their
    # product, split over t
    logit_parts = math.prod(layout.logit_split) // layout.token_rows
    held += sb * model.vocab_size * (LOSS_LOGIT_BYTES / logit_parts + 2 * LOSS_LOGIT_BYTES / t)
    if mtp_modules_on(cfg, stage):  # each forward of the last chunk in flight runs them all
        forwards = in_flight_forwards(layout.pp, layout.interleave, layout.micro_steps, stage)
        last_chunk = chunk_forwards(layout.pp, layout.interleave, forwards, layout.micro_steps)[-1]
        held += last_chunk * mtp_modules_on(cfg, stage) * mtp_activation_bytes(cfg)
    return held


def memory_budget_gib(cfg: Config) -> float:
    """What a plan may fill: memory_margin of MindSpore's memory pool (hardware.memory_pool_gib, the ceiling
    the runtime sets), plus what is left outside the pool."""
    hw = cfg.hardware
    return hw.memory_gib - hw.memory_pool_gib + hw.memory_pool_gib * hw.memory_margin
