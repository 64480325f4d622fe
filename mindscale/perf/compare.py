"""Before/after comparison of two run folders, judged against the targets asked for (tools/compare_runs.py
prints it).

Rows: step time (relative change), throughput tokens/s (relative change), MFU of the optimized run,
HFU and peak memory (shown, never judged) and linearity at the largest device count of a sweep, read
from a linearity.json (mindscale/perf/linearity.py) in the run folder or given explicitly. Each run's
numbers are mindscale/perf/mfu.py's `of_run` (the steps after warm-up: their tokens over their time),
what tools/mfu.py prints. A row's `met` is None when it has no target or no measurement; no target
is judged unless asked for, by a preset (`PRESETS`) or one by one.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from mindscale.config import UserError
from mindscale.perf.linearity import RESULT_FILE, TARGET as LINEARITY_TARGET
from mindscale.perf.metrics_io import DEFAULT_WARMUP, RunDataError, load_run, warn_if_truncated
from mindscale.perf.mfu import of_run

# Model dimensions that fix the FLOPs per token: a comparison across them is not before/after.
MODEL_KEYS = (
    "arch",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "kv_heads",
    "ffn_hidden_size",
    "seq_length",
)


@dataclass(frozen=True)
class Targets:
    """What a comparison judges; None: that row is shown, not judged."""

    step_time: float | None = None  # relative step-time change, e.g. -0.30 (30% faster)
    throughput: float | None = None  # relative throughput change, e.g. 0.50 (+50%)
    mfu: float | None = None  # MFU of the optimized run, e.g. 0.60
    linearity: float | None = None  # linearity of the optimized run's sweep, e.g. 0.8


# Named target sets (--targets NAME). seed: the goals MindScale was started with, for Ascend runs of the
# shipped configs; an ordinary before/after comparison, on CPU above all, meets none of them.
PRESETS = {"seed": Targets(step_time=-0.30, throughput=0.50, mfu=0.60, linearity=LINEARITY_TARGET)}


def targets_of(preset: str | None, **given: float | None) -> Targets:
    """The preset's targets (none without a preset), each replaced by a value `given` that is not None."""
    if preset is not None and preset not in PRESETS:
        raise UserError(f"--targets {preset}: no such preset; the presets are: {', '.join(PRESETS)}")
    chosen = PRESETS[preset] if preset else Targets()
    return dataclasses.replace(chosen, **{key: value for key, value in given.items() if value is not None})


def read_linearity(path: Path) -> dict:
    """The point at the largest device count of a linearity.json (tools/linearity.py)."""
    try:
        data = json.loads(path.read_text())
        point = max(data["points"], key=lambda p: p["devices"])
        return {
            "linearity": float(point["linearity"]),
            "devices": int(point["devices"]),
            "base_devices": int(data["base_devices"]),
            "source": str(path),
        }
    except FileNotFoundError:
        raise RunDataError(f"{path} does not exist; run tools/linearity.py on the sweep first")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise RunDataError(f"{path} is not a linearity.json written by tools/linearity.py; re-create it")


def linearity_of(run_dir: Path, explicit: Path | None) -> dict | None:
    """`explicit`, else the run folder's linearity.json, else None."""
    if explicit is not None:
        return read_linearity(explicit)
    found = run_dir / RESULT_FILE
    return read_linearity(found) if found.is_file() else None


def row(
    name: str,
    unit: str,
    base: float | None,
    opt: float | None,
    change: float | None,
    change_kind: str,
    target: float | None,
    met: bool | None,
    target_text: str,
) -> dict:
    return {
        "metric": name,
        "unit": unit,
        "baseline": base,
        "optimized": opt,
        "change": change,
        "change_kind": change_kind,
        "target": target,
        "target_text": target_text,
        "met": met,
    }


def relative(base: float, opt: float) -> float:
    return opt / base - 1.0


def judge(value: float | None, comparison: str, target: float | None) -> bool | None:
    """Whether `value` meets `target` ("<=" or ">="); None without either."""
    if value is None or target is None:
        return None
    return value <= target if comparison == "<=" else value >= target


def compare(
    baseline_dir: str,
    optimized_dir: str,
    targets: Targets = Targets(),
    warmup: int = DEFAULT_WARMUP,
    optimized_linearity: Path | None = None,
    baseline_linearity: Path | None = None,
) -> dict:
    """The rows, notes and verdict (`all_met`) of the two runs; the linearity.json files default to
    those in the run folders."""
    base_run, opt_run = load_run(baseline_dir), load_run(optimized_dir)
    for run in (base_run, opt_run):
        warn_if_truncated(run)
    base_model, opt_model = base_run.config.model, opt_run.config.model
    differing = [k for k in MODEL_KEYS if getattr(base_model, k) != getattr(opt_model, k)]
    if differing:
        shown = ", ".join(f"model.{k} {getattr(base_model, k)} vs {getattr(opt_model, k)}" for k in differing)
        raise RunDataError(f"the runs train different models ({shown}); compare runs of the same model")
    b, o = of_run(base_run, warmup), of_run(opt_run, warmup)

    rows = []
    change = relative(b["step_time_s"], o["step_time_s"])
    t = targets.step_time
    rows.append(
        row(
            "step time",
            "s",
            b["step_time_s"],
            o["step_time_s"],
            change,
            "relative",
            t,
            judge(change, "<=", t),
            f"<= {t:+.0%}" if t is not None else "-",
        )
    )
    change = relative(b["tokens_per_s"], o["tokens_per_s"])
    t = targets.throughput
    rows.append(
        row(
            "throughput",
            "tokens/s",
            b["tokens_per_s"],
            o["tokens_per_s"],
            change,
            "relative",
            t,
            judge(change, ">=", t),
            f">= {t:+.0%}" if t is not None else "-",
        )
    )
    rows.append(
        row(
            "throughput per device",
            "tokens/s/device",
            b["tokens_per_s_per_device"],
            o["tokens_per_s_per_device"],
            relative(b["tokens_per_s_per_device"], o["tokens_per_s_per_device"]),
            "relative",
            None,
            None,
            "-",
        )
    )
    t = targets.mfu
    rows.append(
        row(
            "MFU",
            "fraction",
            b["mfu"],
            o["mfu"],
            o["mfu"] - b["mfu"],
            "points",
            t,
            judge(o["mfu"], ">=", t),
            f">= {t:.0%}" if t is not None else "-",
        )
    )
    rows.append(row("HFU", "fraction", b["hfu"], o["hfu"], o["hfu"] - b["hfu"], "points", None, None, "-"))
    rows.append(
        row(
            "peak memory",
            "GiB",
            b["memory_gib"],
            o["memory_gib"],
            relative(b["memory_gib"], o["memory_gib"]) if b["memory_gib"] else None,
            "relative",
            None,
            None,
            "-",
        )
    )
    base_lin = linearity_of(base_run.path, baseline_linearity)
    opt_lin = linearity_of(opt_run.path, optimized_linearity)
    t = targets.linearity
    devices = (opt_lin or base_lin or {}).get("devices")
    base_value = base_lin["linearity"] if base_lin else None
    opt_value = opt_lin["linearity"] if opt_lin else None
    rows.append(
        row(
            f"linearity at {devices} devices" if devices else "linearity",
            "ratio",
            base_value,
            opt_value,
            opt_value - base_value if None not in (base_value, opt_value) else None,
            "points",
            t,
            judge(opt_value, ">=", t),
            f">= {t:g}" if t is not None else "-",
        )
    )
    notes = []
    if opt_lin is None and t is not None:
        notes.append("no linearity for the optimized run: run tools/linearity.py on its sweep or pass --linearity")
    if (
        base_run.config.samples_per_step != opt_run.config.samples_per_step
        or base_run.config.devices != opt_run.config.devices
    ):
        notes.append(
            f"global batch {base_run.config.samples_per_step} on {base_run.config.devices} device(s) vs "
            f"{opt_run.config.samples_per_step} on {opt_run.config.devices}: step times cover different work; "
            "throughput is the fair comparison"
        )
    for run, s in ((base_run, b), (opt_run, o)):
        if not s["steady"]:
            notes.append(f"{run.path}: only warm-up records, numbers include compile time")
    peaks = {s["peak_tflops"] for s in (b, o)}
    if len(peaks) > 1:
        notes.append(f"MFU uses different peaks ({sorted(peaks)} TFLOP/s): compare HFU/throughput too")
    judged = [r["met"] for r in rows if r["met"] is not None]
    return {
        "baseline": str(base_run.path),
        "optimized": str(opt_run.path),
        "rows": rows,
        "peak_tflops": {"baseline": b["peak_tflops"], "optimized": o["peak_tflops"]},
        "targets": {key: value for key, value in dataclasses.asdict(targets).items() if value is not None},
        "all_met": all(judged) if judged else None,
        "notes": notes,
    }


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "fraction":
        return f"{value:.2%}"
    if unit == "s":
        return f"{value:.4f}"
    if unit == "ratio":
        return f"{value:.3f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"


def fmt_change(r: dict) -> str:
    if r["change"] is None:
        return "n/a"
    if r["change_kind"] == "relative":
        return f"{r['change']:+.1%}"
    scale = 100 if r["unit"] == "fraction" else 1
    return f"{r['change'] * scale:+.2f}" + (" pp" if r["unit"] == "fraction" else "")


def table(result: dict) -> str:
    """The verification table, the peaks MFU used, the notes and the verdict."""
    lines = [
        f"baseline:  {result['baseline']}",
        f"optimized: {result['optimized']}",
        f"{'metric':<40} {'baseline':>11} {'optimized':>11} {'change':>10}  {'target':<12} met?",
    ]
    for r in result["rows"]:
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        name = f"{r['metric']} ({r['unit']})" if r["unit"] not in ("fraction", "ratio") else r["metric"]
        lines.append(
            f"{name:<40} {fmt_value(r['baseline'], r['unit']):>11} {fmt_value(r['optimized'], r['unit']):>11} "
            f"{fmt_change(r):>10}  {r['target_text']:<12} {met}"
        )
    peaks = result["peak_tflops"]
    lines.append(
        f"MFU = tokens/s x model FLOPs per token / (devices x peak); peak TFLOP/s per device: "
        f"baseline {peaks['baseline']:.4g}, optimized {peaks['optimized']:.4g}"
    )
    lines += [f"note: {n}" for n in result["notes"]]
    lines.append(verdict(result))
    return "\n".join(lines)


def verdict(result: dict) -> str:
    """The last line: whether the targets asked for are met, or that none was asked for."""
    if not result["targets"]:
        return (
            "no targets judged: pass --targets "
            + " or ".join(PRESETS)
            + " or --step-time-target, --throughput-target, --mfu-target, --linearity-target"
        )
    unmeasured = [r["metric"] for r in result["rows"] if r["target"] is not None and r["met"] is None]
    said = {True: "all targets met", False: "targets NOT met", None: "no target measured"}[result["all_met"]]
    return said + (f" (not measured: {', '.join(unmeasured)})" if unmeasured else "")
