"""MFU and HFU of a run folder or of a given step time, with the parameter count, FLOPs per token and
peak they come from (the definitions are in docs/mfu.md, the arithmetic is mindscale/perf/flops.py, the
same functions the trainer logs with). `of_run` is the one measurement of a run folder that tools/mfu.py,
tools/report.py, tools/compare_runs.py and tools/linearity.py print.

Peak per device: an explicit override, else the hardware profile's, else (CPU) the peak the run
logged, else the cached measured GEMM peak (mindscale/perf/gemm_peak.py).
"""

from __future__ import annotations

import sys

from mindscale.config import Config, Layout, load_config
from mindscale.perf import flops
from mindscale.perf.metrics_io import (
    Run,
    RunDataError,
    load_run,
    per_step_mean,
    profile_window,
    spread,
    steady_records,
    steps_in,
    warn_if_truncated,
)


def peak_and_source(cfg: Config, override: float | None, logged: float | None) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it comes from)."""
    if override is not None:
        return override, "--peak-tflops"
    if cfg.hardware.peak_tflops is not None:
        return cfg.hardware.peak_tflops, f"hardware profile {cfg.hardware.name}"
    if logged is not None:
        return logged, "peak logged by the run (measured CPU GEMM)"
    from mindscale.perf.gemm_peak import cache_path, cpu_peak_tflops

    return cpu_peak_tflops(), f"measured one-core fp32 GEMM ({cache_path()})"


def flop_counts(cfg: Config) -> dict:
    """Parameter counts and FLOPs per token of `cfg`'s model, recompute counted as its layout runs it."""
    model, layout = cfg.model, Layout.of(cfg)
    recomputed = len(layout.recomputed)
    return {
        "flops_per_token": flops.model_flops_per_token(model),
        "hflops_per_token": flops.hardware_flops_per_token(model, layout.recompute, recomputed),
        "params": flops.param_count(model),
        "matmul_params": flops.matmul_param_count(model),
        "recompute": layout.recompute,
        "recomputed_layers": recomputed,
    }


def utilisation(cfg: Config, step_time_s: float, global_batch: int, devices: int, peak: float) -> dict:
    """MFU, HFU, throughput and the counts behind them, for one step time."""
    model = cfg.model
    counts = flop_counts(cfg)
    tokens_per_s = global_batch * model.seq_length / step_time_s
    return {
        "mfu": flops.mfu(tokens_per_s, devices, peak, model),
        "hfu": flops.hfu(tokens_per_s, devices, peak, model, counts["recompute"], counts["recomputed_layers"]),
        "flops_per_token": counts["flops_per_token"],
        "hflops_per_token": counts["hflops_per_token"],
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "samples_per_s_per_device": global_batch / step_time_s / devices,
        "tflops_per_device": tokens_per_s * counts["flops_per_token"] / devices / 1e12,
        "step_time_s": step_time_s,
        "global_batch": global_batch,
        "devices": devices,
        "peak_tflops": peak,
        "params": counts["params"],
        "matmul_params": counts["matmul_params"],
        "recompute": counts["recompute"],
        "recomputed_layers": counts["recomputed_layers"],
        "formula": flops.formula_text(),
    }


def of_step_time(
    cfg: Config, step_time_s: float, global_batch: int, devices: int | None, peak_override: float | None
) -> dict:
    """`utilisation` with the peak chosen as the module docstring says; devices default to the config's."""
    peak, source = peak_and_source(cfg, peak_override, None)
    result = utilisation(cfg, step_time_s, global_batch, devices or cfg.devices, peak)
    result["peak_source"] = source
    return result


def from_metrics(
    run_dir: str, cfg: Config | None, overrides: list[str], skip: int, devices: int | None, peak_override: float | None
) -> tuple[dict, Config]:
    """(`of_run` of a run folder, config used): the config is `cfg`, or the run's config.yaml with
    `overrides` applied. A run that logged nothing after its warm-up records is an error."""
    run = load_run(run_dir)
    warn_if_truncated(run)
    if cfg is None:
        cfg = load_config(run.path / "config.yaml", overrides) if overrides else run.config
    return of_run(run, skip, cfg, devices, peak_override, warmup_only_ok=False), cfg


def of_run(
    run: Run,
    warmup: int,
    cfg: Config | None = None,
    devices: int | None = None,
    peak_override: float | None = None,
    warmup_only_ok: bool = True,
) -> dict:
    """Throughput, MFU and HFU of a run folder (docs/mfu.md): the records after the first `warmup` of
    every training process, outside the profiled steps, cover some optimizer steps; the step time is
    their total time over their number, so tokens/s is their tokens over their time, and MFU, HFU and
    TFLOP/s per device follow from it (`utilisation`). `cfg` (default the run's config.yaml) gives the
    model and the batch, `devices` and `peak_override` replace the run's. Memory is the highest any
    record logged. Only warm-up records: an error, or with `warmup_only_ok` a warning and the last one."""
    cfg = cfg or run.config
    records = run.metrics.records
    kept, steady = steady_records(records, warmup, profile_window(run.config))
    if not steady and not warmup_only_ok:
        raise RunDataError(
            f"{run.path / 'metrics.jsonl'} has {len(records)} record(s), all within the first "
            f"--skip {warmup} of their process (compile steps); lower --skip or log more steps"
        )
    if not steady:
        print(
            f"warning: {run.path} logged {len(records)} record(s), all warm-up; using the last one "
            "(it includes compile time)",
            file=sys.stderr,
        )
    logged_devices = {int(r["devices"]) for r in records}
    if logged_devices != {run.config.devices}:
        raise RunDataError(
            f"{run.path}: metrics.jsonl logs devices {sorted(logged_devices)} but config.yaml "
            f"gives {run.config.devices}; the folder mixes runs, use a fresh run.name"
        )
    peak, source = peak_and_source(cfg, peak_override, records[-1].get("peak_tflops"))
    step_time = per_step_mean(kept, "step_time_s")
    result = utilisation(cfg, step_time, cfg.samples_per_step, devices or run.config.devices, peak)
    per_record = [
        utilisation(cfg, float(r["step_time_s"]), cfg.samples_per_step, result["devices"], peak) for r in kept
    ]
    result.update(
        {
            "peak_source": source,
            "run": str(run.path),
            "records_used": len(kept),
            "steps_used": sum(steps_in(r) for r in kept),
            "skip": warmup,
            "steady": steady,
            "memory_gib": max(float(r["memory_gib"]) for r in records),
            "spread": {
                key: spread(per_record, key, result[key]) for key in ("step_time_s", "tokens_per_s", "mfu", "hfu")
            },
        }
    )
    return result


def text(r: dict, cfg: Config) -> str:
    """The result with its formula, counts and peak, for reading (or redoing by hand)."""
    model = cfg.model
    lines = [
        f"MFU {r['mfu']:.2%}   HFU {r['hfu']:.2%}   (peak {r['peak_tflops']:g} TFLOP/s per device: {r['peak_source']})",
        f"tokens/s {r['tokens_per_s']:,.1f} ({r['tokens_per_s_per_device']:,.2f} per device, {r['devices']} "
        f"devices), model TFLOP/s per device {r['tflops_per_device']:.4g}, step time {r['step_time_s']:.4g} s, "
        f"global batch {r['global_batch']} x {model.seq_length} tokens",
        f"model FLOPs per token {r['flops_per_token']:.4g} = 6N + 12·L·H·Q·T with N = {r['matmul_params']:,} "
        f"matmul parameters ({r['params']:,} in all), L={model.num_layers}, H={model.num_heads}, Q={model.head_size}, "
        f"T={model.seq_length}",
        f"hardware FLOPs per token {r['hflops_per_token']:.4g} (recompute {r['recompute']}, "
        f"{r['recomputed_layers']} layers)",
        r["formula"],
    ]
    if "spread" in r:
        st = r["spread"]["step_time_s"]
        mfu = r["spread"]["mfu"]
        lines.append(
            f"from {r['steps_used']} steps in {r['records_used']} records of {r['run']} (first {r['skip']} "
            f"record(s) per process skipped): step time = their total time / their steps; the records' "
            f"step times {st['min']:.4g} to {st['max']:.4g} s (spread {st['rel_spread']:.1%}), "
            f"MFU {mfu['min']:.2%} to {mfu['max']:.2%}"
        )
    return "\n".join(lines)
