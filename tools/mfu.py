"""MFU and HFU of a run, or of a step time you give it, with the formula, parameter count and peak
printed beside the result (DESIGN.md §3-4; the arithmetic is mindscale/perf/flops.py, the same functions
the trainer logs with).

    python tools/mfu.py --metrics RUN_DIR [--skip 1] [--json]                 # config from RUN_DIR/config.yaml
    python tools/mfu.py --config C --step-time S --global-batch B --devices N [--peak-tflops P] [--json]

From a run folder: the first `--skip` records of every training process (compile steps) are
dropped, the median step time gives tokens/s, MFU and HFU, and the spread over the kept records
is reported. A metrics.jsonl whose last line is cut off (a run still writing) is read up to it
with a warning; an empty one, or one with nothing but warm-up records, is an error (exit 2).
Peak: --peak-tflops, else the hardware profile's, else (CPU) the peak logged by the run, else the
cached measured GEMM peak (mindscale/perf/gemm_peak.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from mindscale.perf import flops
from mindscale.config import ConfigError, load_config
from mindscale.cli import add_config_arguments, fail
from mindscale.config import Layout
from mindscale.perf.metrics_io import (RunDataError, load_run, profile_window, spread, steady_records,
                                       warn_if_truncated)


def peak_and_source(cfg, override: float | None, logged: float | None) -> tuple[float, str]:
    if override is not None:
        return override, "--peak-tflops"
    if cfg.hardware.peak_tflops is not None:
        return cfg.hardware.peak_tflops, f"hardware profile {cfg.hardware.name}"
    if logged is not None:
        return logged, "peak logged by the run (measured CPU GEMM)"
    from mindscale.perf.gemm_peak import cache_path, cpu_peak_tflops
    return cpu_peak_tflops(), f"measured one-core fp32 GEMM ({cache_path()})"


def utilisation(cfg, step_time_s: float, global_batch: int, devices: int, peak: float) -> dict:
    """The DESIGN §3 keys for one step time."""
    m = cfg.model
    recomputed = len(Layout.of(cfg).recomputed)
    tokens_per_s = global_batch * m.seq_length / step_time_s
    return {
        "mfu": flops.mfu(tokens_per_s, devices, peak, m),
        "hfu": flops.hfu(tokens_per_s, devices, peak, m, cfg.recompute.mode, recomputed),
        "flops_per_token": flops.model_flops_per_token(m),
        "hflops_per_token": flops.hardware_flops_per_token(m, cfg.recompute.mode, recomputed),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "tflops_per_device": tokens_per_s * flops.model_flops_per_token(m) / devices / 1e12,
        "step_time_s": step_time_s, "global_batch": global_batch, "devices": devices, "peak_tflops": peak,
        "params": flops.param_count(m), "matmul_params": flops.matmul_param_count(m),
        "recompute": cfg.recompute.mode, "recomputed_layers": recomputed, "formula": flops.formula_text(),
    }


def from_metrics(run_dir: str, cfg, overrides: list[str], skip: int, devices: int | None,
                 peak_override: float | None) -> tuple[dict, object]:
    """(result, config used): `cfg`, or the run's config.yaml with `overrides` applied."""
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


def text(r: dict, cfg) -> str:
    m = cfg.model
    lines = [f"MFU {r['mfu']:.2%}   HFU {r['hfu']:.2%}   (peak {r['peak_tflops']:g} TFLOP/s per device: {r['peak_source']})",
             f"tokens/s {r['tokens_per_s']:,.1f} ({r['tokens_per_s_per_device']:,.2f} per device, {r['devices']} "
             f"devices), model TFLOP/s per device {r['tflops_per_device']:.4g}, step time {r['step_time_s']:.4g} s, "
             f"global batch {r['global_batch']} x {m.seq_length} tokens",
             f"model FLOPs per token {r['flops_per_token']:.4g} = 6N + 12·L·H·Q·T with N = {r['matmul_params']:,} "
             f"matmul parameters ({r['params']:,} in all), L={m.num_layers}, H={m.num_heads}, Q={m.head_dim}, "
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MFU/HFU from a run folder or from a step time.")
    add_config_arguments(parser, required=False)
    parser.add_argument("--metrics", metavar="RUN_DIR", help="run folder with metrics.jsonl (and config.yaml)")
    parser.add_argument("--step-time", type=float, help="seconds per optimizer step")
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    parser.add_argument("--devices", type=int, help="devices (default: the config's data x model x pipeline)")
    parser.add_argument("--peak-tflops", type=float, help="peak per device, overrides the hardware profile")
    parser.add_argument("--skip", "--warmup", dest="skip", type=int, default=1,
                        help="records dropped at the start of each training process (default 1: the compile step)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    explicit = args.step_time is not None or args.global_batch is not None
    if bool(args.metrics) == explicit:
        fail("give either --metrics RUN_DIR or both --step-time S and --global-batch B")
    if explicit and (args.step_time is None or args.global_batch is None):
        fail("--step-time and --global-batch go together; give both")
    if args.step_time is not None and args.step_time <= 0 or args.global_batch is not None and args.global_batch < 1:
        fail(f"--step-time {args.step_time} / --global-batch {args.global_batch}: need a time > 0 and a batch >= 1")
    if args.devices is not None and args.devices < 1 or args.peak_tflops is not None and args.peak_tflops <= 0:
        fail(f"--devices {args.devices} / --peak-tflops {args.peak_tflops}: need devices >= 1 and a peak > 0")
    if args.skip < 0:
        fail(f"--skip {args.skip}: must be >= 0")
    if not args.config and not args.metrics:
        fail("--config is required with --step-time (a run folder brings its own config.yaml)")
    try:
        cfg = load_config(args.config, args.overrides) if args.config else None
        if args.metrics:
            result, cfg = from_metrics(args.metrics, cfg, args.overrides, args.skip, args.devices, args.peak_tflops)
        else:
            peak, source = peak_and_source(cfg, args.peak_tflops, None)
            result = utilisation(cfg, args.step_time, args.global_batch, args.devices or cfg.devices, peak)
            result["peak_source"] = source
    except (ConfigError, RunDataError) as exc:
        fail(str(exc))
    print(json.dumps(result) if args.json else text(result, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
