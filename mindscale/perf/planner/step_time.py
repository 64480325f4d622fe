"""The predicted step time, as a sum of where it goes (assumptions are returned with the prediction).

A micro-batch slot of a stage is its compute (speed.stage_compute_s: kernels by shape at the profile's fitted
efficiencies) plus the collectives MindSpore's compiled graph leaves on the critical path: tensor-parallel
all-reduces (or all-gather/reduce-scatter pairs under sequence parallel), context-parallel K/V exchange,
expert-parallel AlltoAlls, and what of the offload copies outlasts the slot. The busiest stage's slot sets the
pace: ``m + (p-1)/v`` slots a step (1F1B: bubble ``(p-1)/m``; interleaved ``(p-1)/(v·m)``), plus the
stage-boundary sends (v times as many with v chunks, not overlapped), plus the part of the data-parallel gradient
reduction that outlasts the last micro batch's backward (2/3 of its slot). Collectives are timed by HCCL's α–β
model over the group's placement (speed.collective_s); ranks are ordered tensor-parallel innermost, then context,
data and pipeline parallel.

The step is returned as that sum (`step_breakdown_s`): compute, tensor_parallel, expert_parallel, context_parallel,
pipeline_sends, bubble, data_parallel_exposed, offload.
"""

from __future__ import annotations

from mindscale.config import Config, Layout
from mindscale.perf import flops
from mindscale.perf.planner.activations import offloaded_layer_bytes
from mindscale.perf.planner.caches import _layout
from mindscale.perf.planner.communication import communication, nd_tp_groups
from mindscale.perf.planner.schedule import bubble_fraction, pipeline_sends
from mindscale.perf.planner.speed import SpeedModel, collective_s, ranks_per_server, send_s, stage_compute_s

# What an anchor's run may hide behind compute (published rows only): tensor-parallel collectives (MindSpeed-LLM's
# mc2, MindFormers' fine_grain_interleave) and the context-parallel exchange (ring attention). MindScale's own
# plans are credited only what their compiled graph overlaps (compiled_tp_overlap_s).
OVERLAPS = ("tensor_parallel", "context_parallel")
BREAKDOWN = (
    "compute",
    "tensor_parallel",
    "expert_parallel",
    "context_parallel",
    "pipeline_sends",
    "bubble",
    "data_parallel_exposed",
    "offload",
)


def _stage_slot(cfg: Config, stage: int, comm: dict, peak: float, speed: SpeedModel, overlap: frozenset) -> dict:
    """Seconds of one micro batch on one rank of `stage` (whose traffic is `comm`), by part: compute and the
    collectives on its critical path (overlapped ones only where they outlast the compute), and the offload copies
    that outlast the slot."""
    layout, hw = _layout(cfg), cfg.hardware
    n, t, c = hw.devices_per_node, layout.tp, layout.cp
    layers = comm["blocks"]  # the stage's decoder layers and multi-token-prediction blocks
    compute = stage_compute_s(cfg, stage, peak, speed)
    tp = tensor_parallel_s(cfg, comm, layers)
    # operations per layer (each pays the latency): ulysses' four all-to-alls each way, colossalai's K/V all-gather
    # and reduce-scatter (and the gather again when full recompute repeats communication); expert parallel's four
    # AlltoAlls, six in a fully recomputed layer
    full = layout.recompute == "full"
    cp_ops = 8 if layout.ulysses else 3 if full and cfg.recompute.comm else 2
    cp = collective_s(
        cfg,
        (comm["cp_per_layer"] - comm["cp_exchange_per_layer"]) * layers,
        c,
        ranks_per_server(layout, t, c, n),
        cp_ops * layers,
        alltoall=layout.ulysses,
    ) + load_balance_exchange_s(cfg, comm["cp_exchange_per_layer"] * layers, cp_ops * layers)
    ep_ops = 4 * layers + (2 * layout.recomputed_in(stage) if full else 0)
    ep = collective_s(
        cfg,
        comm["ep_per_layer"] * layers,
        layout.ep,
        ranks_per_server(layout, t * c, layout.ep, n),
        ep_ops,
        alltoall=True,
    )
    exposed = {
        "compute": compute,
        "tensor_parallel": max(0.0, tp - compute)
        if "tensor_parallel" in overlap
        else tp - compiled_tp_overlap_s(cfg, tp, compute),
        "context_parallel": max(0.0, cp - compute) if "context_parallel" in overlap else cp,
        "expert_parallel": ep,
    }
    busy = sum(exposed.values())
    exposed["offload"] = offload_exposed_s(offload_copy_s(cfg, stage), busy)
    return exposed


def tensor_parallel_s(cfg: Config, comm: dict, layers: int) -> float:
    """Seconds of one micro batch's tensor-parallel collectives on one rank of a stage with `layers` layers (its
    traffic `comm`): one group of t ranks in 1D; under 2D and 3D each group on its own ranks
    (communication.nd_tp_groups), so that a group of r ranks in a server's HCCS mesh drives r - 1 of its links, not
    t - 1. The output head's traffic is timed over all t."""
    layout, n = _layout(cfg), cfg.hardware.devices_per_node
    t = layout.tp
    head = collective_s(
        cfg, comm["tp_vocab"] / layout.micro_steps, t, ranks_per_server(layout, 1, t, n), comm["tp_vocab_collectives"]
    )
    if not layout.nd_tp:
        per_layer = collective_s(
            cfg,
            comm["tp_per_layer"] * layers,
            t,
            ranks_per_server(layout, 1, t, n),
            comm["tp_collectives_per_layer"] * layers,
        )
        return per_layer + head
    return head + sum(
        collective_s(
            cfg,
            comm["tp_per_layer_by_group"][group] * layers,
            size,
            ranks_per_server(layout, stride, size, n),
            ops * layers,
        )
        for group, (stride, size, ops) in nd_tp_groups(layout).items()
    )


def load_balance_exchange_s(cfg: Config, ring_bytes: float, ops: int) -> float:
    """Seconds of parallel.context_parallel_load_balance's exchange of half the queries and outputs (`ring_bytes`,
    `ops` collectives of each kind): all-gathers and reduce-scatters over a pair of cp ranks, in one server when the
    whole cp group is, else counted across servers (rank i and c-1-i are the farthest apart)."""
    layout = _layout(cfg)
    if not ring_bytes:
        return 0.0
    n, t, c = cfg.hardware.devices_per_node, layout.tp, layout.cp
    together = ranks_per_server(layout, t, c, n) == c
    return collective_s(cfg, ring_bytes, 2, 2 if together else 1, ops)


def compiled_tp_overlap_s(cfg: Config, tp: float, compute: float) -> float:
    """Seconds of a slot's tensor-parallel collectives (`tp`) hidden behind its `compute` by what the compiled
    graph has (docs/communication.md: both show in the dry run's validate IR): N copies of the micro batch
    (communication.micro_batch_interleave) hide one copy's collectives behind the other copies' compute, at most
    (N-1)/N of it; the backward's collectives (half of them) beside the weight-gradient MatMuls
    (communication.grad_matmul_communication_overlap), at most a third of the compute (forward, input gradient
    and weight gradient each take one). With both, the larger; no more than `tp`."""
    comm = cfg.communication
    copies = comm.micro_batch_interleave
    hidden = compute * (copies - 1) / copies
    if comm.grad_matmul_communication_overlap:
        hidden = max(hidden, min(tp / 2, compute / 3))
    return min(tp, hidden)


def predict(cfg: Config, peak_tflops: float, efficiency: float | None = None, overlap: frozenset | tuple = ()) -> dict:
    """Step time, throughput, MFU/HFU, bubble and the step's breakdown of `cfg` at `peak_tflops` per device, with
    the assumptions it rests on (the module's docstring). `efficiency`: every FLOP at that fraction of the peak
    instead of the profile's fitted speed model. `overlap`: parts of OVERLAPS an anchor's run hides behind compute
    (bench/published_ascend.yaml); MindScale's own plans pass none."""
    model, layout, hw = cfg.model, _layout(cfg), cfg.hardware
    overlap = frozenset(overlap)
    speed = SpeedModel.of(cfg, efficiency)
    peak = peak_tflops * 1e12
    stages, v, micro_steps = layout.pp, layout.interleave, layout.micro_steps
    comm = [communication(cfg, k) for k in range(stages)]
    slots = [_stage_slot(cfg, k, comm[k], peak, speed, overlap) for k in range(stages)]
    busiest = max(range(stages), key=lambda k: sum(slots[k].values()))
    slot = sum(slots[busiest].values())
    n, stride_pp = hw.devices_per_node, layout.tp * layout.cp * layout.dp
    sends = max(c["pp_sends_per_micro_batch"] for c in comm) * micro_steps
    pipeline_sends_s = send_s(cfg, max(c["pp_send_recv"] for c in comm), sends, stride_pp >= n)
    breakdown = {key: micro_steps * value for key, value in slots[busiest].items()}
    breakdown.update(
        pipeline_sends=pipeline_sends_s,
        bubble=(stages - 1) / v * slot,
        data_parallel_exposed=_data_parallel_exposed(cfg, comm, slot),
    )
    breakdown = {key: breakdown[key] for key in BREAKDOWN}
    step = sum(breakdown.values())
    tokens_per_s = cfg.samples_per_step * model.seq_length / step
    devices = cfg.devices
    recomputed = len(layout.recomputed)
    hardware_flops = tokens_per_s * flops.hardware_flops_per_token(model, layout.recompute, recomputed) / devices
    return {
        "step_time_s": step,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "samples_per_s_per_device": cfg.samples_per_step / step / devices,
        "tflops_per_device": tokens_per_s * flops.model_flops_per_token(model) / devices / 1e12,
        "mfu": flops.mfu(tokens_per_s, devices, peak_tflops, model),
        "hfu": flops.hfu(tokens_per_s, devices, peak_tflops, model, layout.recompute, recomputed),
        "bubble_fraction": bubble_fraction(stages, v, micro_steps),
        "pipeline_interleave": v,
        "step_breakdown_s": breakdown,
        "compute_s": breakdown["compute"],
        "comm_exposed_s": sum(
            breakdown[k]
            for k in (
                "tensor_parallel",
                "expert_parallel",
                "context_parallel",
                "pipeline_sends",
                "data_parallel_exposed",
            )
        ),
        "offload_copy_s": max(offload_copy_s(cfg, k) for k in range(stages)),
        # what the copies add to the step: the slot with them over the busiest slot without them
        "offload_exposed_s": (micro_steps + (stages - 1) / v)
        * (slot - max(sum(s.values()) - s["offload"] for s in slots)),
        "peak_tflops": peak_tflops,
        # what the kernels achieved: hardware FLOPs over the compute part of the step (not the whole step)
        "efficiency": hardware_flops * step / breakdown["compute"] / (peak_tflops * 1e12)
        if breakdown["compute"]
        else 0.0,
        "speed_model": {
            "matmul_efficiency": speed.matmul_efficiency,
            "matmul_half_width": speed.matmul_half_width,
            "attention_efficiency": speed.attention_efficiency,
            "vector_ns_per_element": speed.vector_s_per_element * 1e9,
            "calibrated": speed.calibrated,
            "error": hw.speed_error if speed.calibrated else None,
        },
        "assumptions": _assumptions(
            cfg, peak_tflops, speed, max(offload_copy_s(cfg, k) for k in range(stages)), overlap
        ),
    }


def _data_parallel_exposed(cfg: Config, comm: list[dict], slot: float) -> float:
    """What of the data-parallel gradient reduction outlasts the compute it overlaps: the once-per-step part the last
    micro batch's backward (2/3 of its slot: a layer's gradients are reduced as soon as its last micro batch has
    accumulated them, each layer its own comm_fusion group), a per-micro-batch reduce-scatter
    (gradient_accumulation_shard) its own micro batch's."""
    layout, n = _layout(cfg), cfg.hardware.devices_per_node
    d, stride = layout.dp, layout.tp * layout.cp
    per_server = ranks_per_server(layout, stride, d, n)
    groups = 2 * (max(layout.layers_per_stage) + 2)  # a reduction and a gather per comm_fusion group
    once = max(
        collective_s(cfg, c["dp_grad_reduce"] - c["dp_per_micro_batch"] * layout.micro_steps, d, per_server, groups)
        for c in comm
    )
    per_micro = max(collective_s(cfg, c["dp_per_micro_batch"], d, per_server, groups / 2) for c in comm)
    return max(0.0, once - 2 / 3 * slot) + layout.micro_steps * max(0.0, per_micro - 2 / 3 * slot)


def _dropless_cost(moe) -> str:
    """What capacity_factor null costs against a dropless that computes only the routed tokens."""
    ratio = moe.num_experts / moe.top_k
    if moe.dispatch == "grouped":
        return (
            f"dropless by grouped dispatch: timed and sized as capacity T, {ratio:g}x (E/top_k) the expert FLOPs "
            "and buffers of the top_k x T routed tokens its GroupedMatmul computes (an upper bound: per-expert "
            "token counts are not modelled), its AlltoAllV timed as the capacity path's AlltoAll"
        )
    return (
        f"dropless as capacity T: every expert computes all T tokens of a rank, {ratio:g}x (E/top_k) the expert "
        f"FLOPs and slot buffers of the top_k x T routed tokens that GroupedMatmul over per-expert token counts "
        "computes (model.moe.dispatch: grouped; docs/models.md, mixture of experts)"
    )


def _assumptions(cfg: Config, peak_tflops: float, speed: SpeedModel, copy_s: float, overlap: frozenset) -> list[str]:
    """What `predict` assumes of `cfg`, in words (tools/plan.py prints them under the prediction); `copy_s`: the
    busiest stage's offload copy time per micro batch, each way."""
    model, layout, hw = cfg.model, _layout(cfg), cfg.hardware
    if speed.calibrated:
        error = f"; median error {hw.speed_error:.0%} on the published table" if hw.speed_error else ""
        out = [
            f"kernels: a matmul [M, K] x [K, N] at {speed.matmul_efficiency:.0%} of the {peak_tflops:g} TFLOP/s "
            f"peak x s(M)·s(K)·s(N), s(x) = x/(x + {speed.matmul_half_width:g}); the attention core at "
            f"{speed.attention_efficiency:.0%} of the peak "
            + (
                "(flash attention: the causal half of its FLOPs)"
                if layout.attention == "flash"
                else "(composite: all of its FLOPs)"
            )
            + f"; fitted on published 910B measurements (bench/published_ascend.yaml{error})"
        ]
    else:
        out = [
            f"hardware FLOPs run at {speed.matmul_efficiency:.0%} of the {peak_tflops:g} TFLOP/s peak (flat: no "
            "speed model fitted for this profile, or --efficiency)"
        ]
    hidden = [k.replace("_", "-") for k in OVERLAPS if k in overlap]
    out.append(
        _compiled_overlaps(cfg)
        if not hidden
        else f"{' and '.join(hidden)} collectives overlap compute (the anchor's run), the rest are on the critical path"
    )
    if model.spec.moe:
        out.append(
            "mixture of experts: the experts compute their capacity's slots, padding included; the dispatch "
            "and combine gathers are not timed"
        )
        if model.moe.capacity_factor is None:
            out.append(_dropless_cost(model.moe))
    if layout.ep > 1:
        out.append(
            f"expert parallel (ep={layout.ep}): experts are assumed evenly loaded (the capacity bounds the slowest)"
        )
    if layout.cp > 1:
        out.append(_context_parallel_assumption(layout, speed.calibrated))
    out.append(_pipeline_assumption(layout))
    if layout.interleave > 1:
        middle = 1 if layout.pp > 2 else 0
        out.append(
            f"pipeline sends: {pipeline_sends(layout.pp, layout.interleave, middle)} per micro batch on a "
            "middle stage (2v), counted in full on the critical path (not overlapped with compute)"
        )
    if layout.offloaded:
        out.append(
            f"activation offload ({sum(layout.offloaded_in(k) for k in range(layout.pp))} layers): each "
            f"crosses the host link ({hw.host_link_gbps:g} GB/s each way, full duplex) out in its "
            "micro batch's forward and back in its backward; copies run on their own stream and overlap the "
            "slot's forward third (out) and backward two thirds (in) without slowing compute; what does not "
            f"overlap is exposed ({copy_s:.3g} s each way per micro batch on the busiest stage)"
        )
    links = (
        f"{hw.intra_node_gbps:g} GB/s per link, {hw.devices_per_node} devices fully meshed (HCCL Mesh)"
        if hw.intra_node_mesh
        else f"{hw.intra_node_gbps:g} GB/s per device (ring)"
    )
    return out + [
        "data-parallel gradient reduction overlaps the last micro batch's backward (2/3 of its compute), "
        "a per-micro-batch reduce-scatter its own micro batch's; the rest is exposed",
        f"collectives: HCCL's α–β model, inside a server {links}, between servers {hw.inter_node_gbps:g} "
        f"GB/s per device's NIC; latency {hw.intra_node_latency_us:g} / {hw.inter_node_latency_us:g} µs "
        "a step",
        "optimizer update, data loading and host overhead are not counted",
    ]


def _compiled_overlaps(cfg: Config) -> str:
    """Which collectives the prediction takes as hidden, by the optimisations the config turns on."""
    comm, layout = cfg.communication, _layout(cfg)
    credited = []
    if comm.micro_batch_interleave > 1:
        n = comm.micro_batch_interleave
        credited.append(
            f"{n} copies of each micro batch (communication.micro_batch_interleave) hide tensor-parallel "
            f"collectives behind the other copies' compute, up to {n - 1}/{n} of it; each copy's matmuls take "
            f"1/{n} of the rows"
        )
    if comm.grad_matmul_communication_overlap:
        credited.append(
            "the backward's tensor-parallel collectives overlap the weight-gradient matmuls, up to a third of the "
            "compute (communication.grad_matmul_communication_overlap)"
        )
    if not credited:
        return (
            "tensor-, context- and expert-parallel collectives are on the critical path (MindSpore's compiled "
            "graph overlaps none of them)"
        )
    rest = "context- and expert-parallel collectives" + (" and the rest" if layout.tp > 1 else "")
    return (
        "; ".join(credited) + f" (both show in the compiled graph: docs/communication.md); {rest} on the critical path"
    )


def _context_parallel_assumption(layout: Layout, causal_skip: bool) -> str:
    """How the attention time of a context-parallel rank is counted: at the busiest rank's causal work where the
    speed model counts flash attention's causal half (`causal_skip`, a fitted profile)."""
    head = f"context parallel ({layout.cp_algo}, c={layout.cp}"
    if layout.ulysses:
        return f"{head}): every rank attends the whole sequence on its own heads, the same causal work"
    if layout.cp_load_balance:
        return (
            f"{head}, head-tail load balance): every rank attends the same number of causal (query, key) pairs; "
            "the exchange of half the queries and outputs with the partner rank is timed"
        )
    if not causal_skip:
        return (
            f"{head}, contiguous chunks): every rank's attention core counted in full (the flat model skips no "
            "masked block), so the last rank's larger causal share is not timed"
        )
    return (
        f"{head}, contiguous chunks): the attention core is timed at the last rank's causal work, "
        f"{layout.attention_imbalance:.3g}x the mean (its queries see the most keys and flash skips the masked "
        "blocks); parallel.context_parallel_load_balance would even it"
    )


def _pipeline_assumption(layout: Layout) -> str:
    """How `predict` counts the pipeline's bubble: 1F1B, interleaved 1F1B, or none."""
    stages, v, micro_steps = layout.pp, layout.interleave, layout.micro_steps
    if stages == 1:
        return "no pipeline bubble"
    if v == 1:
        return (
            f"1F1B pipeline: {micro_steps + stages - 1} micro-batch slots of the busiest stage per step "
            f"(bubble (p-1)/m = {(stages - 1) / micro_steps:.1%})"
        )
    return (
        f"interleaved 1F1B pipeline (Narayanan et al. 2021), v={v} chunks per stage: {micro_steps} + "
        f"{stages - 1}/{v} micro-batch slots of the busiest stage per step (bubble (p-1)/(v·m) = "
        f"{bubble_fraction(stages, v, micro_steps):.1%}); assumed: MindSpore's {layout.scheduler} scheduler "
        "orders chunks as Megatron-LM does and keeps each stage's work balanced per chunk (a dry run "
        "compiles the chunk placement, never the timing)"
    )


def offload_copy_s(cfg: Config, stage: int) -> float:
    """Seconds one rank of `stage` spends copying one micro batch's offloaded activations over the host link, each
    way (out in the forward, back in the backward: full duplex, so the two directions do not add)."""
    layout = _layout(cfg)
    n = layout.offloaded_in(stage)
    if not n:
        return 0.0
    return n * offloaded_layer_bytes(cfg, layout) / (cfg.hardware.host_link_gbps * 1e9)


def offload_exposed_s(copy_s: float, slot_s: float) -> float:
    """What offload copies add to a micro-batch slot of `slot_s` seconds: the copy out overlaps the slot's forward
    (a third), the copy back its backward (two thirds); the rest waits."""
    return max(0.0, copy_s - slot_s / 3) + max(0.0, copy_s - 2 * slot_s / 3)
