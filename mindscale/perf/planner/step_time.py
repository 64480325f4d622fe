"""The predicted step time (assumptions are returned with the prediction).

Hardware FLOPs of the busiest pipeline stage at `efficiency` x peak, plus tensor-parallel
collectives (on the critical path), times ``(m + p - 1)`` micro-batch slots (1F1B bubble
``(p-1)/m``; interleaved ``m + (p-1)/v`` slots, bubble ``(p-1)/(v·m)``), plus pipeline send/recv (v times
as many with v chunks, not overlapped), plus the part of the data-parallel gradient reduction that
does not overlap the last micro batch's backward (2/3 of its compute). Bandwidths come from the
hardware profile: a group inside one node uses intra_node_gbps, otherwise inter_node_gbps; ranks
are ordered tensor-parallel innermost, then data parallel, then pipeline.
"""
from __future__ import annotations

from mindscale.config import Config, Layout
from mindscale.perf import flops
from mindscale.perf.planner.activations import local_tokens, offloaded_layer_bytes
from mindscale.perf.planner.caches import _layout
from mindscale.perf.planner.communication import communication
from mindscale.perf.planner.schedule import bubble_fraction, pipeline_sends


# Fraction of the peak the hardware FLOPs are assumed to run at (matmul-bound training step).
DEFAULT_EFFICIENCY = {"Ascend": 0.55, "GPU": 0.55, "CPU": 0.3}


def _bandwidth(cfg: Config, span: int) -> float:
    """Bytes/s of a group whose ranks span `span` consecutive devices."""
    hw = cfg.hardware
    gbps = hw.intra_node_gbps if span <= hw.devices_per_node else hw.inter_node_gbps
    return gbps * 1e9


def _stage_flops_per_token(cfg: Config, stage: int) -> float:
    """Hardware FLOPs per token of one stage (whole tensor-parallel group)."""
    model, layout = cfg.model, _layout(cfg)
    output = 6 * flops.output_params(model)
    per_layer = (flops.model_flops_per_token(model) - output) / model.num_layers
    extra = flops.recompute_flops_per_token(model, layout.recompute, layout.recomputed_in(stage))
    per_layer += flops.routing_flops_per_token(model, local_tokens(cfg))
    return layout.layers_per_stage[stage] * per_layer + extra + (output if stage == layout.pp - 1 else 0)


def predict(cfg: Config, peak_tflops: float, efficiency: float) -> dict:
    """Step time, throughput, MFU/HFU, bubble and exposed communication of `cfg` when its hardware FLOPs run at
    `efficiency` x `peak_tflops` per device, with the assumptions it rests on (the module's docstring)."""
    model, layout = cfg.model, _layout(cfg)
    d, t, cp, stages, micro_steps = layout.dp, layout.tp, layout.cp, layout.pp, layout.micro_steps
    tokens_per_micro_batch = local_tokens(cfg)  # on one rank: its sequence chunk under context parallel
    flop_rate = peak_tflops * 1e12 * efficiency
    # a cp group's ranks are t apart, a data-parallel group's t x cp, a pipeline's t x cp x d
    tp_bw, cp_bw = _bandwidth(cfg, t), _bandwidth(cfg, t * cp)
    ep_bw = _bandwidth(cfg, t * cp * layout.ep)  # an expert-parallel group: ep of the data-parallel ranks
    dp_bw, pp_bw = _bandwidth(cfg, t * cp * d), _bandwidth(cfg, t * cp * d * stages)
    slots, comm, copies = [], [], []
    for k in range(stages):
        c = communication(cfg, k)
        compute = tokens_per_micro_batch * _stage_flops_per_token(cfg, k) / t / flop_rate
        slots.append(compute + (c["tp_per_layer"] * layout.layers_per_stage[k] + c["tp_vocab"] / micro_steps) / tp_bw
                     + c["cp_per_layer"] * layout.layers_per_stage[k] / cp_bw
                     + c["ep_per_layer"] * layout.layers_per_stage[k] / ep_bw)
        copies.append(offload_copy_s(cfg, k))
        comm.append(c)
    slot = max(busy + offload_exposed_s(copy, busy) for busy, copy in zip(slots, copies))
    # 1F1B over a pipeline's micro batches; accumulation steps run one after another. Interleaved 1F1B:
    # the warm-up and cool-down run chunks of 1/v of a stage, so the bubble is (p-1)/v slots
    v = layout.interleave
    pipeline = (micro_steps + (stages - 1) / v) * slot
    pp_time = max(c["pp_send_recv"] for c in comm) / pp_bw
    # the once-per-step part overlaps the last micro batch's backward; a per-micro-batch reduce-scatter
    # (gradient_accumulation_shard) overlaps its own micro batch's
    per_micro = max(c["dp_per_micro_batch"] for c in comm) / dp_bw
    once = max(c["dp_grad_reduce"] - c["dp_per_micro_batch"] * micro_steps for c in comm) / dp_bw
    dp_exposed = max(0.0, once - 2 / 3 * slot) + micro_steps * max(0.0, per_micro - 2 / 3 * slot)
    step = pipeline + pp_time + dp_exposed
    tokens_per_s = cfg.samples_per_step * model.seq_length / step
    devices = cfg.devices
    recomputed = len(layout.recomputed)
    return {
        "step_time_s": step, "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / devices,
        "samples_per_s_per_device": cfg.samples_per_step / step / devices,
        "tflops_per_device": tokens_per_s * flops.model_flops_per_token(model) / devices / 1e12,
        "mfu": flops.mfu(tokens_per_s, devices, peak_tflops, model),
        "hfu": flops.hfu(tokens_per_s, devices, peak_tflops, model, layout.recompute, recomputed),
        "bubble_fraction": bubble_fraction(stages, v, micro_steps),
        "pipeline_interleave": v,
        "compute_s": micro_steps * slot,
        "comm_exposed_s": pp_time + dp_exposed,
        "offload_copy_s": max(copies),
        "offload_exposed_s": (micro_steps + (stages - 1) / v) * (slot - max(slots)),
        "peak_tflops": peak_tflops, "efficiency": efficiency,
        "assumptions": _assumptions(cfg, peak_tflops, efficiency, max(copies)),
    }


def _assumptions(cfg: Config, peak_tflops: float, efficiency: float, copy_s: float) -> list[str]:
    """What `predict` assumes of `cfg`, in words (tools/plan.py prints them under the prediction); `copy_s`: the
    busiest stage's offload copy time per micro batch, each way."""
    model, layout = cfg.model, _layout(cfg)
    out = [f"hardware FLOPs run at {efficiency:.0%} of the {peak_tflops:g} TFLOP/s peak",
           "tensor-parallel collectives are on the critical path (not overlapped)"]
    if model.spec.moe:
        out.append(f"mixture of experts: the experts' padding slots (capacity beyond the top_k per token) run at the "
                   f"same rate ({flops.routing_flops_per_token(model, local_tokens(cfg)) / 1e9:.3g} GFLOP per token "
                   "and layer beyond the model FLOPs); the dispatch and combine gathers are not timed")
    if layout.ep > 1:
        out.append(f"expert parallel (ep={layout.ep}): its AlltoAlls are on the critical path (not overlapped); "
                   "experts are assumed evenly loaded (the capacity bounds the slowest)")
    if layout.cp > 1:
        out.append(f"context parallel ({layout.cp_algo}, c={layout.cp}): its K/V all-gathers or all-to-alls are on "
                   "the critical path (not overlapped), and the causal work is balanced over the cp ranks (it is "
                   "not: without head-tail chunks the last chunk's queries see the most keys; flash skips the "
                   "masked blocks, so its rank is the slowest)")
    out.append(_pipeline_assumption(layout))
    if layout.interleave > 1:
        middle = 1 if layout.pp > 2 else 0
        out.append(f"pipeline sends: {pipeline_sends(layout.pp, layout.interleave, middle)} per micro batch on a "
                   "middle stage (2v), counted in full on the critical path (not overlapped with compute)")
    if layout.offloaded:
        out.append(f"activation offload ({sum(layout.offloaded_in(k) for k in range(layout.pp))} layers): each "
                   f"crosses the host link ({cfg.hardware.host_link_gbps:g} GB/s each way, full duplex) out in its "
                   "micro batch's forward and back in its backward; copies run on their own stream and overlap the "
                   "slot's forward third (out) and backward two thirds (in) without slowing compute; what does not "
                   f"overlap is exposed ({copy_s:.3g} s each way per micro batch on the busiest stage)")
    return out + ["data-parallel gradient reduction overlaps the last micro batch's backward (2/3 of its compute), "
                  "a per-micro-batch reduce-scatter its own micro batch's; the rest is exposed",
                  "bandwidths: hardware profile, intra-node for groups within devices_per_node, else inter-node",
                  "optimizer update, data loading and host overhead are not counted"]


def _pipeline_assumption(layout: Layout) -> str:
    """How `predict` counts the pipeline's bubble: 1F1B, interleaved 1F1B, or none."""
    stages, v, micro_steps = layout.pp, layout.interleave, layout.micro_steps
    if stages == 1:
        return "no pipeline bubble"
    if v == 1:
        return (f"1F1B pipeline: {micro_steps + stages - 1} micro-batch slots of the busiest stage per step "
                f"(bubble (p-1)/m = {(stages - 1) / micro_steps:.1%})")
    return (f"interleaved 1F1B pipeline (Narayanan et al. 2021), v={v} chunks per stage: {micro_steps} + "
            f"{stages - 1}/{v} micro-batch slots of the busiest stage per step (bubble (p-1)/(v·m) = "
            f"{bubble_fraction(stages, v, micro_steps):.1%}); assumed: MindSpore's {layout.scheduler} scheduler "
            "orders chunks as Megatron-LM does and keeps each stage's work balanced per chunk (a dry run "
            "compiles the chunk placement, never the timing)")


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
