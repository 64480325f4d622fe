"""plan(cfg): everything the planner says of one config in one dict (tools/plan.py --json; docs/planner.md)."""

from __future__ import annotations

from mindscale.config import Config
from mindscale.perf import flops
from mindscale.perf.gemm_peak import device_peak_tflops
from mindscale.perf.planner.activations import offload_resident_bytes, offloaded_layer_bytes
from mindscale.perf.planner.caches import _layout
from mindscale.perf.planner.communication import communication
from mindscale.perf.planner.goodput import COMPILE_S, predict_goodput
from mindscale.perf.planner.memory import memory_budget_gib, stage_host_bytes, stage_memory
from mindscale.perf.planner.schedule import in_flight_forwards, layer_graph_calls
from mindscale.perf.planner.sizes import GIB
from mindscale.perf.planner.step_time import offload_copy_s, predict


def plan(
    cfg: Config, peak_tflops: float | None = None, efficiency: float | None = None, compile_s: float = COMPILE_S
) -> dict:
    """The plan of `cfg` (tools/plan.py --json, docs/planner.md): params, FLOPs, worst-stage memory, fits, comm
    bytes, prediction, goodput (`compile_s`: one compile of the step, goodput.py)."""
    peak = peak_tflops if peak_tflops is not None else device_peak_tflops(cfg)
    layout = _layout(cfg)
    recomputed = [layout.recomputed_in(k) for k in range(layout.pp)]
    stages = [stage_memory(cfg, k) for k in range(layout.pp)]
    worst = max(range(len(stages)), key=lambda k: stages[k]["total"])
    comm = communication(cfg, worst)
    budget = memory_budget_gib(cfg)
    total_gib = stages[worst]["total"] / GIB
    host = offload_plan(cfg)
    predicted = predict(cfg, peak, efficiency)
    return {
        "config": cfg.run.name,
        "hardware": cfg.hardware.name,
        "devices": cfg.devices,
        "layout": {
            "data_parallel": cfg.parallel.data_parallel,
            "model_parallel": cfg.parallel.model_parallel,
            "expert_parallel": cfg.parallel.expert_parallel,
            "experts": cfg.model.moe.num_experts,
            "context_parallel": cfg.parallel.context_parallel,
            "context_parallel_algo": cfg.parallel.context_parallel_algo,
            "pipeline_stage": cfg.parallel.pipeline_stage,
            "micro_batch_num": cfg.parallel.micro_batch_num,
            "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": cfg.samples_per_step,
            "gradient_accumulation_steps": cfg.parallel.gradient_accumulation_steps,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "tensor_split": list(layout.tensor_split),  # 2D/3D tensor parallel's degrees (1D: 1s)
            "optimizer_shard": cfg.parallel.optimizer_shard,
            "gradient_accumulation_shard": cfg.parallel.gradient_accumulation_shard,
            "recompute": cfg.recompute.mode,
            "recompute_layers": recomputed,
            "recompute_comm": cfg.recompute.comm,
            "layers_per_stage": list(layout.layers_per_stage),
            "offload_layers": [layout.offloaded_in(k) for k in range(layout.pp)],
            "pipeline_interleave": layout.interleave,
            "pipeline_scheduler": layout.scheduler,
            "attention": layout.attention,
        },
        "params": flops.param_count(cfg.model),
        "matmul_params": flops.matmul_param_count(cfg.model),
        "flops_per_token": flops.model_flops_per_token(cfg.model),
        "hflops_per_token": flops.hardware_flops_per_token(cfg.model, layout.recompute, len(layout.recomputed)),
        "memory_gib": {k: v / GIB for k, v in stages[worst].items()},
        "memory_stage": worst,
        "memory_gib_per_stage": [s["total"] / GIB for s in stages],
        "in_flight_forwards_per_stage": [
            in_flight_forwards(layout.pp, layout.interleave, layout.micro_steps, k) for k in range(layout.pp)
        ],
        "layer_graph_calls": layer_graph_calls(layout.pp, layout.interleave, layout.micro_steps),
        "device_memory_gib": cfg.hardware.memory_gib,
        "memory_pool_gib": cfg.hardware.memory_pool_gib,
        "memory_budget_gib": budget,
        "memory_headroom_gib": budget - total_gib,
        "fits": total_gib <= budget and host["fits"],
        "offload": host,
        "comm_bytes_per_step": comm,
        "predicted": predicted,
        "goodput": predict_goodput(cfg, stages, predicted["step_time_s"], compile_s),
    }


def offload_plan(cfg: Config) -> dict:
    """Activation offload (offload.layers) of `cfg`: layers per stage, the bytes one layer moves per micro batch
    and what it keeps on the device, host memory per stage against hardware.host_memory_gib, traffic per step
    each way on the busiest stage and its copy time per micro batch (predict counts what is exposed)."""
    layout, hw = _layout(cfg), cfg.hardware
    per_stage = [layout.offloaded_in(k) for k in range(layout.pp)]
    if not layout.offloaded:
        return {"layers_per_stage": per_stage, "fits": True}
    host = [stage_host_bytes(cfg, k) / GIB for k in range(layout.pp)]
    moved = offloaded_layer_bytes(cfg, layout)
    return {
        "layers_per_stage": per_stage,
        "backward_prefetch": layout.offload_prefetch,
        "bytes_per_layer": moved,
        "resident_bytes_per_layer": offload_resident_bytes(cfg),
        "host_gib_per_stage": host,
        "host_memory_gib": hw.host_memory_gib,
        "host_link_gbps": hw.host_link_gbps,
        "bytes_per_step": max(per_stage) * moved * layout.micro_steps,
        "copy_s_per_micro_batch": max(offload_copy_s(cfg, k) for k in range(layout.pp)),
        "fits": max(host) <= hw.host_memory_gib,
    }
