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
  collectives   from the compiled graph (the `validate` IR): kind, group size, count and bytes per step
  groups        the communication groups those collectives use
  offload_copies  activation offload's copies to host memory and back: destination, count and bytes per step
  inputs        how the step's inputs reach the computation: gathered over which ranks, sliced into
  row_groups    which micro-batch rows, and the ranks whose tokens are distinct parts of the batch (input_rows)
  pipeline_config  MindSpore's pipeline_interleave and pipeline_scheduler, as the runtime set them
  memory_pool_gib  the ceiling the runtime set on MindSpore's device memory pool (None if MindSpore holds none)
  pipeline_chunks  per forward Send and Receive between stages, how many the compiled graph holds of each
                model chunk (the chunk MindSpore derived for it; pipeline_chunks below)
  ordered_micro_batches  the accumulation micro batches whose backward the graph finishes before the
                next one's forward starts (ordered_micro_batches below)
  device_memory  at MS_SIMULATION_LEVEL=1 (tools/dryrun.py --memory): MindSpore's plan of the rank's device
                memory (mindscale.launch.dryrun_memory); with --memory run one step is executed as well
What it cannot tell: whether kernels exist and run, numerics, speed; device memory only at level 1.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from mindscale.config import ConfigError
from mindscale.cli import add_config_arguments, config_from_args, fail

IR_PASS = "validate"  # the last frontend IR: after the parallel passes, recompute and the optimizer shard
DTYPE_BYTES = {"Float32": 4, "Float16": 2, "BFloat16": 2, "Int32": 4, "Int64": 8, "Bool": 1, "UInt8": 1, "Int8": 1,
               "Float64": 8}
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "AllToAll", "Broadcast", "Send", "Receive",
               "MicroStepAllGather", "MiniStepAllGather", "AllGatherV", "ReduceScatterV", "AlltoAllV", "Reduce")
# What a collective is for, from the instance name the parallel passes give it (the optimizer shard's: its weight
# all-gathers, and with gradient_accumulation_shard the gradient reduce-scatter into the sharded buffer every
# micro batch, `_grad_accumulation_shard_grad_VirtualAssignAdd`).
PURPOSES = (("parallel_optimizer", "optimizer_shard"), ("grad_accumulation_shard", "optimizer_shard"),
            ("GLOBALNORM", "grad_norm"), ("mirror", "grad_reduce"),
            ("redistribution", "redistribution"))  # anything else: an operator's own communication
# Which tensor of a collective is "its bytes": the one each rank contributes (input), or for the ops that
# end with more than they start with, the result (AllGather, Receive).
OUTPUT_SIZED = ("AllGather", "Receive", "MicroStepAllGather", "MiniStepAllGather", "AllGatherV")


# ----------------------------------------------------------------------------------------------
# The compiled graph: collectives from the IR text


_GRAPH = re.compile(r"^subgraph @(\S+?)\(")
_NODE = re.compile(r"^\s+%\d+\(\S+\) = (.*)$")
_TENSOR = re.compile(r"Tensor\[(\w+)\]\]?, \(([\d, ]*)\)")  # Tensor[F32], (..) or Ref[Tensor[F32]], (..)
_REF = re.compile(r"@([^\s(),\[\]]+)")
_REORDERED = re.compile(r"grad_accu_reorder2: I64\((\d+)\)")
_FORWARD_BORDER = re.compile(r"^\s+%\d+\(\S+\) = (Send|Receive)\(.*cnode_primal_attrs: \{(.*)\}\s*$")
_CHUNK = re.compile(r"\bchunk: I64\((\d+)\)")
_MOVE_TO = re.compile(r'MoveTo\(%[\w.]+, "(\w+)"')  # MoveTo(%x, "CPU", Bool(0)): the destination


def _tensor_bytes(text: str) -> int:
    """Bytes of the first tensor type in an IR type list like `(<Tensor[Float32], (8, 16)>)`."""
    match = _TENSOR.search(text)
    if not match:
        return 0
    shape = [int(d) for d in match.group(2).replace(" ", "").split(",") if d]
    return int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES.get(match.group(1), 4)


def _attr(line: str, name: str) -> str | None:
    match = re.search(rf"\b{name}: (\([^)]*\)|[^,}}]+)", line)
    return match.group(1).strip() if match else None


def _callees(rhs: str) -> list[str]:
    """The graphs a node calls: `call @g(..)` / `@g(..)` (a reused cell, a layer kept by lazy_inline),
    or `%n[@Partial(@g)](..)` / `%n[@FuncUnion(@a, @b)](..)` (a backward closure, an `if`'s branches).
    Creating a Partial is not a call."""
    if rhs.startswith("call @") or rhs.startswith("@"):
        return _REF.findall(rhs.split("(", 1)[0])[:1]
    if rhs.startswith("%") and "[" in rhs.split("(", 1)[0]:
        return [g for g in _REF.findall(rhs.split("](", 1)[0]) if g not in ("Partial", "FuncUnion")]
    return []


def parse_ir(text: str, rank: int) -> dict:
    """{graph: {"collectives": [(kind, purpose, ranks, bytes)], "copies": [(destination, bytes)], "calls": [graph,
    ...]}} of one IR file: `copies` are the MoveTo nodes activation offload puts in (to "CPU" in the forward,
    back to "Ascend" before the backward); `calls` lists a callee once per calling node (both branches of an `if`
    count as taken)."""
    graphs: dict[str, dict] = {}
    current = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        start = _GRAPH.match(line)
        if start:
            current = graphs.setdefault(start.group(1), {"collectives": [], "copies": [], "calls": []})
            continue
        node = _NODE.match(line) if current is not None else None
        if not node:
            continue
        rhs = node.group(1)
        current["calls"] += _callees(rhs)
        kind = rhs.split("(", 1)[0].removeprefix("PrimFunc_")
        if kind == "MoveTo":
            types = lines[i + 1] if i + 1 < len(lines) else ""
            current["copies"].append((_MOVE_TO.search(rhs).group(1), _tensor_bytes(types.partition("->")[0])))
        if kind not in COLLECTIVES:
            continue
        ranks = _attr(line, "group_rank_ids") or _attr(line, "rank_list") or "()"
        ranks = tuple(int(r) for r in re.findall(r"\d+", ranks))
        if kind in ("Send", "Receive") and len(ranks) != 2:  # a pair named by the peer in the world group
            side = "dest" if kind == "Send" else "src"
            peer = _attr(line, f"{side}_global_rank") or _attr(line, f"{side}_rank")  # the primitive's, listed first
            ranks = tuple(sorted({rank, int(re.findall(r"\d+", peer)[-1])}))  # the value of I64(4)
        instance = _attr(line, "instance name") or ""
        purpose = "pipeline" if kind in ("Send", "Receive") else next(
            (p for key, p in PURPOSES if key in instance), "operator")
        types = lines[i + 1] if i + 1 < len(lines) else ""
        inputs, _, output = types.partition("->")
        current["collectives"].append((kind, purpose, ranks,
                                       _tensor_bytes(output if kind in OUTPUT_SIZED else inputs)))
    return graphs


def graph_call_counts(graphs: dict) -> dict[str, int]:
    """How often each graph runs per step: the root (the graph nobody calls) once, a callee as often as
    its callers call it. Branches (the optimizer under `if not overflow`) count as taken."""
    called = {g for info in graphs.values() for g in info["calls"]}
    roots = [g for g in graphs if g not in called] or list(graphs)[-1:]
    counts: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        if name not in graphs or depth > 200:
            return
        counts[name] += times
        for callee in graphs[name]["calls"]:
            visit(callee, times, depth + 1)

    for root in roots:
        visit(root, 1)
    return counts


def collectives_of(graphs: dict) -> tuple[list[dict], dict[str, list[int]]]:
    """Collectives per step, one entry per (kind, purpose, group): count and bytes; and the groups used."""
    counts = graph_call_counts(graphs)
    total: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for name, info in graphs.items():
        for kind, purpose, ranks, size in info["collectives"]:
            entry = total[(kind, purpose, ranks)]
            entry[0] += counts.get(name, 0)
            entry[1] += counts.get(name, 0) * size
    rows = [{"kind": kind, "purpose": purpose, "group_size": len(ranks), "ranks": list(ranks), "count": n,
             "bytes": size} for (kind, purpose, ranks), (n, size) in sorted(total.items()) if n]
    groups = {"-".join(map(str, ranks)): list(ranks) for (_k, _p, ranks), (n, _s) in total.items() if n and ranks}
    return rows, groups


def offload_copies(graphs: dict) -> list[dict]:
    """Activation offload's copies per step, one entry per destination ("CPU": out of device memory in the
    forward, "Ascend": back before the backward): count and bytes, counted per call as collectives are."""
    counts = graph_call_counts(graphs)
    total: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, info in graphs.items():
        for destination, size in info["copies"]:
            total[destination][0] += counts.get(name, 0)
            total[destination][1] += counts.get(name, 0) * size
    return [{"to": to, "count": n, "bytes": size} for to, (n, size) in sorted(total.items()) if n]


# ----------------------------------------------------------------------------------------------
# The compiled graph: which rows of the step's inputs a rank computes on


_INPUT_PARAM = re.compile(r"^%(para\d+_inputs(\d+)): <Tensor\[\w+\], \((\d+)[^>]*> : \[(\d+)")
_OPERAND = re.compile(r"^(?:AllGather|Depend|PrimFunc_StridedSlice)\((%[\w.]+)")
_ROW_RANGE = re.compile(r"^PrimFunc_StridedSlice\(%[\w.]+, \(I64\((\d+)\)(?:, I64\(\d+\))*\), \(I64\((\d+)\)")


def input_rows(text: str) -> dict:
    """How the step's inputs (tokens[, loss_mask][, segment_ids]) reach the computation in one
    rank's compiled graph, from its IR (the `validate` pass):

      inputs      per input: its local and global rows, the ranks an AllGather of it concatenates (in
                  group order; empty when none does), and per micro batch the row range its micro-batch
                  StridedSlice takes [begin, end] with that slice's split of the rows (1: it slices the
                  global batch every rank then holds; dp: it slices the rank's own rows, and the range is
                  the local one). No micro batches: the rows are used whole.
      row_groups  the ranks over which the loss's scalar sums (token losses, token count) are all-reduced:
                  the ranks whose tokens are distinct parts of the global batch (the last stage only): whole
                  rows, or with a head split over the sequence-parallel tokens (Layout.logit_split) each
                  tp rank its own tokens of its data-parallel rows.
    """
    inputs: dict[str, dict] = {}
    carries: dict[str, str] = {}  # a node whose value is an input's rows (its AllGather, a Depend) -> the input
    row_groups: set[tuple] = set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _GRAPH.match(line):
            carries = {}  # node names are a graph's own
            continue
        param = _INPUT_PARAM.match(line)
        if param:
            inputs[f"%{param.group(1)}"] = {"input": int(param.group(2)), "rows": int(param.group(3)),
                                            "global_rows": int(param.group(4)), "gathered_over": [], "micro": {}}
            continue
        node = _NODE.match(line)
        if not node:
            continue
        rhs = node.group(1)
        operand = _OPERAND.match(rhs)
        source = operand and (operand.group(1) if operand.group(1) in inputs else carries.get(operand.group(1)))
        if source and rhs.startswith(("AllGather", "Depend")):
            carries[line.split("(", 1)[0].strip()] = source
            if rhs.startswith("AllGather"):
                inputs[source]["gathered_over"] = [int(r) for r in re.findall(r"\d+", _attr(line, "group_rank_ids"))]
        elif source and _attr(line, "micro") is not None:
            begin, end = map(int, _ROW_RANGE.match(rhs).groups())
            split = re.search(r"\{in_strategy: \(\((\d+)", line)
            micro = int(re.search(r"\((\d+)\)", _attr(line, "micro")).group(1))  # I64(3)
            inputs[source]["micro"][micro] = [begin, end, int(split.group(1)) if split else 1]
        elif rhs.startswith("AllReduce") and "forward_op" in (_attr(line, "instance name") or ""):
            types, scope = (lines[i + 1] if i + 1 < len(lines) else ""), (lines[i + 2] if i + 2 < len(lines) else "")
            if "], ()>) ->" in types and "/loss-" in scope and "Gradients" not in scope:
                row_groups.add(tuple(int(r) for r in re.findall(r"\d+", _attr(line, "group_rank_ids"))))
    return {"inputs": [{**{k: v for k, v in info.items() if k != "micro"},
                        "micro_batches": [info["micro"][m] for m in sorted(info["micro"])]}
                       for info in sorted(inputs.values(), key=lambda info: info["input"])],
            "row_groups": sorted(list(group) for group in row_groups)}


def ordered_micro_batches(text: str) -> list[int]:
    """The micro batches m whose backward must end before micro batch m + 1's forward begins: under gradient
    accumulation MindSpore's parallel passes make the next micro batch's input slices depend on the previous
    one's backward (its ReorderGradAccumulation; each such Depend carries `grad_accu_reorder2: m`), so one
    micro batch's activations are live at a time. Empty where nothing orders them (a DATA_PARALLEL graph)."""
    return sorted({int(m) for m in _REORDERED.findall(text)})


def pipeline_chunks(text: str) -> dict[str, dict[str, int]]:
    """{"Send": {chunk: count}, "Receive": {chunk: count}} over the forward pass's stage borders: the Sends
    that end a chunk on this stage (primal attribute pipeline_end) and the Receives that begin one
    (pipeline_begin), excluding the backward pass's (which name their forward node). MindSpore numbers the
    chunks from the data flow (a stage receiving from a later stage starts its next chunk), so with
    interleave v stage s holds v chunks' borders, one per micro batch each, except the first stage's first
    chunk (fed by the embedding) and the last stage's last (feeding the head)."""
    counts = {"Send": defaultdict(int), "Receive": defaultdict(int)}
    for line in text.splitlines():
        node = _FORWARD_BORDER.match(line)
        if not node or "forward_node_name" in node.group(2):
            continue
        kind, attrs = node.groups()
        if ("pipeline_end" if kind == "Send" else "pipeline_begin") in attrs and (chunk := _CHUNK.search(attrs)):
            counts[kind][chunk.group(1)] += 1
    return {kind: dict(sorted(by_chunk.items())) for kind, by_chunk in counts.items()}


def read_validate_ir(folder: Path) -> str:
    files = sorted(folder.rglob(f"*{IR_PASS}*.ir"))
    return files[-1].read_text() if files else ""


# ----------------------------------------------------------------------------------------------
# One rank's compile (inside the dry-run process)


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
    report = {"local_shapes": {p.name: list(p.shape) for p in params},
              # the compiled layout of each (device matrix, tensor map, full shape, optimizer-shard group):
              # what a restore slices full tensors by (models.weights)
              "layouts": {p.name: [list(held[p.name][0]), list(held[p.name][1]), list(held[p.name][6]),
                                   held[p.name][5]] for p in params}}
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
        text = read_validate_ir(ir_dir)
        graphs = parse_ir(text, rank)
        report["collectives"], report["groups"] = collectives_of(graphs)
        report["offload_copies"] = offload_copies(graphs)
        report.update(input_rows(text))
        report["ordered_micro_batches"] = ordered_micro_batches(text)
        report["pipeline_chunks"] = pipeline_chunks(text)
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
    report = {"compiled": False, "error": None, "rank": rt.rank, "stage": layout.stage_of_rank(rt.rank),
              "devices": layout.devices, "local_shapes": {}, "bytes": {}, "groups": {}, "collectives": [],
              "compile_s": None, "memory_pool_gib": _memory_pool_set(rt), "pipeline_config": _pipeline_config()}
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
    parser = argparse.ArgumentParser(description="Compile rank RANK_ID under MindSpore's dry run (see tools/dryrun.py).")
    add_config_arguments(parser)
    parser.add_argument("--packed", action="store_true", help="feed segment_ids as packed SFT data does")
    parser.add_argument("--run-step", action="store_true", help="at level 1: execute one step after the compile")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    ir_dir = os.environ.get("MS_DEV_SAVE_GRAPHS_PATH")
    try:
        report = compile_fn(cfg, args.packed, Path(ir_dir) if ir_dir else None,
                            **({"run_step": True} if args.run_step else {}))
    except ConfigError as exc:
        fail(str(exc))
    report["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
