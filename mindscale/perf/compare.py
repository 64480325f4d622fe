"""Before/after verification of two run folders against performance targets (tools/compare_runs.py
prints it).

Rows: step time (relative change), throughput tokens/s (relative change), MFU of the optimized run,
HFU and peak memory (shown, no target) and linearity at the largest device count of a sweep, read
from a linearity.json (mindscale/perf/linearity.py) in the run folder or given explicitly. Medians
over the steps after warm-up. A row's `met` is None when it has no target or no measurement.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mindscale.perf.linearity import RESULT_FILE, TARGET as LINEARITY_TARGET
from mindscale.perf.metrics_io import DEFAULT_WARMUP, RunDataError, load_run, steady_summary, warn_if_truncated

# Model dimensions that fix the FLOPs per token: a comparison across them is not before/after.
MODEL_KEYS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "kv_heads", "ffn_hidden_size",
              "seq_length")


@dataclass(frozen=True)
class Targets:
    step_time: float = -0.30            # relative step-time change (30% faster)
    throughput: float = 0.50            # relative throughput change (+50%)
    mfu: float = 0.60                   # MFU of the optimized run
    linearity: float = LINEARITY_TARGET


def read_linearity(path: Path) -> dict:
    """The point at the largest device count of a linearity.json (tools/linearity.py)."""
    try:
        data = json.loads(path.read_text())
        point = max(data["points"], key=lambda p: p["devices"])
        return {"linearity": float(point["linearity"]), "devices": int(point["devices"]),
                "base_devices": int(data["base_devices"]), "source": str(path)}
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


def row(name: str, unit: str, base: float | None, opt: float | None, change: float | None,
        change_kind: str, target: float | None, met: bool | None, target_text: str) -> dict:
    return {"metric": name, "unit": unit, "baseline": base, "optimized": opt, "change": change,
            "change_kind": change_kind, "target": target, "target_text": target_text, "met": met}


def relative(base: float, opt: float) -> float:
    return opt / base - 1.0


def compare(baseline_dir: str, optimized_dir: str, targets: Targets = Targets(), warmup: int = DEFAULT_WARMUP,
            optimized_linearity: Path | None = None, baseline_linearity: Path | None = None) -> dict:
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
    b, o = steady_summary(base_run, warmup), steady_summary(opt_run, warmup)

    rows = []
    change = relative(b["step_time_s"], o["step_time_s"])
    t = targets.step_time
    rows.append(row("step time", "s", b["step_time_s"], o["step_time_s"], change, "relative", t,
                    change <= t, f"<= {t:+.0%}"))
    change = relative(b["tokens_per_s"], o["tokens_per_s"])
    t = targets.throughput
    rows.append(row("throughput", "tokens/s", b["tokens_per_s"], o["tokens_per_s"], change, "relative", t,
                    change >= t, f">= {t:+.0%}"))
    rows.append(row("throughput per device", "tokens/s/device", b["tokens_per_s_per_device"],
                    o["tokens_per_s_per_device"], relative(b["tokens_per_s_per_device"], o["tokens_per_s_per_device"]),
                    "relative", None, None, "-"))
    t = targets.mfu
    rows.append(row("MFU", "fraction", b["mfu"], o["mfu"], o["mfu"] - b["mfu"], "points", t, o["mfu"] >= t,
                    f">= {t:.0%}"))
    rows.append(row("HFU", "fraction", b["hfu"], o["hfu"], o["hfu"] - b["hfu"], "points", None, None, "-"))
    rows.append(row("peak memory", "GiB", b["memory_gib"], o["memory_gib"], relative(b["memory_gib"], o["memory_gib"])
                    if b["memory_gib"] else None, "relative", None, None, "-"))
    base_lin = linearity_of(base_run.path, baseline_linearity)
    opt_lin = linearity_of(opt_run.path, optimized_linearity)
    t = targets.linearity
    devices = (opt_lin or base_lin or {}).get("devices")
    base_value = base_lin["linearity"] if base_lin else None
    opt_value = opt_lin["linearity"] if opt_lin else None
    rows.append(row(f"linearity at {devices} devices" if devices else "linearity", "ratio", base_value, opt_value,
                    opt_value - base_value if None not in (base_value, opt_value) else None, "points", t,
                    opt_value >= t if opt_value is not None else None, f">= {t:g}"))
    notes = []
    if opt_lin is None:
        notes.append("no linearity for the optimized run: run tools/linearity.py on its sweep or pass --linearity")
    if base_run.config.global_batch_size != opt_run.config.global_batch_size or \
            base_run.config.devices != opt_run.config.devices:
        notes.append(f"global batch {base_run.config.global_batch_size} on {base_run.config.devices} device(s) vs "
                     f"{opt_run.config.global_batch_size} on {opt_run.config.devices}: step times cover different work; "
                     "throughput is the fair comparison")
    for run, s in ((base_run, b), (opt_run, o)):
        if not s["steady"]:
            notes.append(f"{run.path}: only warm-up records, numbers include compile time")
    peaks = {s.get("peak_tflops") for s in (b, o)}
    if len(peaks) > 1:
        notes.append(f"MFU uses different peaks ({sorted(p for p in peaks if p is not None)} TFLOP/s): "
                     "compare HFU/throughput too")
    judged = [r["met"] for r in rows if r["met"] is not None]
    return {"baseline": str(base_run.path), "optimized": str(opt_run.path), "rows": rows,
            "peak_tflops": {"baseline": b.get("peak_tflops"), "optimized": o.get("peak_tflops")},
            "all_met": all(judged), "notes": notes}


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
    lines = [f"baseline:  {result['baseline']}", f"optimized: {result['optimized']}",
             f"{'metric':<40} {'baseline':>11} {'optimized':>11} {'change':>10}  {'target':<12} met?"]
    for r in result["rows"]:
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        name = f"{r['metric']} ({r['unit']})" if r["unit"] not in ("fraction", "ratio") else r["metric"]
        lines.append(f"{name:<40} {fmt_value(r['baseline'], r['unit']):>11} {fmt_value(r['optimized'], r['unit']):>11} "
                     f"{fmt_change(r):>10}  {r['target_text']:<12} {met}")
    peaks = result["peak_tflops"]
    shown = {k: f"{v:.4g}" if v is not None else "not logged" for k, v in peaks.items()}
    lines.append(f"MFU = tokens/s x model FLOPs per token / (devices x peak); peak TFLOP/s per device: "
                 f"baseline {shown['baseline']}, optimized {shown['optimized']}")
    lines += [f"note: {n}" for n in result["notes"]]
    unmeasured = [r["metric"] for r in result["rows"] if r["target"] is not None and r["met"] is None]
    verdict = "all targets met" if result["all_met"] else "targets NOT met"
    lines.append(verdict + (f" (not measured: {', '.join(unmeasured)})" if unmeasured else ""))
    return "\n".join(lines)
