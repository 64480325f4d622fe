"""The parallel planner: parameters, FLOPs, per-device memory, communication and a predicted step
time for a resolved config, before anything is compiled (docs/planner.md).

Parameters and FLOPs come from mindscale/perf/flops.py (PaLM App. B; Korthikanti et al. 2022; Narayanan et al.
2021). The modules, each importing only those listed before it:

    sizes          bytes per dtype, GiB
    caches         what a search asks again and again, kept per config object and per model
    activations    what a layer keeps for its backward (Korthikanti et al. 2022, §4, as MindSpore keeps it)
    schedule       the pipeline schedule: forwards in flight, stage-boundary sends, the bubble
    parameters     every parameter's per-rank slice, and what a rank stores of them
    memory         one device's memory per pipeline stage, and the budget it must fit
    communication  the bytes one rank sends per step, by parallel dimension
    speed          the speed model: kernels by shape, collectives by HCCL's α–β model
    step_time      the predicted step time as a sum of where it goes, and the assumptions it rests on
    full_plan      plan(): all of the above for one config (tools/plan.py --json)
    replan         --set overrides and --devices applied to a config
    layout_search  search(): the layouts that fit a number of devices, ranked by predicted tokens/s
    text           a plan as text (tools/plan.py, README's table of the shipped configs)

Callers outside the package use the names imported here: `from mindscale.perf import planner`, then
`planner.plan(cfg)`.
"""

from mindscale.perf.planner.activations import (
    FLASH_STATS_WIDTH,
    PAPER,
    ActivationDtypes,
    expert_slots,
    gathered_kv_bytes,
    layer_activation_bytes,
    local_tokens,
    mindspore_dtypes,
    offload_resident_bytes,
    offloaded_layer_bytes,
    rematerialised_bytes,
    routed_activation_bytes,
)
from mindscale.perf.planner.communication import (
    communication,
    context_parallel_bytes_per_layer,
    expert_alltoall_bytes,
    gradient_reduce_bytes,
    tied_embedding_exchange_bytes,
    tp_all_reduces,
)
from mindscale.perf.planner.full_plan import offload_plan, plan
from mindscale.perf.planner.layout_search import (
    balanced_offset,
    interleave_choices,
    interleaved_offset,
    search,
    tensor_splits,
)
from mindscale.perf.planner.memory import memory_budget_gib, stage_host_bytes, stage_memory
from mindscale.perf.planner.parameters import (
    READ_IN_COMPUTE_DTYPE,
    ParameterSlice,
    layer_slice_params,
    optimizer_shard,
    parameter_slices,
    stage_bytes,
    stage_params,
    stored_shapes,
)
from mindscale.perf.planner.replan import PlanError, replan_devices, with_overrides
from mindscale.perf.planner.schedule import bubble_fraction, chunk_forwards, in_flight_forwards, pipeline_sends
from mindscale.perf.planner.sizes import DTYPE_BYTES, GIB, MOMENT_BYTES
from mindscale.perf.planner.speed import DEFAULT_EFFICIENCY, SpeedModel
from mindscale.perf.planner.step_time import BREAKDOWN, offload_copy_s, offload_exposed_s, predict

__all__ = [
    # activations
    "FLASH_STATS_WIDTH",
    "PAPER",
    "ActivationDtypes",
    "expert_slots",
    "gathered_kv_bytes",
    "layer_activation_bytes",
    "local_tokens",
    "mindspore_dtypes",
    "offload_resident_bytes",
    "offloaded_layer_bytes",
    "rematerialised_bytes",
    "routed_activation_bytes",
    # communication
    "communication",
    "context_parallel_bytes_per_layer",
    "expert_alltoall_bytes",
    "gradient_reduce_bytes",
    "tied_embedding_exchange_bytes",
    "tp_all_reduces",
    # full_plan
    "offload_plan",
    "plan",
    # layout_search
    "balanced_offset",
    "interleave_choices",
    "interleaved_offset",
    "search",
    "tensor_splits",
    # memory
    "memory_budget_gib",
    "stage_host_bytes",
    "stage_memory",
    # parameters
    "READ_IN_COMPUTE_DTYPE",
    "ParameterSlice",
    "layer_slice_params",
    "optimizer_shard",
    "parameter_slices",
    "stage_bytes",
    "stage_params",
    "stored_shapes",
    # replan
    "PlanError",
    "replan_devices",
    "with_overrides",
    # schedule
    "bubble_fraction",
    "chunk_forwards",
    "in_flight_forwards",
    "pipeline_sends",
    # sizes
    "DTYPE_BYTES",
    "GIB",
    "MOMENT_BYTES",
    # speed
    "DEFAULT_EFFICIENCY",
    "SpeedModel",
    # step_time
    "BREAKDOWN",
    "offload_copy_s",
    "offload_exposed_s",
    "predict",
]
# Not public: the tests that compare a layer's kept bytes with the compiled graph's read it here.
from mindscale.perf.planner.activations import _model_layer_activation_bytes  # noqa: E402,F401
