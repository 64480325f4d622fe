"""A rank's device memory as MindSpore plans it: the level-1 dry run (tools/dryrun.py --memory, docs/dryrun.md).

At MS_SIMULATION_LEVEL=1 MindSpore builds the rank's kernel graph as for an Ascend device and plans its memory
without one: with memory_optimize_level O1 its SOMAS pass gives every tensor of the step an offset in one block
and a lifetime in execution steps, and with MS_ALLOC_CONF=memory_tracker:True it writes that plan to
`rank_<R>/Ascend_somas_tensor_offset_<graph>.ir` (under MS_DEV_SAVE_GRAPHS_PATH when set, else the working
folder). Its two sections are what this module reads:

    All Parameters:    index, size, source node name, out index
    %5P  #1048576S  tok_embeddings.weight  0                       (weights, optimizer state, graph constants
                                                                    `Default/data-N`, the step's inputs)
    All Tensors:       index, aligned size, size, offset, type, lifelong, life start, life end, source node name
    %3T  #262656S  #262144S  &16786944  Common  LifeLongNone  9  422  Default/network-.../RmsNorm-op0

The persistent part (parameters, constants, inputs) plus the SOMAS block is what MindSpore allocates for the
step (`peak_bytes`, with the block's fragments; `used_bytes` counts only the tensors live at the block's busiest
step). Executed at level 1 (`--memory run`), the pool's peak (mindspore.runtime.max_memory_allocated) equals
`peak_bytes` up to each persistent block's alignment (tests/dryrun/test_memory.py). What it leaves out: kernel workspaces (0 at level 1: sized by CANN's kernels, which a level-2 run needs a device for),
HCCL's buffers and the driver's memory (outside MindSpore's pool: hardware.memory_gib - memory_pool_gib).

Activation offload (offload.layers) puts a `MoveTo(x, "CPU")` after each moved forward tensor and a
`MoveTo(.., "Ascend")` before its backward use. SOMAS gives the host copies (the first MoveTo's outputs) offsets in
its device block, live from the forward to the copy back, and MindSpore's runtime places them there at O1 (its actor
set marks them `is_somas_enable:1` with an offset): at O1 offload frees nothing. At O0, the trainer's default
(runtime.py), the runtime takes them from host memory and the pool's peak falls (docs/evidence/planner.md).
`host_copy_bytes` is what the plan's busiest step holds of them, `device_used_bytes` that step's persistent + block
use without them.
"""

from __future__ import annotations

import re
from pathlib import Path

SOMAS_FILE = "Ascend_somas_tensor_offset_*.ir"
_PARAMETER = re.compile(r"^%\d+P\t#(\d+)S\t(\S+)", re.M)
_TENSOR = re.compile(r"^%\d+T\t#(\d+)S\t#\d+S\t&(\d+)\t\w+\t\w+\t(\d+)\t(\d+)\t(\S+)", re.M)
CONSTANT = "Default/data-"  # a graph constant's parameter name in the plan
TOP = 8  # tensors listed at the peak
MOVE_TO = "/MoveTo-op"  # in a SOMAS tensor's node name: activation offload's copies (Cell.offload)


def _peak_step(tensors: list[tuple]) -> tuple[int, int]:
    """(step, bytes): the execution step at which most of the SOMAS block is in use. Tensors at one offset and
    size whose lifetimes meet are one range (an in-place op's output shares its input's)."""
    ranges: dict[tuple, list[list[int]]] = {}
    for size, off, first, last, _ in sorted(tensors, key=lambda t: t[2]):
        lives = ranges.setdefault((off, size), [])
        if lives and first <= lives[-1][1] + 1:
            lives[-1][1] = max(lives[-1][1], last)
        else:
            lives.append([first, last])
    events = sorted(
        (step, change)
        for (_, size), lives in ranges.items()
        for first, last in lives
        for step, change in ((first, size), (last + 1, -size))
    )
    best, used = (0, 0), 0
    for i, (step, change) in enumerate(events):
        used += change
        if (i + 1 == len(events) or events[i + 1][0] != step) and used > best[1]:
            best = (step, used)
    return best


def host_copies(tensors: list[tuple]) -> list[tuple]:
    """Activation offload's copies in host memory: the MoveTo outputs whose last reader is another MoveTo (the copy
    back, which starts at the step their life ends). The copies back, read by the backward, are not."""
    moves = [t for t in tensors if MOVE_TO in t[4]]
    starts = {t[2] for t in moves}
    return [t for t in moves if t[3] in starts]


def parse_plan(text: str) -> dict:
    """One graph's plan: persistent bytes (parameters and the step's inputs; constants among them), the SOMAS
    block's size, the step at which most of it is in use, the largest tensors live then, and the same without
    activation offload's host copies (module docstring)."""
    head, _, body = text.partition("All Tensors:")
    params = [(int(size), name) for size, name in _PARAMETER.findall(head)]
    tensors = [
        (int(size), int(off), int(first), int(last), name) for size, off, first, last, name in _TENSOR.findall(body)
    ]
    peak_step, used = _peak_step(tensors)
    live = sorted((t for t in tensors if t[2] <= peak_step <= t[3]), key=lambda t: -t[0])
    host = host_copies(tensors)
    moved = set(host)
    on_device = _peak_step([t for t in tensors if t not in moved])[1] if host else used
    return {
        "persistent_bytes": sum(size for size, _ in params),
        "constant_bytes": sum(size for size, name in params if name.startswith(CONSTANT)),
        "somas_bytes": max((off + size for size, off, *_ in tensors), default=0),
        "peak_step": peak_step,
        "somas_used_at_peak_bytes": used,
        "host_copy_bytes": sum(t[0] for t in host if t[2] <= peak_step <= t[3]),
        "somas_used_on_device_bytes": on_device,
        "top_tensors": [
            {"node": name, "bytes": size, "life": [first, last]} for size, _, first, last, name in live[:TOP]
        ],
        "largest_persistent": [{"name": name, "bytes": size} for size, name in sorted(params, reverse=True)[:TOP]],
    }


def plan_files(folders: list[Path], rank: int) -> list[Path]:
    for folder in folders:
        found = sorted((folder / f"rank_{rank}").glob(SOMAS_FILE))
        if found:
            return found
    return []


def device_memory(folders: list[Path], rank: int) -> dict | None:
    """The rank's plan from its SOMAS files (the first of `folders` holding any), or None when MindSpore wrote
    none. Several kernel graphs: the persistent parts add up, the largest SOMAS block counts (one graph's
    block is in use at a time)."""
    files = plan_files(folders, rank)
    if not files:
        return None
    graphs = [parse_plan(f.read_text()) for f in files]
    peak = max(graphs, key=lambda g: g["somas_bytes"])
    persistent = sum(g["persistent_bytes"] for g in graphs)
    return {
        "source": "MindSpore SOMAS plan, level-1 dry run",
        "graphs": len(graphs),
        "persistent_bytes": persistent,
        "constant_bytes": sum(g["constant_bytes"] for g in graphs),
        "somas_bytes": peak["somas_bytes"],
        "somas_used_bytes": peak["somas_used_at_peak_bytes"],
        "used_bytes": persistent + peak["somas_used_at_peak_bytes"],
        "peak_bytes": persistent + peak["somas_bytes"],
        "host_copy_bytes": peak["host_copy_bytes"],
        "device_used_bytes": persistent + peak["somas_used_on_device_bytes"],
        "top_tensors": peak["top_tensors"],
        "largest_persistent": sorted((p for g in graphs for p in g["largest_persistent"]), key=lambda p: -p["bytes"])[
            :TOP
        ],
    }


def reserve(cfg) -> dict:
    """What the plan leaves out, stated: the device memory outside MindSpore's pool (HCCL buffers, the driver,
    the runtime: hardware.memory_gib - memory_pool_gib), and kernel workspaces, which live inside the pool and
    level 1 does not size; `headroom_bytes` is what the pool leaves them."""
    hw = cfg.hardware
    gib = 2**30
    return {
        "outside_pool_bytes": (hw.memory_gib - hw.memory_pool_gib) * gib,
        "pool_bytes": hw.memory_pool_gib * gib,
        "not_counted": "kernel workspaces (0 at level 1), HCCL buffers, driver memory",
    }
