"""Bottleneck analysis of what mindspore.profiler wrote, with the config knobs to try (tools/profile_report.py
prints it).

The root given is the run's profile/ folder, the `*_ascend_ms` folder inside it, or any parent: the
layout is detected in the folder or its subfolders. Every rank writes a folder of its own, named by
host, process id and time, not rank: the rank is read from the files (CPU: FRAMEWORK/cpu_op_type_info_<rank>.csv;
Ascend: profiler_info_<rank>.json), and the lowest rank is reported unless another is asked for.

- Ascend layout (ASCEND_PROFILER_OUTPUT/): step_trace_time.csv gives each step's Computing,
  Communication(Not Overlapped) and Free time in microseconds (they add up to the step);
  kernel_details.csv the kernels (Type, Accelerator Core, Duration(us)); communication.json the
  collectives per step (Communication Time Info: Elapse/Transit/Wait Time(ms)).
- CPU layout (FRAMEWORK/cpu_op_type_info_*.csv + ASCEND_PROFILER_OUTPUT/trace_view.json): the
  per-type totals give the top operators; the "CPU OP" timeline of trace_view.json is cut into
  steps (each graph node runs once per step; step k starts at the earliest k-th occurrence) and
  every step window is split into computation (union of op intervals), communication not
  overlapped (collective ops outside computation) and free time (the rest: host, Python, data).

`steps` says how many steps the profile spans when the profile cannot tell (an Ascend
step_trace_time.csv with one aggregate row, or a CPU trace whose ops do not repeat regularly).

The knobs each finding names are filtered by the device the profile ran on (its layout) and, when
known, the run's config (the config.yaml of the run folder holding profile/, or one given): a key
already set the way a knob says, or a parallel style that device or layout does not have, is not
advised.
"""

from __future__ import annotations

import collections
import csv
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from mindscale.config import Config, ConfigError, Layout, UserError, load_config

# Diagnosis thresholds, as shares of the step time.
COMPUTE_BOUND_BELOW = 0.30  # compute < 30% of the step: likely communication-bound
COMM_EXPOSED_ABOVE = 0.20  # communication not overlapped by computation
FREE_ABOVE = 0.15  # device idle: host-bound, data pipeline, no sink
BUBBLE_ABOVE = 0.10  # pipeline bubble (Ascend step_trace_time "Bubble")
WAIT_RATIO_ABOVE = 0.5  # collectives mostly waiting for other ranks
LAYOUT_OPS_ABOVE = 0.20  # slicing/transposes/casts share of op time (CPU rule)
OPTIMIZER_OPS_ABOVE = 0.20  # optimizer update share of op time

# "broadcast" the collective, not BroadcastTo (an elementwise copy)
COMM_PATTERN = re.compile(
    r"allreduce|allgather|reducescatter|broadcast(?!to)|alltoall|send|receive|recv|hcom_|hccl", re.IGNORECASE
)
LAYOUT_OPS = {
    "StridedSlice",
    "StridedSliceGrad",
    "Slice",
    "SliceGrad",
    "Transpose",
    "Cast",
    "Concat",
    "Split",
    "Gather",
    "GatherD",
    "BroadcastTo",
    "Tile",
    "OneHot",
    "ScatterNd",
    "TensorScatterUpdate",
    "ExpandDims",
    "TransData",
}
OPTIMIZER_PATTERN = re.compile(r"adam|lamb|momentum|assign|applyrms", re.IGNORECASE)


class ProfileError(UserError):
    """A folder that is not a readable profile. One line: what, where, the fix."""


@dataclass
class Split:
    """Mean time per step, milliseconds."""

    step_ms: float
    computing_ms: float
    communication_not_overlapped_ms: float
    free_ms: float
    communication_ms: float | None = None
    bubble_ms: float | None = None
    steps_analysed: int = 0

    def share(self, value: float | None) -> float | None:
        return None if value is None or not self.step_ms else value / self.step_ms


SHARE_KEYS = ("computing_ms", "communication_not_overlapped_ms", "free_ms", "bubble_ms")


@dataclass
class Report:
    layout: str
    path: str
    steps: int
    split: Split
    top_ops: list[dict]
    communication: list[dict]
    diagnosis: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rank: int | None = None  # the rank whose files these are; None: the profile does not say
    ranks: list[int] = field(default_factory=list)  # every rank profiled under the root
    per_rank: list[dict] | None = None  # every rank's split, when asked for (`all_ranks`)
    config: str | None = None  # the config the advice was filtered by

    def to_dict(self) -> dict:
        data = asdict(self)
        data["split"]["shares"] = {key: self.split.share(getattr(self.split, key)) for key in SHARE_KEYS}
        return data


# ----------------------------------------------------------------------------------------------
# Layout detection


@dataclass(frozen=True)
class Folder:
    """One rank's profile: the folder mindspore.profiler wrote (`*_ascend_ms`) and the rank it names."""

    layout: str
    path: Path
    rank: int | None

    @property
    def rank_name(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else "rank unknown"


RANK_FILES = {
    "cpu": ("FRAMEWORK", re.compile(r"cpu_op_type_info_(\d+)\.csv")),
    "ascend": (".", re.compile(r"profiler_info_(\d+)\.json")),
}


def rank_of(layout: str, folder: Path) -> int | None:
    """The rank the profiler wrote into a file name of `folder`; None if it wrote none."""
    subfolder, pattern = RANK_FILES[layout]
    found = {int(m.group(1)) for p in (folder / subfolder).glob("*") if (m := pattern.fullmatch(p.name))}
    return found.pop() if len(found) == 1 else None


def find_profiles(root: Path) -> list[Folder]:
    """Every rank's profile under `root`, lowest rank first (unknown ranks last)."""
    if not root.is_dir():
        raise ProfileError(f"{root} is not a folder; pass the profile/ folder of a run")
    found: dict[Path, str] = {}
    for stt in root.rglob("step_trace_time.csv"):
        if stt.parent.name == "ASCEND_PROFILER_OUTPUT":
            found[stt.parent.parent] = "ascend"
    for info in root.rglob("cpu_op_type_info_*.csv"):
        if info.parent.name == "FRAMEWORK":
            found.setdefault(info.parent.parent, "cpu")
    if not found:
        raise ProfileError(
            f"{root} holds no profile: expected ASCEND_PROFILER_OUTPUT/step_trace_time.csv (Ascend) "
            "or FRAMEWORK/cpu_op_type_info_*.csv (CPU); pass the folder mindspore.profiler wrote"
        )
    folders = sorted(
        (Folder(layout, path, rank_of(layout, path)) for path, layout in found.items()),
        key=lambda f: (f.rank is None, f.rank or 0, str(f.path)),
    )
    known = [f.rank for f in folders if f.rank is not None]
    twice = sorted({r for r in known if known.count(r) > 1})
    if twice:
        shown = ", ".join(f.path.name for f in folders if f.rank == twice[0])
        raise ProfileError(
            f"{root} holds {known.count(twice[0])} profiles of rank {twice[0]} ({shown}): several runs "
            "profiled into one folder; pass the folder of one run's profile"
        )
    return folders


def pick(folders: list[Folder], rank: int | None, root: Path) -> Folder:
    """The folder of `rank`, or without one the first (the lowest rank)."""
    if rank is None:
        return folders[0]
    chosen = [f for f in folders if f.rank == rank]
    if not chosen:
        ranks = ", ".join(str(f.rank) for f in folders if f.rank is not None) or "none named"
        raise ProfileError(f"--rank {rank}: {root} holds profiles of rank(s) {ranks}; pick one of them")
    return chosen[0]


def read_csv(path: Path, required: tuple[str, ...]) -> list[dict]:
    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
            header = reader.fieldnames or []
    except OSError as exc:
        raise ProfileError(f"cannot read {path} ({exc.strerror}); check the profile folder")
    missing = [c for c in required if c not in header]
    if missing:
        raise ProfileError(f"{path} lacks column(s) {', '.join(missing)}; not a MindSpore profiler file")
    if not rows:
        raise ProfileError(f"{path} has no rows; profile more steps (profile.start_step/stop_step)")
    return rows


def number(value, where: Path) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {value!r} is not a number; the file is corrupt")


def is_communication(op_type: str) -> bool:
    return bool(COMM_PATTERN.search(op_type))


def rank_ops(
    totals_ms: dict[str, float], calls: dict[str, float], steps: int, top: int, comm_types: set[str]
) -> list[dict]:
    """The `top` op types by total time, with time per step and share of all op time."""
    grand = sum(totals_ms.values()) or 1.0
    ranked = sorted(totals_ms.items(), key=lambda kv: -kv[1])[:top]
    return [
        {
            "type": t,
            "ms_per_step": ms / steps,
            "share": ms / grand,
            "calls_per_step": calls[t] / steps,
            "communication": t in comm_types,
        }
        for t, ms in ranked
    ]


# ----------------------------------------------------------------------------------------------
# Interval arithmetic (microseconds)


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(merged: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(intervals: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    return [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]


# ----------------------------------------------------------------------------------------------
# CPU layout


def op_type_of(full_name: str) -> str:
    """'Default/network/.../MatMul-op3' -> 'MatMul'."""
    return re.sub(r"-op\d+$", "", full_name.rsplit("/", 1)[-1])


def cpu_ops_from_trace(path: Path) -> list[tuple[str, float, float]]:
    """(full op name, start us, end us) of the "CPU OP" process of trace_view.json."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path} is missing; the CPU profile is incomplete (let the profiler finish parsing)")
    except json.JSONDecodeError:
        raise ProfileError(f"{path} is not JSON; the profile was cut off, profile again")
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    cpu_pids = {
        e.get("pid")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and (e.get("args") or {}).get("name") == "CPU OP"
    }
    ops = [
        (e["name"], number(e["ts"], path), number(e["dur"], path))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in cpu_pids
    ]
    if not ops:
        raise ProfileError(f"{path} has no 'CPU OP' events; profile with ProfilerActivity.CPU")
    return [(name, ts, ts + dur) for name, ts, dur in ops]


def step_starts(ops: list[tuple[str, float, float]], steps: int) -> list[float]:
    """Start of each step: the earliest k-th occurrence among ops that ran exactly `steps` times."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, start, _ in ops:
        by_name[name].append(start)
    regular = [sorted(starts) for starts in by_name.values() if len(starts) == steps]
    if not regular:
        return []
    return [min(starts[k] for starts in regular) for k in range(steps)]


def cpu_split(ops: list[tuple[str, float, float]], steps: int, notes: list[str]) -> Split:
    compute = merge([(s, e) for name, s, e in ops if not is_communication(op_type_of(name))])
    comm = merge([(s, e) for name, s, e in ops if is_communication(op_type_of(name))])
    starts = step_starts(ops, steps)
    if len(starts) >= 2:
        windows = list(zip(starts, starts[1:]))
        notes.append(
            f"{len(windows)} complete step windows between {steps} step starts (the last step's end "
            "is not marked, so it is left out)"
        )
    else:
        first, last = min(s for _, s, _ in ops), max(e for _, _, e in ops)
        windows = [(first + k * (last - first) / steps, first + (k + 1) * (last - first) / steps) for k in range(steps)]
        notes.append(
            "no op repeats once per step: the span from the first to the last op is divided evenly "
            f"into {steps} step(s); idle time after the last op is not seen"
        )
    per_step = []
    for start, end in windows:
        c, m = clip(compute, start, end), clip(comm, start, end)
        busy_compute = length(c)
        exposed = length(m) - overlap(m, c)
        per_step.append((end - start, busy_compute, exposed, length(m)))
    mean = [statistics.mean(values) / 1000 for values in zip(*per_step)]
    step_ms, compute_ms, exposed_ms, comm_ms = mean
    return Split(
        step_ms,
        compute_ms,
        exposed_ms,
        max(0.0, step_ms - compute_ms - exposed_ms),
        communication_ms=comm_ms,
        steps_analysed=len(windows),
    )


def cpu_report(folder: Path, steps_arg: int | None, top: int) -> Report:
    notes: list[str] = []
    ops = cpu_ops_from_trace(folder / "ASCEND_PROFILER_OUTPUT" / "trace_view.json")
    counts = collections.Counter(name for name, _, _ in ops)
    steps = steps_arg or collections.Counter(counts.values()).most_common(1)[0][0]
    split = cpu_split(ops, steps, notes)
    totals: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, float] = collections.defaultdict(float)
    for info in sorted((folder / "FRAMEWORK").glob("cpu_op_type_info_*.csv")):
        for r in read_csv(info, ("op_type", "type_occurrences", "total_compute_time")):
            totals[r["op_type"]] += number(r["total_compute_time"], info)
            calls[r["op_type"]] += number(r["type_occurrences"], info)
    comm_types = sorted({op_type_of(n) for n in counts if is_communication(op_type_of(n))})
    communication = [
        {
            "type": t,
            "calls_per_step": sum(c for n, c in counts.items() if op_type_of(n) == t) / steps,
            "ms_per_step": totals.get(t, 0.0) / steps,
        }
        for t in comm_types
    ]
    comm = {t for t in totals if is_communication(t)}
    return Report(
        "cpu", str(folder), steps, split, rank_ops(totals, calls, steps, top, comm), communication, notes=notes
    )


# ----------------------------------------------------------------------------------------------
# Ascend layout

STEP_COLUMNS = ("Step", "Computing", "Communication(Not Overlapped)", "Free")  # MindSpore StepTraceTimeHeaders


def ascend_split(path: Path, steps_arg: int | None, notes: list[str]) -> tuple[Split, int]:
    """Mean per-step split from step_trace_time.csv (microseconds; Computing + Communication(Not
    Overlapped) + Free = the step). One row without step markers covers the whole window."""
    rows = read_csv(path, STEP_COLUMNS)

    def mean(column: str) -> float | None:
        values = [number(r[column], path) for r in rows if (r.get(column) or "").strip()]
        return statistics.mean(values) / 1000 if values else None

    divide = 1
    if len(rows) == 1 and steps_arg and steps_arg > 1:
        divide = steps_arg
        notes.append(f"step_trace_time.csv has one row for the whole window; divided by --steps {steps_arg}")
    parts = [mean(column) for column in STEP_COLUMNS[1:]]
    if None in parts:
        raise ProfileError(f"{path} has empty {', '.join(STEP_COLUMNS[1:])} values; the profile is incomplete")
    compute, exposed, free = (p / divide for p in parts)
    comm, bubble = mean("Communication"), mean("Bubble")
    split = Split(
        compute + exposed + free,
        compute,
        exposed,
        free,
        communication_ms=comm / divide if comm is not None else None,
        bubble_ms=bubble / divide if bubble is not None else None,
        steps_analysed=len(rows),
    )
    return split, len(rows) * divide


def ascend_kernels(path: Path, steps: int, top: int) -> list[dict]:
    """Top kernel types of kernel_details.csv; HCCL kernels count as communication."""
    if not path.is_file():
        return []
    rows = read_csv(path, ("Type", "Duration(us)"))
    totals: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, float] = collections.defaultdict(float)
    comm: set[str] = set()
    for r in rows:
        totals[r["Type"]] += number(r["Duration(us)"], path) / 1000
        calls[r["Type"]] += 1
        if r.get("Accelerator Core") == "HCCL" or is_communication(r["Type"]):
            comm.add(r["Type"])
    return rank_ops(totals, calls, steps, top, comm)


def ascend_communication(path: Path) -> list[dict]:
    """Collectives by kind from communication.json, per profiled step."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ProfileError(f"{path} is not JSON; the profile was cut off, profile again")
    if not isinstance(data, dict) or not data:
        raise ProfileError(f"{path} has no steps; not a MindSpore communication.json")
    kinds: dict[str, dict] = {}
    for step in data.values():
        for group in ("collective", "p2p"):
            for name, info in (step.get(group) or {}).items():
                if name == "Total Op Info" or "Communication Time Info" not in info:
                    continue
                match = COMM_PATTERN.search(name.split("@")[0].replace("_", ""))
                kind = match.group(0).lower() if match else name
                t = info["Communication Time Info"]
                k = kinds.setdefault(
                    kind, {"type": kind, "calls": 0, "elapse_ms": 0.0, "transit_ms": 0.0, "wait_ms": 0.0}
                )
                k["calls"] += 1
                for key, col in (
                    ("elapse_ms", "Elapse Time(ms)"),
                    ("transit_ms", "Transit Time(ms)"),
                    ("wait_ms", "Wait Time(ms)"),
                ):
                    k[key] += number(t.get(col, 0.0), path)
    steps = len(data)
    out = []
    for k in sorted(kinds.values(), key=lambda k: -k["elapse_ms"]):
        out.append(
            {
                "type": k["type"],
                "calls_per_step": k["calls"] / steps,
                "ms_per_step": k["elapse_ms"] / steps,
                "transit_ms_per_step": k["transit_ms"] / steps,
                "wait_ms_per_step": k["wait_ms"] / steps,
                "wait_ratio": k["wait_ms"] / k["elapse_ms"] if k["elapse_ms"] else 0.0,
            }
        )
    return out


def ascend_report(folder: Path, steps_arg: int | None, top: int) -> Report:
    notes: list[str] = []
    out = folder / "ASCEND_PROFILER_OUTPUT"
    split, steps = ascend_split(out / "step_trace_time.csv", steps_arg, notes)
    kernels = ascend_kernels(out / "kernel_details.csv", steps, top)
    if not kernels:
        notes.append("no kernel_details.csv: top operators unavailable (profile with ProfilerActivity.NPU)")
    return Report(
        "ascend", str(folder), steps, split, kernels, ascend_communication(out / "communication.json"), notes=notes
    )


# ----------------------------------------------------------------------------------------------
# Diagnosis


DEVICES = {"cpu": "CPU", "ascend": "Ascend"}  # the device a profile layout comes from
SHARDED_DEVICES = ("Ascend", "GPU")  # MindSpore has no semi-auto parallel on CPU: no tp, sp, pp or optimizer shard


@dataclass(frozen=True)
class Knob:
    """A change to try, named only where it applies: on `devices` (None: any) and where `applies(cfg)` holds
    for the run's config (None: any config). Without a config, only the device decides."""

    text: str
    devices: tuple[str, ...] | None = None
    applies: Callable[[Config], bool] | None = None

    def advised(self, device: str, cfg: Config | None) -> bool:
        if self.devices is not None and device not in self.devices:
            return False
        return cfg is None or self.applies is None or self.applies(cfg)


def _data_parallel(cfg: Config) -> bool:
    return cfg.parallel.data_parallel > 1


def _tensor_parallel(cfg: Config) -> bool:
    return cfg.parallel.model_parallel > 1


def _pipeline(cfg: Config) -> bool:
    return cfg.parallel.pipeline_stage > 1


def _flash_left_out(cfg: Config) -> bool:
    return cfg.hardware.flash_attention and Layout.of(cfg, "Ascend").attention != "flash"


LARGER_BATCH = Knob("train.micro_batch_size: larger (more compute per collective)")
MORE_ACCUMULATION = Knob(
    "parallel.gradient_accumulation_steps: larger (one gradient all-reduce per several micro steps)",
    applies=_data_parallel,
)
BALANCE_STAGES = Knob("parallel.stage_offset: balance layers between pipeline stages", applies=_pipeline)
MORE_MICRO_BATCHES = Knob(
    "parallel.micro_batch_num: larger (bubble ~ (p-1)/(m+p-1), shorter waits at stage boundaries)", applies=_pipeline
)
SHARD_OPTIMIZER = Knob(
    "parallel.optimizer_shard: true (each data-parallel rank updates a shard, and holds less for a larger batch)",
    SHARDED_DEVICES,
    lambda c: _data_parallel(c) and not c.parallel.optimizer_shard,
)

# finding -> the knobs it names (diagnose decides which findings fire)
KNOBS = {
    "communication-bound": [
        LARGER_BATCH,
        Knob(
            "parallel.model_parallel: smaller, with parallel.data_parallel larger (fewer per-layer collectives)",
            SHARDED_DEVICES,
            _tensor_parallel,
        ),
        MORE_ACCUMULATION,
        Knob(
            "parallel.pipeline_stage: >1 across nodes instead of model_parallel over slow links",
            SHARDED_DEVICES,
            _tensor_parallel,
        ),
        Knob(
            "communication fusion / overlap: no config key yet (set_auto_parallel_context comm_fusion)",
            applies=lambda c: c.devices > 1,
        ),
    ],
    "exposed communication": [
        Knob(
            "parallel.sequence_parallel: true (with model_parallel > 1) turns all-reduces into "
            "reduce-scatter/all-gather pairs",
            SHARDED_DEVICES,
            lambda c: _tensor_parallel(c) and not c.parallel.sequence_parallel,
        ),
        Knob(
            "parallel.optimizer_shard: false removes the weight all-gathers (more memory per rank)",
            SHARDED_DEVICES,
            lambda c: c.parallel.optimizer_shard,
        ),
        MORE_ACCUMULATION,
        Knob(
            "recompute.comm: false (do not repeat tensor-parallel communication in the backward)",
            SHARDED_DEVICES,
            lambda c: c.recompute.comm,
        ),
    ],
    "idle": [
        Knob("run.mode: graph (pynative launches op by op)", applies=lambda c: c.run.mode != "graph"),
        Knob("context.jit_level: O2 (whole-graph sink)", ("Ascend",), lambda c: c.context.get("jit_level") != "O2"),
        Knob("tools/report.py's Data section: the time each step waited for its batch (metrics.jsonl's data_wait_s)"),
        Knob("dataset sink mode and data workers: no config key yet"),
        Knob("train.micro_batch_size: larger (more device work per host step)"),
    ],
    "bubble": [MORE_MICRO_BATCHES, BALANCE_STAGES],
    "waiting": [
        BALANCE_STAGES,
        MORE_MICRO_BATCHES,
        Knob("tools/profile_report.py --all-ranks: compare the ranks' splits for a slow device or host"),
    ],
    "data movement": [
        Knob(
            "context.enable_graph_kernel: true (fuses elementwise chains; CPU needs the decorator package)",
            applies=lambda c: not c.context.get("enable_graph_kernel"),
        ),
        Knob(
            "model.compute_dtype: float32 on CPU (no Cast pairs around every MatMul)",
            ("CPU",),
            lambda c: c.model.compute_dtype != "float32",
        ),
        Knob("model.attention: flash on Atlas A2 (no score transposes)", ("Ascend",), _flash_left_out),
    ],
    "optimizer": [
        Knob("train.micro_batch_size: larger (amortise the update over more tokens)"),
        Knob("parallel.gradient_accumulation_steps: larger (one update per several micro steps)"),
        SHARD_OPTIMIZER,
    ],
    "compute-bound": [Knob("the top operators are the place to optimise; compare MFU with tools/mfu.py")],
}


def diagnose(report: Report, cfg: Config | None = None) -> list[dict]:
    """The thresholds above as findings, each with the evidence and the knobs to try on this run's device
    (the profile's layout) and config (`cfg`; None: not filtered by a config)."""
    s = report.split
    compute, exposed, free, bubble = (
        s.share(v) for v in (s.computing_ms, s.communication_not_overlapped_ms, s.free_ms, s.bubble_ms)
    )
    device = DEVICES[report.layout]
    findings = []

    def add(finding: str, evidence: str, kind: str) -> None:
        knobs = [k.text for k in KNOBS[kind] if k.advised(device, cfg)]
        findings.append({"finding": finding, "evidence": evidence, "knobs": knobs})

    if compute < COMPUTE_BOUND_BELOW and exposed >= free:
        add(
            "likely communication-bound",
            f"computation is {compute:.0%} of the step (< {COMPUTE_BOUND_BELOW:.0%}), "
            f"exposed communication {exposed:.0%}",
            "communication-bound",
        )
    if exposed > COMM_EXPOSED_ABOVE:
        add(
            "communication not overlapped is large",
            f"{exposed:.0%} of the step waits on communication",
            "exposed communication",
        )
    if free > FREE_ABOVE:
        add(
            "device idle (free) time is long: host-bound, data pipeline or no sink mode",
            f"{free:.0%} of the step neither computes nor communicates",
            "idle",
        )
    if bubble is not None and bubble > BUBBLE_ABOVE:
        add("pipeline bubble is large", f"bubble is {bubble:.0%} of the step", "bubble")
    waiting = [c for c in report.communication if c.get("wait_ratio", 0) > WAIT_RATIO_ABOVE]
    if waiting:
        names = ", ".join(f"{c['type']} {c['wait_ratio']:.0%}" for c in waiting)
        add(
            "collectives mostly wait for other ranks (load imbalance or a slow rank)", f"wait share: {names}", "waiting"
        )
    ops = [o for o in report.top_ops if not o["communication"]]
    layout = sum(o["share"] for o in ops if o["type"] in LAYOUT_OPS)
    if layout > LAYOUT_OPS_ABOVE:
        shown = ", ".join(f"{o['type']} {o['share']:.0%}" for o in ops if o["type"] in LAYOUT_OPS)
        add(
            "data-movement ops (slices, transposes, casts) take much of the op time: change the model graph",
            f"{layout:.0%} of op time: {shown}",
            "data movement",
        )
    optimizer = sum(o["share"] for o in ops if OPTIMIZER_PATTERN.search(o["type"]))
    if optimizer > OPTIMIZER_OPS_ABOVE:
        add(
            "the optimizer update is a large part of the step",
            f"{optimizer:.0%} of op time in optimizer ops",
            "optimizer",
        )
    if not findings:
        add("compute-bound: no rule fired", f"computation is {compute:.0%} of the step", "compute-bound")
    return findings


def run_config(folder: Path, overrides: list[str]) -> tuple[Config | None, Path | None]:
    """The config of the run whose profile/ holds `folder` (<run>/profile/<rank folder>), with `overrides`;
    (None, None) when the profile is not inside a run folder."""
    path = folder.parent.parent / "config.yaml"
    if folder.parent.name != "profile" or not path.is_file():
        if overrides:
            raise ProfileError(f"--set needs a config: {folder} is not inside a run folder's profile/; add --config")
        return None, None
    try:
        return load_config(path, overrides), path
    except ConfigError as exc:
        raise ProfileError(f"{path}: {exc}; pass --config to filter the advice by another config")


def report_of(folder: Folder, steps: int | None, top: int) -> Report:
    report = (ascend_report if folder.layout == "ascend" else cpu_report)(folder.path, steps, top)
    report.rank = folder.rank
    return report


def rank_split(report: Report) -> dict:
    """One rank's split per step and its shares, for the --all-ranks table."""
    s = report.split
    return {
        "rank": report.rank,
        "path": report.path,
        "steps_analysed": s.steps_analysed,
        "step_ms": s.step_ms,
        **{key: getattr(s, key) for key in SHARE_KEYS},
        "shares": {key: s.share(getattr(s, key)) for key in SHARE_KEYS},
    }


def analyse(
    root: Path,
    steps: int | None = None,
    top: int = 15,
    rank: int | None = None,
    all_ranks: bool = False,
    cfg: Config | None = None,
    config_source: str | None = None,
    overrides: list[str] = (),
) -> Report:
    """The report of one rank's profile under `root` (`rank`, default the lowest), with every rank's split
    when `all_ranks`; its advice filtered by `cfg` (default: the run folder's config.yaml with `overrides`)."""
    if steps is not None and steps < 1:
        raise ProfileError(f"--steps {steps}: must be >= 1")
    folders = find_profiles(root)
    chosen = pick(folders, rank, root)
    report = report_of(chosen, steps, top)
    report.ranks = [f.rank for f in folders if f.rank is not None]
    others = [f for f in folders if f is not chosen]
    if all_ranks:
        report.per_rank = [rank_split(report if f is chosen else report_of(f, steps, top)) for f in folders]
    elif others:
        report.notes.append(
            f"{len(others)} more rank(s) profiled under {root}: "
            + ", ".join(f"{f.rank_name} ({f.path.name})" for f in others)
            + "; --rank R reads one, --all-ranks shows every rank's split"
        )
    if cfg is None:
        cfg, path = run_config(chosen.path, list(overrides))
        config_source = str(path) if path else None
    report.config = config_source
    device = DEVICES[report.layout]
    report.notes.append(
        f"advice for a {device} run, filtered by {config_source or 'the config given'}"
        if cfg is not None
        else f"advice for a {device} run; no run config found beside the profile (not inside "
        "<run>/profile/): pass --config to leave out the keys already set"
    )
    report.diagnosis = diagnose(report, cfg)
    return report


def rank_text(report: Report) -> str:
    """'rank 0 of ranks 0, 1' (which rank's files the report reads)."""
    if report.rank is None:
        return "rank unknown: the profile names none"
    return f"rank {report.rank} of ranks {', '.join(map(str, report.ranks))}"


def per_rank_lines(per_rank: list[dict]) -> list[str]:
    lines = [
        "every rank, ms per step (share of its step):",
        f"  {'rank':>7} {'step':>10} {'computation':>18} {'comm not overlapped':>20} {'free (idle)':>18}",
    ]
    for r in per_rank:
        parts = [f"{r[key]:>10.3f} {r['shares'][key]:>6.1%}" for key in SHARE_KEYS[:3]]
        rank = str(r["rank"]) if r["rank"] is not None else "?"
        lines.append(f"  {rank:>7} {r['step_ms']:>10.3f} {parts[0]:>18} {parts[1]:>20} {parts[2]:>18}")
    return lines


def text(report: Report) -> str:
    s = report.split
    lines = [
        f"profile: {report.path} ({rank_text(report)}; {report.layout} layout, {report.steps} step(s) "
        f"profiled, {s.steps_analysed} analysed)",
        f"time per step: {s.step_ms:.3f} ms",
    ]
    for label, value in (
        ("computation", s.computing_ms),
        ("communication not overlapped", s.communication_not_overlapped_ms),
        ("free (idle)", s.free_ms),
    ):
        lines.append(f"  {label:<30} {value:>10.3f} ms {s.share(value):>6.1%}")
    if s.communication_ms is not None:
        lines.append(f"  {'(communication in total)':<30} {s.communication_ms:>10.3f} ms")
    if s.bubble_ms is not None:
        lines.append(f"  {'(pipeline bubble)':<30} {s.bubble_ms:>10.3f} ms {s.share(s.bubble_ms):>6.1%}")
    lines.append(f"top operators by total time ({len(report.top_ops)}):")
    lines.append(f"  {'type':<36} {'ms/step':>10} {'share':>7} {'calls/step':>10}")
    for o in report.top_ops:
        mark = "  [comm]" if o["communication"] else ""
        lines.append(
            f"  {o['type']:<36} {o['ms_per_step']:>10.3f} {o['share']:>7.1%} {o['calls_per_step']:>10.1f}{mark}"
        )
    if report.communication:
        lines.append("communication:")
        for c in report.communication:
            extra = f", wait {c['wait_ratio']:.0%}" if "wait_ratio" in c else ""
            lines.append(
                f"  {c['type']:<20} {c['calls_per_step']:.1f} calls/step, {c['ms_per_step']:.3f} ms/step{extra}"
            )
    if report.per_rank:
        lines += per_rank_lines(report.per_rank)
    lines.append(f"diagnosis (rank {report.rank}):" if report.rank is not None else "diagnosis:")
    for d in report.diagnosis:
        lines.append(f"- {d['finding']} ({d['evidence']})")
        lines += [f"    try {k}" for k in d["knobs"]] or ["    (no knob applies to this run's device and config)"]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
