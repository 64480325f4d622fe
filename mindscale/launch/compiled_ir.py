"""What a rank's compiled graph shows, read from MindSpore's IR text (the `validate` pass, saved by the dry run).

The dry run (mindscale.launch.dryrun_worker) saves each rank's IR files with MS_DEV_SAVE_GRAPHS; this module
reads the text, no MindSpore needed:
  parse_ir / collectives_of  the collectives per step: kind, purpose, group, count and bytes; and the groups
  offload_copies             activation offload's copies to host memory and back (MoveTo nodes)
  input_rows                 how the step's inputs reach the computation, and the loss's row groups
  ordered_micro_batches      the micro batches whose backward ends before the next one's forward
  pipeline_chunks            the forward Sends and Receives between stages, per model chunk
  describe_ir                all of the above for one rank, as its dry-run report holds them
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

IR_PASS = "validate"  # the last frontend IR: after the parallel passes, recompute and the optimizer shard
DTYPE_BYTES = {
    "Float32": 4,
    "Float16": 2,
    "BFloat16": 2,
    "Int32": 4,
    "Int64": 8,
    "Bool": 1,
    "UInt8": 1,
    "Int8": 1,
    "Float64": 8,
}
COLLECTIVES = (
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "AlltoAll",
    "AllToAll",
    "Broadcast",
    "Send",
    "Receive",
    "MicroStepAllGather",
    "MiniStepAllGather",
    "AllGatherV",
    "ReduceScatterV",
    "AlltoAllV",
    "Reduce",
)
# What a collective is for, from the instance name the parallel passes give it (the optimizer shard's: its weight
# all-gathers, and with gradient_accumulation_shard the gradient reduce-scatter into the sharded buffer every
# micro batch, `_grad_accumulation_shard_grad_VirtualAssignAdd`).
PURPOSES = (
    ("parallel_optimizer", "optimizer_shard"),
    ("grad_accumulation_shard", "optimizer_shard"),
    ("GLOBALNORM", "grad_norm"),
    ("mirror", "grad_reduce"),
    ("redistribution", "redistribution"),
)  # anything else: an operator's own communication
# Which tensor of a collective is "its bytes": the one each rank contributes (input), or for the ops that
# end with more than they start with, the result (AllGather, Receive).
OUTPUT_SIZED = ("AllGather", "Receive", "MicroStepAllGather", "MiniStepAllGather", "AllGatherV")


# ----------------------------------------------------------------------------------------------
# The compiled graph: collectives from the IR text


_GRAPH = re.compile(r"^subgraph @(\S+?)\(")
_NODE = re.compile(r"^\s+%\d+\(\S+\) = (.*)$")
_TENSOR = re.compile(r"Tensor\[(\w+)\]\]?, \(([\d, ]*)\)")  # Tensor[F32], (..) or Ref[Tensor[F32]], (..)
_REF = re.compile(r"@+([^\s(),\[\]@]+)")  # @g, or @@g (a graph called with a side-effect monad)
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
    or `%n[@Partial(@g)](..)` / `%n[@FuncUnion(@a, @b)](..)` (a backward closure, an `if`'s branches), or
    `%n[@@g](.., UMonad)` (a backward closure with side effects: the last pipeline stage's under 2D tensor
    parallel). Creating a Partial is not a call."""
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
        purpose = (
            "pipeline"
            if kind in ("Send", "Receive")
            else next((p for key, p in PURPOSES if key in instance), "operator")
        )
        types = lines[i + 1] if i + 1 < len(lines) else ""
        inputs, _, output = types.partition("->")
        current["collectives"].append((kind, purpose, ranks, _tensor_bytes(output if kind in OUTPUT_SIZED else inputs)))
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
    rows = [
        {"kind": kind, "purpose": purpose, "group_size": len(ranks), "ranks": list(ranks), "count": n, "bytes": size}
        for (kind, purpose, ranks), (n, size) in sorted(total.items())
        if n
    ]
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
            inputs[f"%{param.group(1)}"] = {
                "input": int(param.group(2)),
                "rows": int(param.group(3)),
                "global_rows": int(param.group(4)),
                "gathered_over": [],
                "micro": {},
            }
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
    return {
        "inputs": [
            {
                **{k: v for k, v in info.items() if k != "micro"},
                "micro_batches": [info["micro"][m] for m in sorted(info["micro"])],
            }
            for info in sorted(inputs.values(), key=lambda info: info["input"])
        ],
        "row_groups": sorted(list(group) for group in row_groups),
    }


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


def describe_ir(folder: Path, rank: int) -> dict:
    """What rank `rank`'s validate IR under `folder` shows: its collectives and their groups, offload copies,
    input rows and row groups, ordered micro batches and pipeline chunks (the keys of its dry-run report)."""
    text = read_validate_ir(folder)
    graphs = parse_ir(text, rank)
    report = {}
    report["collectives"], report["groups"] = collectives_of(graphs)
    report["offload_copies"] = offload_copies(graphs)
    report.update(input_rows(text))
    report["ordered_micro_batches"] = ordered_micro_batches(text)
    report["pipeline_chunks"] = pipeline_chunks(text)
    return report
