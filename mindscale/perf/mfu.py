"""MFU and HFU of a run folder or of a given step time, with the parameter count, FLOPs per token and
peak they come from (tools/mfu.py prints them; the definitions are in docs/mfu.md, the arithmetic is
mindscale/perf/flops.py, the same functions the trainer logs with).

Peak per device: an explicit override, else the hardware profile's, else (CPU) the peak the run
logged, else the cached measured GEMM peak (mindscale/perf/gemm_peak.py).
"""
from __future__ import annotations

import statistics

from mindscale.config import Config, Layout, load_config
from mindscale.perf import flops
from mindscale.perf.metrics_io import RunDataError, load_run, profile_window, spread, steady_records, warn_if_truncated


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
    m, layout = cfg.model, Layout.of(cfg)
    recomputed = len(layout.recomputed)
    return {"flops_per_token": flops.model_flops_per_token(m),
            "hflops_per_token": flops.hardware_flops_per_token(m, layout.recompute, recomputed),
            "params": flops.param_count(m), "matmul_params": flops.matmul_param_count(m),
            "recompute": layout.recompute, "recomputed_layers": recomputed}


def utilisation(cfg: Config, step_time_s: float, global_batch: int, devices: int, peak: float) -> dict:
    """MFU, HFU, throughput and the counts behind them, for one step time."""
    m = cfg.model
    counts = flop_counts(cfg)
    tokens_per_s = global_batch * m.seq_length / step_time_s
    return {
        "mfu": flops.mfu(tokens_per_s, devices, peak, m),
        "hfu": flops.hfu(tokens_per_s, devices, peak, m, counts["recompute"], counts["recomputed_layers"]),
        "flops_per_token": counts["flops_per_token"], "hflops_per_token": counts["hflops_per_token"],
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "tflops_per_device": tokens_per_s * counts["flops_per_token"] / devices / 1e12,
        "step_time_s": step_time_s, "global_batch": global_batch, "devices": devices, "peak_tflops": peak,
        "params": counts["params"], "matmul_params": counts["matmul_params"],
        "recompute": counts["recompute"], "recomputed_layers": counts["recomputed_layers"],
        "formula": flops.formula_text(),
    }


def of_step_time(cfg: Config, step_time_s: float, global_batch: int, devices: int | None,
                 peak_override: float | None) -> dict:
    """`utilisation` with the peak chosen as the module docstring says; devices default to the config's."""
    peak, source = peak_and_source(cfg, peak_override, None)
    result = utilisation(cfg, step_time_s, global_batch, devices or cfg.devices, peak)
    result["peak_source"] = source
    return result


def from_metrics(run_dir: str, cfg: Config | None, overrides: list[str], skip: int, devices: int | None,
                 peak_override: float | None) -> tuple[dict, Config]:
    """(result, config used) of a run folder: the median step time over the records after the first
    `skip` of every training process, and the spread over those records. The config is `cfg`, or the
    run's config.yaml with `overrides` applied."""
    run = load_run(run_dir)
    warn_if_truncated(run)
    if cfg is None:
        cfg = load_config(run.path / "config.yaml", overrides) if overrides else run.config
    kept, steady = steady_records(run.metrics.records, skip, profile_window(run.config))
    if not steady:
        raise RunDataError(f"{run.path / 'metrics.jsonl'} has {len(run.metrics.records)} record(s), all within the "
                           f"first --skip {skip} of their process (compile steps); lower --skip or log more steps")
    devices = devices or run.config.devices
    peak, source = peak_and_source(cfg, peak_override, run.metrics.records[-1].get("peak_tflops"))
    step = statistics.median(float(r["step_time_s"]) for r in kept)
    result = utilisation(cfg, step, cfg.global_batch_size, devices, peak)
    per_record = [utilisation(cfg, float(r["step_time_s"]), cfg.global_batch_size, devices, peak) for r in kept]
    result.update({
        "peak_source": source, "run": str(run.path), "records_used": len(kept), "skip": skip,
        "spread": {key: spread(per_record, key) for key in ("step_time_s", "tokens_per_s", "mfu", "hfu")},
        "logged_median": {key: statistics.median(float(r[key]) for r in kept) for key in ("mfu", "hfu")},
    })
    return result, cfg


def text(r: dict, cfg: Config) -> str:
    """The result with its formula, counts and peak, for reading (or redoing by hand)."""
    m = cfg.model
    lines = [f"MFU {r['mfu']:.2%}   HFU {r['hfu']:.2%}   (peak {r['peak_tflops']:g} TFLOP/s per device: {r['peak_source']})",
             f"tokens/s {r['tokens_per_s']:,.1f} ({r['tokens_per_s_per_device']:,.2f} per device, {r['devices']} "
             f"devices), model TFLOP/s per device {r['tflops_per_device']:.4g}, step time {r['step_time_s']:.4g} s, "
             f"global batch {r['global_batch']} x {m.seq_length} tokens",
             f"model FLOPs per token {r['flops_per_token']:.4g} = 6N + 12·L·H·Q·T with N = {r['matmul_params']:,} "
             f"matmul parameters ({r['params']:,} in all), L={m.num_layers}, H={m.num_heads}, Q={m.head_size}, "
             f"T={m.seq_length}",
             f"hardware FLOPs per token {r['hflops_per_token']:.4g} (recompute {r['recompute']}, "
             f"{r['recomputed_layers']} layers)",
             r["formula"]]
    if "spread" in r:
        st = r["spread"]["step_time_s"]
        mfu = r["spread"]["mfu"]
        lines.append(f"from {r['records_used']} records of {r['run']} (first {r['skip']} per process skipped): step time "
                     f"median {st['median']:.4g} s, min {st['min']:.4g}, max {st['max']:.4g} (spread "
                     f"{st['rel_spread']:.1%}); MFU {mfu['min']:.2%} to {mfu['max']:.2%}; logged MFU median "
                     f"{r['logged_median']['mfu']:.2%}")
    return "\n".join(lines)
