"""Test helper: a run folder as the trainer leaves it (docs/design.md: the run folder), from chosen step times.

The config is configs/tiny/llama_tiny.yaml resolved through mindscale.config; every metric of a
record follows from its step time the way mindscale/train/loop/metrics.py derives it (mindscale/perf/flops.py), with
a fixed peak instead of the measured CPU one, so tests can predict the tools' answers by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from mindscale.perf import flops
from mindscale.config import Layout, load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny" / "llama_tiny.yaml"
PEAK_TFLOPS = 0.05


def record(cfg, step: int, step_time: float, elapsed: float, memory_gib: float, loss: float) -> dict:
    tokens_per_s = cfg.samples_per_step * cfg.model.seq_length / step_time
    devices = cfg.devices
    layout = Layout.of(cfg)
    return {
        "step": step,
        "loss": loss,
        "lr": cfg.train.lr * min(1.0, step / max(1, cfg.train.warmup_steps)),
        "grad_norm": 1.0 / step**0.5,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "samples_per_s_per_device": cfg.samples_per_step / step_time / devices,
        "tflops_per_device": tokens_per_s * flops.model_flops_per_token(cfg.model) / devices / 1e12,
        "mfu": flops.mfu(tokens_per_s, devices, PEAK_TFLOPS, cfg.model),
        "hfu": flops.hfu(tokens_per_s, devices, PEAK_TFLOPS, cfg.model, layout.recompute, len(layout.recomputed)),
        "peak_tflops": PEAK_TFLOPS,
        "memory_gib": memory_gib,
        "devices": devices,
        "steps_in_window": 1,
        "elapsed_s": elapsed,
    }


def write_run(
    parent: Path,
    name: str,
    step_times: list[float],
    overrides: list[str] = (),
    memory_gib: float = 1.5,
    truncate: bool = False,
) -> Path:
    """Write <parent>/<name>/{config.yaml,metrics.jsonl}; step i (1-based) took step_times[i-1] s."""
    cfg = load_config(TINY, [f"run.output_dir={parent}", f"run.name={name}", *overrides])
    run = Path(parent) / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    lines = [
        json.dumps(record(cfg, i, t, sum(step_times[:i]), memory_gib + 0.01 * i, 7.6 - 0.05 * i))
        for i, t in enumerate(step_times, 1)
    ]
    text = "\n".join(lines) + "\n"
    if truncate:
        text += lines[-1][: len(lines[-1]) // 2]
    (run / "metrics.jsonl").write_text(text)
    return run
