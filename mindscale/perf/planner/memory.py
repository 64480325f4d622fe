"""One device's memory per pipeline stage (`stage_memory`) and the budget a plan must fit (`memory_budget_gib`).

What the rank stores of its parameters is exact (parameters.py); its activations are what each forward in flight
(schedule.py) keeps of its layers (activations.py); the rest is estimated:
* Transient: a compute-dtype copy of the weights when it differs from the parameter dtype or the optimizer shard
  all-gathers them, and one layer's gradients before their reduce-scatter.
* The multi-token-prediction modules on the last stage (activations.mtp_activation_bytes).
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
from mindscale.perf.planner.parameters import layer_slice_params, stage_bytes, stage_params
from mindscale.perf.planner.schedule import chunk_forwards, in_flight_forwards
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
    their all-gathered slices), and one layer's gradients before they are reduce-scattered.
    `recomputed` and `offloaded` override the numbers of recomputed and offloaded layers of this stage (used
    by the search). An offloaded layer keeps only offload_resident_bytes on the device; while any layer
    offloads, two layers' moved bytes are on the device on their way (one leaving in a forward, one
    prefetched for a backward)."""
    model, hw = cfg.model, cfg.hardware
    layout = _layout(cfg)
    stored = stage_bytes(cfg, stage, layout)
    pb, cb = DTYPE_BYTES[model.param_dtype], DTYPE_BYTES[model.compute_dtype]
    params = stage_params(cfg, layout)[stage]
    largest_layer = layer_slice_params(cfg, layout)
    transient = (params * cb if (cb != pb or layout.optimizer_shard) else 0) + (
        largest_layer * pb if layout.optimizer_shard else 0
    )

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
    if "recomputed" in roles and layout.recompute == "full":
        activations += rematerialised_bytes(cfg, flash)  # one layer at a time during backward
    if "offloaded" in roles:
        activations += 2 * offloaded_layer_bytes(cfg, layout)  # one layer's on its way out, one's prefetched back
    if stage == layout.pp - 1:
        sb = local_tokens(cfg)
        t = layout.tp
        activations += sb * model.hidden_size * 4 / (t if layout.sp else 1)  # final norm input
        # the loss's peak (module docstring): the fp32 logits (Layout.logit_split: whole on each rank of a tp group
        # unless split), the one-hot and their product, split over t
        logit_parts = math.prod(layout.logit_split) // layout.token_rows
        activations += sb * model.vocab_size * (LOSS_LOGIT_BYTES / logit_parts + 2 * LOSS_LOGIT_BYTES / t)
        if mtp_modules_on(cfg, stage):  # each forward of the last chunk in flight runs them all
            forwards = in_flight_forwards(layout.pp, layout.interleave, layout.micro_steps, stage)
            last_chunk = chunk_forwards(layout.pp, layout.interleave, forwards, layout.micro_steps)[-1]
            activations += last_chunk * mtp_modules_on(cfg, stage) * mtp_activation_bytes(cfg)
    reserve = (hw.memory_gib - hw.memory_pool_gib) * GIB  # outside MindSpore's pool: runtime, HCCL buffers
    parts = {**stored, "transient": transient, "activations": activations, "reserve": reserve}
    parts["total"] = sum(parts.values())
    return parts


def memory_budget_gib(cfg: Config) -> float:
    """What a plan may fill: memory_margin of MindSpore's memory pool (hardware.memory_pool_gib, the ceiling
    the runtime sets), plus what is left outside the pool."""
    hw = cfg.hardware
    return hw.memory_gib - hw.memory_pool_gib + hw.memory_pool_gib * hw.memory_margin
