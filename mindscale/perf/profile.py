"""Bottleneck analysis of what mindspore.profiler wrote, with the config knobs to try (tools/profile_report.py
prints it).

The root given is the run's profile/ folder, the `*_ascend_ms` folder inside it, or any parent: the
layout is detected in the folder or its subfolders.

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
"""
from __future__ import annotations

import collections
import csv
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mindscale.config import UserError

# Diagnosis thresholds, as shares of the step time.
COMPUTE_BOUND_BELOW = 0.30      # compute < 30% of the step: likely communication-bound
COMM_EXPOSED_ABOVE = 0.20       # communication not overlapped by computation
FREE_ABOVE = 0.15               # device idle: host-bound, data pipeline, no sink
BUBBLE_ABOVE = 0.10             # pipeline bubble (Ascend step_trace_time "Bubble")
WAIT_RATIO_ABOVE = 0.5          # collectives mostly waiting for other ranks
LAYOUT_OPS_ABOVE = 0.20         # slicing/transposes/casts share of op time (CPU rule)
OPTIMIZER_OPS_ABOVE = 0.20      # optimizer update share of op time

# "broadcast" the collective, not BroadcastTo (an elementwise copy)
COMM_PATTERN = re.compile(r"allreduce|allgather|reducescatter|broadcast(?!to)|alltoall|send|receive|recv|hcom_|hccl",
                          re.IGNORECASE)
LAYOUT_OPS = {"StridedSlice", "StridedSliceGrad", "Slice", "SliceGrad", "Transpose", "Cast", "Concat", "Split",
              "Gather", "GatherD", "BroadcastTo", "Tile", "OneHot", "ScatterNd", "TensorScatterUpdate",
              "ExpandDims", "TransData"}
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

    def to_dict(self) -> dict:
        data = asdict(self)
        data["split"]["shares"] = {key: self.split.share(getattr(self.split, key)) for key in
                                   ("computing_ms", "communication_not_overlapped_ms", "free_ms", "bubble_ms")}
        return data


# ----------------------------------------------------------------------------------------------
# Layout detection


def find_profile(root: Path) -> tuple[str, Path, list[Path]]:
    """(layout, profile folder, other profile folders) for the first profile under `root`."""
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
        raise ProfileError(f"{root} holds no profile: expected ASCEND_PROFILER_OUTPUT/step_trace_time.csv (Ascend) "
                           "or FRAMEWORK/cpu_op_type_info_*.csv (CPU); pass the folder mindspore.profiler wrote")
    folders = sorted(found)
    return found[folders[0]], folders[0], folders[1:]


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


def rank_ops(totals_ms: dict[str, float], calls: dict[str, float], steps: int, top: int,
             comm_types: set[str]) -> list[dict]:
    """The `top` op types by total time, with time per step and share of all op time."""
    grand = sum(totals_ms.values()) or 1.0
    ranked = sorted(totals_ms.items(), key=lambda kv: -kv[1])[:top]
    return [{"type": t, "ms_per_step": ms / steps, "share": ms / grand, "calls_per_step": calls[t] / steps,
             "communication": t in comm_types} for t, ms in ranked]


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
    cpu_pids = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and (e.get("args") or {}).get("name") == "CPU OP"}
    ops = [(e["name"], number(e["ts"], path), number(e["dur"], path)) for e in events
           if e.get("ph") == "X" and e.get("pid") in cpu_pids]
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
        notes.append(f"{len(windows)} complete step windows between {steps} step starts (the last step's end "
                     "is not marked, so it is left out)")
    else:
        first, last = min(s for _, s, _ in ops), max(e for _, _, e in ops)
        windows = [(first + k * (last - first) / steps, first + (k + 1) * (last - first) / steps)
                   for k in range(steps)]
        notes.append("no op repeats once per step: the span from the first to the last op is divided evenly "
                     f"into {steps} step(s); idle time after the last op is not seen")
    per_step = []
    for start, end in windows:
        c, m = clip(compute, start, end), clip(comm, start, end)
        busy_compute = length(c)
        exposed = length(m) - overlap(m, c)
        per_step.append((end - start, busy_compute, exposed, length(m)))
    mean = [statistics.mean(values) / 1000 for values in zip(*per_step)]
    step_ms, compute_ms, exposed_ms, comm_ms = mean
    return Split(step_ms, compute_ms, exposed_ms, max(0.0, step_ms - compute_ms - exposed_ms),
                 communication_ms=comm_ms, steps_analysed=len(windows))


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
    communication = [{"type": t, "calls_per_step": sum(c for n, c in counts.items() if op_type_of(n) == t) / steps,
                      "ms_per_step": totals.get(t, 0.0) / steps} for t in comm_types]
    comm = {t for t in totals if is_communication(t)}
    return Report("cpu", str(folder), steps, split, rank_ops(totals, calls, steps, top, comm), communication,
                  notes=notes)


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
    split = Split(compute + exposed + free, compute, exposed, free,
                  communication_ms=comm / divide if comm is not None else None,
                  bubble_ms=bubble / divide if bubble is not None else None, steps_analysed=len(rows))
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
                k = kinds.setdefault(kind, {"type": kind, "calls": 0, "elapse_ms": 0.0, "transit_ms": 0.0,
                                            "wait_ms": 0.0})
                k["calls"] += 1
                for key, col in (("elapse_ms", "Elapse Time(ms)"), ("transit_ms", "Transit Time(ms)"),
                                 ("wait_ms", "Wait Time(ms)")):
                    k[key] += number(t.get(col, 0.0), path)
    steps = len(data)
    out = []
    for k in sorted(kinds.values(), key=lambda k: -k["elapse_ms"]):
        out.append({"type": k["type"], "calls_per_step": k["calls"] / steps, "ms_per_step": k["elapse_ms"] / steps,
                    "transit_ms_per_step": k["transit_ms"] / steps, "wait_ms_per_step": k["wait_ms"] / steps,
                    "wait_ratio": k["wait_ms"] / k["elapse_ms"] if k["elapse_ms"] else 0.0})
    return out


def ascend_report(folder: Path, steps_arg: int | None, top: int) -> Report:
    notes: list[str] = []
    out = folder / "ASCEND_PROFILER_OUTPUT"
    split, steps = ascend_split(out / "step_trace_time.csv", steps_arg, notes)
    kernels = ascend_kernels(out / "kernel_details.csv", steps, top)
    if not kernels:
        notes.append("no kernel_details.csv: top operators unavailable (profile with ProfilerActivity.NPU)")
    return Report("ascend", str(folder), steps, split, kernels, ascend_communication(out / "communication.json"),
                  notes=notes)


# ----------------------------------------------------------------------------------------------
# Diagnosis


def diagnose(report: Report) -> list[dict]:
    """The thresholds above as findings, each with the evidence and the config keys to try."""
    s = report.split
    compute, exposed, free, bubble = (s.share(v) for v in (s.computing_ms, s.communication_not_overlapped_ms,
                                                           s.free_ms, s.bubble_ms))
    findings = []

    def add(finding: str, evidence: str, knobs: list[str]) -> None:
        findings.append({"finding": finding, "evidence": evidence, "knobs": knobs})

    if compute < COMPUTE_BOUND_BELOW and exposed >= free:
        add("likely communication-bound", f"computation is {compute:.0%} of the step (< {COMPUTE_BOUND_BELOW:.0%}), "
            f"exposed communication {exposed:.0%}",
            ["train.micro_batch_size: larger (more compute per collective)",
             "parallel.model_parallel: smaller, with parallel.data_parallel larger (fewer per-layer collectives)",
             "parallel.gradient_accumulation_steps: larger (one gradient all-reduce per several micro steps)",
             "parallel.pipeline_stage: >1 across nodes instead of model_parallel over slow links",
             "communication fusion / overlap: no config key yet (set_auto_parallel_context comm_fusion)"])
    if exposed > COMM_EXPOSED_ABOVE:
        add("communication not overlapped is large", f"{exposed:.0%} of the step waits on communication",
            ["parallel.sequence_parallel: true (with model_parallel > 1) turns all-reduces into "
             "reduce-scatter/all-gather pairs",
             "parallel.optimizer_shard: false removes the weight all-gathers; true lowers memory for a larger batch",
             "parallel.gradient_accumulation_steps: larger",
             "recompute.comm: false (do not repeat tensor-parallel communication in the backward)"])
    if free > FREE_ABOVE:
        add("device idle (free) time is long: host-bound, data pipeline or no sink mode",
            f"{free:.0%} of the step neither computes nor communicates",
            ["run.mode: graph (pynative launches op by op)",
             "train.log_interval: larger (every logged step synchronises with the host)",
             "context.jit_level: O2 on Ascend (whole-graph sink)",
             "data.path: preprocessed MindRecord instead of on-the-fly data",
             "dataset sink mode and data workers: no config key yet",
             "train.micro_batch_size: larger (more device work per host step)"])
    if bubble is not None and bubble > BUBBLE_ABOVE:
        add("pipeline bubble is large", f"bubble is {bubble:.0%} of the step",
            ["parallel.micro_batch_num: larger (bubble ~ (p-1)/(m+p-1))",
             "parallel.stage_offset: balance layers between stages"])
    waiting = [c for c in report.communication if c.get("wait_ratio", 0) > WAIT_RATIO_ABOVE]
    if waiting:
        names = ", ".join(f"{c['type']} {c['wait_ratio']:.0%}" for c in waiting)
        add("collectives mostly wait for other ranks (load imbalance or a slow rank)", f"wait share: {names}",
            ["parallel.stage_offset: balance pipeline stages",
             "parallel.micro_batch_num: larger (shorter waits at stage boundaries)",
             "compare the ranks' profiles for a slow device or host"])
    ops = [o for o in report.top_ops if not o["communication"]]
    layout = sum(o["share"] for o in ops if o["type"] in LAYOUT_OPS)
    if layout > LAYOUT_OPS_ABOVE:
        shown = ", ".join(f"{o['type']} {o['share']:.0%}" for o in ops if o["type"] in LAYOUT_OPS)
        add("data-movement ops (slices, transposes, casts) take much of the op time: change the model graph",
            f"{layout:.0%} of op time: {shown}",
            ["context.enable_graph_kernel: true (fuses elementwise chains; CPU needs the decorator package)",
             "model.compute_dtype: float32 on CPU (no Cast pairs around every MatMul)",
             "model.attention: flash on Atlas A2 (no score transposes)",
             "models/: separate q/k/v and gate/up weights instead of slicing fused outputs"])
    optimizer = sum(o["share"] for o in ops if OPTIMIZER_PATTERN.search(o["type"]))
    if optimizer > OPTIMIZER_OPS_ABOVE:
        add("the optimizer update is a large part of the step", f"{optimizer:.0%} of op time in optimizer ops",
            ["train.micro_batch_size: larger (amortise the update over more tokens)",
             "parallel.gradient_accumulation_steps: larger",
             "parallel.optimizer_shard: true (each data-parallel rank updates a shard)"])
    if not findings:
        add("compute-bound: no rule fired", f"computation is {compute:.0%} of the step",
            ["the top operators are the place to optimise; compare MFU with tools/mfu.py"])
    return findings


def analyse(root: Path, steps: int | None = None, top: int = 15) -> Report:
    if steps is not None and steps < 1:
        raise ProfileError(f"--steps {steps}: must be >= 1")
    layout, folder, others = find_profile(root)
    report = (ascend_report if layout == "ascend" else cpu_report)(folder, steps, top)
    if others:
        report.notes.append(f"{len(others)} more profile folder(s) under {root} (other ranks or runs): "
                            + ", ".join(o.name for o in others) + "; pass one as PROFILE_DIR to read it")
    report.diagnosis = diagnose(report)
    return report


def text(report: Report) -> str:
    s = report.split
    lines = [f"profile: {report.path} ({report.layout} layout, {report.steps} step(s) profiled, "
             f"{s.steps_analysed} analysed)",
             f"time per step: {s.step_ms:.3f} ms"]
    for label, value in (("computation", s.computing_ms), ("communication not overlapped",
                                                           s.communication_not_overlapped_ms),
                         ("free (idle)", s.free_ms)):
        lines.append(f"  {label:<30} {value:>10.3f} ms {s.share(value):>6.1%}")
    if s.communication_ms is not None:
        lines.append(f"  {'(communication in total)':<30} {s.communication_ms:>10.3f} ms")
    if s.bubble_ms is not None:
        lines.append(f"  {'(pipeline bubble)':<30} {s.bubble_ms:>10.3f} ms {s.share(s.bubble_ms):>6.1%}")
    lines.append(f"top operators by total time ({len(report.top_ops)}):")
    lines.append(f"  {'type':<36} {'ms/step':>10} {'share':>7} {'calls/step':>10}")
    for o in report.top_ops:
        mark = "  [comm]" if o["communication"] else ""
        lines.append(f"  {o['type']:<36} {o['ms_per_step']:>10.3f} {o['share']:>7.1%} {o['calls_per_step']:>10.1f}{mark}")
    if report.communication:
        lines.append("communication:")
        for c in report.communication:
            extra = f", wait {c['wait_ratio']:.0%}" if "wait_ratio" in c else ""
            lines.append(f"  {c['type']:<20} {c['calls_per_step']:.1f} calls/step, {c['ms_per_step']:.3f} ms/step{extra}")
    lines.append("diagnosis:")
    for d in report.diagnosis:
        lines.append(f"- {d['finding']} ({d['evidence']})")
        lines += [f"    try {k}" for k in d["knobs"]]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
