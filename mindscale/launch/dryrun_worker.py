"""MindSpore's dry run of one rank's training graph, and what its compiled graph shows.

    python -m mindscale.launch.dryrun_worker --config C [--set k=v ...] [--packed]   # rank RANK_ID, JSON on stdout

Run inside the environment of mindscale.launch.standins.dryrun_environment (tools/dryrun.py forks one
such process per rank from mindscale.launch.dryrun_forks, which calls `main`). With MS_SIMULATION_LEVEL=0
MindSpore compiles rank R's semi-auto-parallel graph, frontend and parallel passes (strategy checks,
redistribution, pipeline split, optimizer shard), creates dummy communication groups, and runs nothing.
The graph is built by mindscale.train.loop.step.build_train_graph, the function run_train.py trains with,
under no_init_parameters: no weight is allocated.

What the report holds, and where it comes from:
  local_shapes  every parameter of the step (weights, AdamW moments, accumulation buffers) -> its
                shape on this rank after compile (Parameter.shape, which includes the optimizer shard)
  layouts       the same parameters -> [device matrix, tensor map, full shape, optimizer-shard group]
  bytes         weights, grads, optimizer on this rank (docs/dryrun.md defines each)
  collectives   from the compiled graph (its `validate` IR, read by mindscale.launch.compiled_ir): kind,
                group size, count and bytes per step
  groups        the communication groups those collectives use
  offload_copies  activation offload's copies to host memory and back: destination, count and bytes per step
  inputs        how the step's inputs reach the computation: gathered over which ranks, sliced into
  row_groups    which micro-batch rows, and the ranks whose tokens are distinct parts of the batch (input_rows)
  pipeline_config  MindSpore's pipeline_interleave and pipeline_scheduler, as the runtime set them
  memory_pool_gib  the ceiling the runtime set on MindSpore's device memory pool (None if MindSpore holds none)
  pipeline_chunks  per forward Send and Receive between stages, how many the compiled graph holds of each
                model chunk (the chunk MindSpore derived for it; compiled_ir.pipeline_chunks)
  ordered_micro_batches  the accumulation micro batches whose backward the graph finishes before the
                next one's forward starts (compiled_ir.ordered_micro_batches)
  device_memory  at MS_SIMULATION_LEVEL=1 (tools/dryrun.py --memory): MindSpore's plan of the rank's device
                memory (mindscale.launch.dryrun_memory); with --memory run one step is executed as well
What it cannot tell: whether kernels exist and run, numerics, speed; device memory only at level 1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from mindscale.config import ConfigError
from mindscale.cli import add_config_arguments, config_from_args, fail
from mindscale.launch.compiled_ir import describe_ir


def first_error_line(exc: BaseException) -> str:
    """MindSpore's first message line and, where the trace names one, the op and the line of our code."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else type(exc).__name__
    ours = next((line for line in lines if line.startswith("In file") and "/models/" in line), None)
    return f"{head} ({ours})" if ours and ours not in head else head


def example_inputs(cfg, layout, packed: bool) -> tuple:
    """Zero batches of the shapes and dtypes the trainer feeds (mindscale/train/data/dataset.py, make_batch):
    pretraining data's tokens [rows, seq + 1]; `packed` SFT data's also loss_mask and segment_ids [rows, seq]."""
    from mindspore import Tensor

    rows, seq = layout.rows_per_step, cfg.model.seq_length
    tokens = Tensor(np.zeros((rows, seq + 1), np.int32))
    if not packed:
        return (tokens,)
    return tokens, Tensor(np.ones((rows, seq), np.float32)), Tensor(np.zeros((rows, seq), np.int32))


def _nbytes(param) -> int:
    from mindspore.common.dtype import dtype_to_nptype

    return int(np.prod(param.shape, dtype=np.int64)) * np.dtype(dtype_to_nptype(param.dtype)).itemsize


def describe_compiled(step, model, network, ir_dir: Path | None, rank: int) -> dict:
    """What a compiled train step holds on this rank: local shapes and layouts of its parameters, the bytes
    of weights, gradient storage and AdamW moments, and (with `ir_dir`) its collectives per step. `model`
    holds the weights, `network` the trained parameters; gradient buffers are named accu_grads.*, moments
    adam_m.* / adam_v.* (MindSpore's AdamWeightDecay), as in MindFormers' wrappers."""
    # this rank's parameters: a pipeline stage's graph holds only its own (the others keep their full,
    # unallocated shapes); the compiled layouts name exactly those
    held = step.parameter_layout_dict
    params = [p for p in step.get_parameters() if p.name in held]
    report = {
        "local_shapes": {p.name: list(p.shape) for p in params},
        # the compiled layout of each (device matrix, tensor map, full shape, optimizer-shard group):
        # what a restore slices full tensors by (models.weights)
        "layouts": {
            p.name: [list(held[p.name][0]), list(held[p.name][1]), list(held[p.name][6]), held[p.name][5]]
            for p in params
        },
    }
    weights = {p.name for p in model.get_parameters()}
    trainable = {p.name for p in network.trainable_params()}
    accumulated = [p for p in params if p.name.startswith("accu_grads.")]
    report["bytes"] = {
        "weights": sum(_nbytes(p) for p in params if p.name in weights),
        # the gradient storage: accumulation buffers when the graph keeps them, else one gradient per
        # trained parameter as the optimizer receives it (its local shape after compile)
        "grads": sum(_nbytes(p) for p in (accumulated or [p for p in params if p.name in trainable])),
        "optimizer": sum(_nbytes(p) for p in params if p.name.startswith(("adam_m.", "adam_v."))),
    }
    if ir_dir is not None:
        report.update(describe_ir(ir_dir, rank))
    return report


def _memory_pool_set(rt) -> float | None:
    """The pool ceiling the runtime gave MindSpore (train/loop/runtime.py), if MindSpore reports it configured."""
    from mindspore._c_expression import RuntimeConf

    return rt.memory_pool_gib if RuntimeConf.get_instance().is_memory_configured() else None


def _pipeline_config() -> dict:
    """MindSpore's pipeline_config as the runtime left it (train/loop/runtime.py)."""
    import mindspore as ms

    return {key: ms.get_auto_parallel_context(key) for key in ("pipeline_interleave", "pipeline_scheduler")}


def compile_step(step, inputs: tuple, model, network, rt, ir_dir: Path | None = None) -> dict:
    """Compile a train step on `inputs` for this process's rank (`rt`: its Runtime) and report what the
    compiled graph holds (describe_compiled), or MindSpore's error."""
    from mindscale.train.loop.runtime import set_input_layout

    layout = rt.layout
    report = {
        "compiled": False,
        "error": None,
        "rank": rt.rank,
        "stage": layout.stage_of_rank(rt.rank),
        "devices": layout.devices,
        "local_shapes": {},
        "bytes": {},
        "groups": {},
        "collectives": [],
        "compile_s": None,
        "memory_pool_gib": _memory_pool_set(rt),
        "pipeline_config": _pipeline_config(),
    }
    set_input_layout(layout, len(inputs))
    began = time.perf_counter()
    try:
        step.compile(*inputs)
    except (RuntimeError, ValueError, TypeError) as exc:
        report["error"] = first_error_line(exc)
        return report
    finally:
        report["compile_s"] = round(time.perf_counter() - began, 2)
    report["compiled"] = True
    report.update(describe_compiled(step, model, network, ir_dir, rt.rank))
    return report


def memory_level() -> bool:
    """MindSpore's level-1 dry run (device memory, tools/dryrun.py --memory)."""
    return os.environ.get("MS_SIMULATION_LEVEL") == "1"


def for_memory_plan(cfg):
    """At level 1: memory_optimize_level O1, so MindSpore's SOMAS pass plans the step's memory at compile time
    (mindscale.launch.dryrun_memory), and two dispatch threads: on a 2-core host MindSpore starts one, which
    turns off kernel-by-kernel sub-graphs and refuses the step's overflow branch ("Can not build a sub graph
    which contains ConditionSwitch ... by kbk")."""
    import dataclasses

    import mindspore as ms

    ms.runtime.dispatch_threads_num(2)
    return dataclasses.replace(cfg, context={**cfg.context, "memory_optimize_level": "O1"})


def run_one_step(step, inputs: tuple) -> dict:
    """Execute one step at level 1 (nothing computes; the rank's parameters are allocated on the host) and read
    the peak of what MindSpore's device memory pool handed out."""
    import mindspore as ms

    step(*inputs)
    ms.runtime.synchronize()
    return {"executed_peak_bytes": ms.runtime.max_memory_allocated()}


def compile_rank(cfg, packed: bool = False, ir_dir: Path | None = None, run_step: bool = False) -> dict:
    """Compile this process's rank (RANK_ID of RANK_SIZE) of the training graph run_train.py trains (and
    its validation graph with train.eval_interval); at level 1 with its device-memory plan, and with
    `run_step` one step executed on zero weights (level 1 allocates them on the host)."""
    from mindspore.nn.utils import no_init_parameters

    from mindscale.launch.dryrun_memory import device_memory
    from mindscale.train.loop.runtime import setup
    from mindscale.train.loop.step import build_train_graph

    if memory_level():
        cfg = for_memory_plan(cfg)
    rt = setup(cfg)
    with no_init_parameters():
        graph = build_train_graph(cfg, rt.layout)
    inputs = example_inputs(cfg, rt.layout, packed)
    report = compile_step(graph.step, inputs, graph.model, graph.network, rt, ir_dir)
    if report["compiled"] and memory_level():
        report["device_memory"] = device_memory([p for p in (ir_dir, Path.cwd()) if p], rt.rank)
        if run_step and report["device_memory"]:
            report["device_memory"].update(run_one_step(graph.step, inputs))
    if report["compiled"] and cfg.train.eval_interval:  # after the step's IR was read: its IR files come too
        _compile_validation(cfg, graph, rt.layout, packed, report)
    return report


def _compile_validation(cfg, graph, layout, packed: bool, report: dict) -> None:
    """The forward-only validation graph of train.eval_interval (mindscale/train/loop/evaluate.py), compiled as
    the trainer compiles it: after the step, on the same (sliced) weights, a step's rows per call."""
    from mindscale.train.loop.evaluate import EvalStep

    step = EvalStep(graph.model, layout)
    step.set_train(False)
    began = time.perf_counter()
    try:
        step.compile(*example_inputs(cfg, layout, packed))
    except (RuntimeError, ValueError, TypeError) as exc:
        report["compiled"], report["error"] = False, f"validation graph: {first_error_line(exc)}"
    finally:
        report["eval_compile_s"] = round(time.perf_counter() - began, 2)


def main(argv: list[str] | None = None, compile_fn=compile_rank) -> int:
    """The dry-run worker: `compile_fn(cfg, packed, ir_dir)` (MindScale's graph; bench/mf_dryrun.py passes
    MindFormers') compiles this rank, and its report is printed as one JSON line."""
    parser = argparse.ArgumentParser(
        description="Compile rank RANK_ID under MindSpore's dry run (see tools/dryrun.py)."
    )
    add_config_arguments(parser)
    parser.add_argument("--packed", action="store_true", help="feed segment_ids as packed SFT data does")
    parser.add_argument("--run-step", action="store_true", help="at level 1: execute one step after the compile")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    ir_dir = os.environ.get("MS_DEV_SAVE_GRAPHS_PATH")
    try:
        report = compile_fn(
            cfg, args.packed, Path(ir_dir) if ir_dir else None, **({"run_step": True} if args.run_step else {})
        )
    except ConfigError as exc:
        fail(str(exc))
    report["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
