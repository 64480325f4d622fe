"""MindSpore context, device detection, communication and parallel context, from a Config.

This is where one code path forks by hardware: on Ascend/GPU the model's sharding plan runs under
semi-auto parallel; on CPU MindSpore refuses semi-auto parallel, so only data parallelism exists
and a config that needs model or pipeline parallelism is refused before anything is built.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
from mindspore.communication import get_group_size, get_rank, init

from mindscale.config import OPTIMIZER_SHARD_MIN_KIB, Config, ConfigError, Layout
from mindscale.devices import detect_device
from mindscale.io import write_atomically
from mindscale.train.loop.runnable import check_runnable


MAX_CALL_DEPTH = 10000
# MindSpore's switch (read once, at the first pipeline compile): a pipeline's micro-batch StridedSlice is split
# by its `out_shard_size` attribute and not redistributed, instead of strategy (1, 1) on an all-gathered batch
PIPELINE_OWN_ROWS = "PIPELINE_SLICE_SKIP_REDISTRIBUTION"
SPEED_UP_DIR = "parallel_speed_up"  # the run folder's MindSpore parallel_speed_up_json files, one per rank


@dataclass(frozen=True)
class Runtime:
    device_target: str  # Ascend | GPU | CPU
    rank: int
    world: int
    layout: Layout
    memory_pool_gib: float | None = None  # the ceiling set on MindSpore's device memory pool (None on CPU)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def say(self, text: str) -> None:
        """A line for the whole job, printed once (by rank 0)."""
        if self.is_main:
            print(text, flush=True)


def resolve_device(device_target: str) -> str:
    """The device this process runs on: run.device_target, or the one the launcher also picked
    (mindscale.devices) when it is auto; a visible accelerator without its MindSpore backend is a
    one-line error rather than a silent CPU run."""
    device = detect_device(device_target, os.environ)
    if device_target == "auto" and device != "CPU" and not ms.hal.is_available(device):
        raise ConfigError(
            f"{device} devices are visible here but this MindSpore has no {device} backend; install "
            f"MindSpore for {device} or --set run.device_target=CPU"
        )
    return device


def launched_workers() -> int:
    """Workers started by msrun (MS_WORKER_NUM) or a rank table (RANK_SIZE); 1 when run directly."""
    return int(os.environ.get("MS_WORKER_NUM") or os.environ.get("RANK_SIZE") or 1)


def joins_cluster(world: int) -> bool:
    """Whether this process calls init(): every process msrun starts (MS_ROLE), at any worker count, and
    every rank of several. msrun also starts its scheduler with the entry point's command line; init()
    is where that process serves the workers until they end, and then exits. Without it the scheduler
    of a one-worker job ran a whole second training beside the worker's, into the same run folder."""
    return world > 1 or os.environ.get("MS_ROLE") is not None


def dry_run() -> bool:
    """MindSpore's dry run (tools/dryrun.py): the graph is compiled for RANK_ID of RANK_SIZE, nothing runs."""
    return os.environ.get("MS_SIMULATION_LEVEL") is not None


# the hardware profile that describes each chip MindSpore names (configs/hardware/)
PROFILE_OF_CHIP = {"ascend910": "ascend910a", "ascend910b": "ascend910b"}


def check_chip(cfg: Config, reported: str) -> None:
    """Refuse a hardware profile that describes another chip than the one MindSpore reports on this host
    (its get_ascend_soc_version(); empty under the dry run): the profile decides the MFU peak, the memory
    ceiling, bf16 and how overflow is detected (a 910A saturates fp16: train/loop/step.py saturates_fp16)."""
    wanted = cfg.hardware.soc_version
    if not reported or not wanted or reported == wanted:
        return
    fix = (
        f"--set hardware={PROFILE_OF_CHIP[reported]}"
        if reported in PROFILE_OF_CHIP
        else f"a hardware profile with soc_version: {reported}"
    )
    raise ConfigError(
        f"this host's NPUs are {reported} (MindSpore) but hardware={cfg.hardware.name!r} describes "
        f"{wanted}; use {fix} (the peak, memory ceiling, bf16 and overflow rules follow the profile)"
    )


def setup(cfg: Config) -> Runtime:
    """Set the MindSpore context, start communication and set the parallel context."""
    device = resolve_device(cfg.run.device_target)
    world = launched_workers()
    check_runnable(cfg, device, world)
    mode = ms.GRAPH_MODE if cfg.run.mode == "graph" else ms.PYNATIVE_MODE
    # every micro batch adds nested calls to the step's graph (384 of them exceed MindSpore's default
    # depth of 1000, measured); MindFormers runs with 10000 as well. context: may still override it.
    ms.set_context(mode=mode, max_call_depth=MAX_CALL_DEPTH)
    ms.set_device(device)
    if device == "Ascend" and not dry_run():
        from mindspore._c_expression import MSContext  # what MindSpore's own loss-scale cells ask

        check_chip(cfg, MSContext.get_instance().get_ascend_soc_version())
    if device == "CPU":
        # MindSpore's CPU kernels size their own thread pool (25 threads) regardless of OMP_NUM_THREADS;
        # on a worker pinned to one core that oversubscribes it (measured 1.5-1.9x slower steps).
        ms.device_context.cpu.op_tuning.threads_num(len(os.sched_getaffinity(0)))
    if cfg.context:
        try:
            ms.set_context(**cfg.context)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"context={cfg.context}: mindspore.set_context refused it ({str(exc).splitlines()[0]}); "
                "fix or remove the key"
            )
    pool = _bound_device_memory(cfg, device)
    ms.set_seed(cfg.run.seed)
    rank = 0
    if joins_cluster(world):
        if dry_run():  # dummy groups; without this init() asks for CANN's hccl Python package
            from mindspore.communication import _comm_helper

            _comm_helper.GlobalComm.CHECK_ENVS = False
        init()
        rank, world = get_rank(), get_group_size()
    layout = Layout.of(cfg, device, world)
    _set_parallel_context(cfg, layout, rank)
    if rank == 0 and pool is not None:
        hw = cfg.hardware
        print(
            f"device memory: MindSpore's pool may take {pool:g} of {hw.memory_gib:g} GiB per device (hardware."
            f"max_device_memory_gib; {hw.memory_gib - pool:g} GiB left to the runtime and HCCL); the planner's "
            f"budget is memory_margin={hw.memory_margin:g} of the pool",
            flush=True,
        )
    return Runtime(device_target=device, rank=rank, world=world, layout=layout, memory_pool_gib=pool)


def _bound_device_memory(cfg: Config, device: str) -> float | None:
    """Cap MindSpore's device memory pool at hardware.memory_pool_gib (else it may take the whole device and
    leave HCCL's buffers to chance); the planner budgets the same number. Host memory (CPU) is not capped.
    MindSpore's "GB" here is 2**30 bytes."""
    if device == "CPU":
        return None
    pool = cfg.hardware.memory_pool_gib
    # set_memory sets the optimize level too (default O0): pass the context's, which it would otherwise undo
    ms.runtime.set_memory(max_size=f"{pool:.2f}GB", optimize_level=cfg.context.get("memory_optimize_level", "O0"))
    return pool


def _set_parallel_context(cfg: Config, layout: Layout, rank: int) -> None:
    if layout.data_parallel_mode:
        ms.set_auto_parallel_context(
            parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=layout.dp
        )
        return
    if not layout.sharded:
        return
    # Ascend/GPU or the dry run (check_runnable refused this on CPU): the model's .shard() plan is honoured.
    # Each rank feeds its data-parallel share; the input strategy is set per input by set_input_layout, and
    # a pipeline's micro-batch slices take rows of that share (step.slice_own_rows).
    if layout.pp > 1:
        os.environ[PIPELINE_OWN_ROWS] = "1"
    # gradients_mean=False: the sharded loss is the global batch's mean on every rank (its token sums are
    # all-reduced), and the compiler's loss divisor (_VirtualDiv over the stage's devices) with the
    # all-reduce bprops already makes each mirror's sum the exact gradient; a mean would divide it again
    # (by each parameter's replica count). MindFormers' semi-auto configs set the same.
    ms.set_auto_parallel_context(
        parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL,
        device_num=layout.devices,
        gradients_mean=False,
        full_batch=False,
        pipeline_stages=layout.pp,
        enable_parallel_optimizer=layout.optimizer_shard,
        parallel_optimizer_config={
            "parallel_optimizer_threshold": OPTIMIZER_SHARD_MIN_KIB,
            "gradient_accumulation_shard": layout.accumulation_shard,
        },
    )
    if layout.interleave > 1 or layout.scheduler != "1f1b":
        # MindSpore derives each layer's chunk from the data flow (a stage receiving from a later stage starts
        # its next chunk), so the round-robin pipeline_stage per cell (models/sharding.py) is all it needs
        ms.set_auto_parallel_context(
            pipeline_config={"pipeline_interleave": layout.interleave > 1, "pipeline_scheduler": layout.scheduler}
        )
    if layout.ulysses or layout.ep > 1:
        # context_parallel_algo=ulysses_cp: let the redistribution of a sequence split into a head split be one
        # AlltoAll (MindSpore's default lowers it to AllGather + a local slice, moving cp times the bytes);
        # expert_parallel: the same for the tokens' change from a group split to an expert split (models/moe.py)
        ms.set_auto_parallel_context(enable_alltoall=True)
    if not dry_run():  # a dry run must not overwrite the strategy files of a real run of the config
        ms.set_auto_parallel_context(
            strategy_ckpt_config={"save_file": os.path.join(cfg.run_dir, "strategy", f"strategy_rank{rank}.ckpt")}
        )
    _set_communication(cfg, rank)


def _set_communication(cfg: Config, rank: int) -> None:
    """communication: (validated: sharded Ascend layouts only): the collectives fused by their comm_fusion index, and
    the overlap options, which MindSpore reads from a JSON file only."""
    if cfg.communication.comm_fusion:
        ms.set_auto_parallel_context(comm_fusion=cfg.communication.comm_fusion)
    if speed_up_options(cfg):
        _set_speed_up(cfg, rank)


def speed_up_options(cfg: Config) -> dict:
    """MindSpore's parallel_speed_up_json: communication:'s options, and the flash attention load balance of
    parallel.context_parallel_load_balance (validated: colossalai_cp with an even context_parallel)."""
    options = dict(cfg.communication.speed_up)
    if cfg.parallel.context_parallel_load_balance:
        options["enable_flash_attention_load_balance"] = True
    return options


def _set_speed_up(cfg: Config, rank: int) -> None:
    """MindSpore reads the speed-up options from a JSON file, when it is set (context.py's
    `_set_speedup_config_path`). A run keeps its copy in its folder; a dry run writes into a temporary
    folder, removed once read, so that it never writes into a real run's folder nor leaves files behind."""
    if not dry_run():
        path = write_speed_up(cfg, rank, cfg.run_dir / SPEED_UP_DIR)
        ms.set_context(ascend_config={"parallel_speed_up_json_path": str(path)})
        return
    with tempfile.TemporaryDirectory(prefix="mindscale-speed-up-") as folder:
        path = write_speed_up(cfg, rank, Path(folder))
        ms.set_context(ascend_config={"parallel_speed_up_json_path": str(path)})


def write_speed_up(cfg: Config, rank: int, folder: Path) -> Path:
    """The parallel_speed_up_json (speed_up_options) for `rank`, written as `folder`/rank_<r>.json (one per rank:
    the ranks of a node share a run folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank}.json"
    write_atomically(path, json.dumps(speed_up_options(cfg), indent=1))
    return path


def set_input_layout(layout: Layout, num_inputs: int) -> None:
    """Sharded layouts: every input [rows, seq] is split over data parallel only, so the model-parallel
    ranks of a group (and the ranks of every stage) feed the same rows (Layout.data_rank)."""
    if layout.sharded:
        ms.set_auto_parallel_context(dataset_strategy=((layout.dp, 1),) * num_inputs)
