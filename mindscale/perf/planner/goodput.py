"""Predicted goodput: the share of a job's wall time that trains, given how often it fails and what a failure
costs, and the checkpoint interval that maximises it (Young 1974, Daly 2006).

A job of N devices fails every M = 1 / (N x hardware.failures_per_device_hour) hours on average. Each checkpoint
blocks training for delta seconds; each failure loses the work since the last checkpoint (half an interval on
average) and the restart R: relaunching (a scheduler's requeue, or the launcher's own restart), compiling the
step again (or loading it from the compile cache), and loading the checkpoint. With tau seconds of training
between checkpoints and failures as a Poisson process, the share of wall time that trains is Daly's

    goodput = tau / (M exp(R / M) (exp((tau + delta) / M) - 1))

(to first order in delta/M and tau/M: tau / (tau + delta) x (1 - (R + (tau + delta) / 2) / M)), and his optimum
interval is tau = sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + delta / 18M) - delta (for
delta < 2M; beyond it, tau = M).

What a checkpoint costs comes from the layout: every rank writes its own slice of the weights and AdamW moments
(the planner's exact per-rank bytes of the busiest stage), all ranks at once. An asynchronous save
(`checkpoint.async_save`) blocks for the copy to host memory (`hardware.host_link_gbps`), and writes in the
background at `hardware.storage_gbps`; a synchronous one blocks for the write. Loading reads at the same storage
bandwidth. Compile seconds are not predicted: COMPILE_S stands in unless the caller has a measured figure
(`tools/plan.py --compile-s`).
"""

from __future__ import annotations

import math

from mindscale.config import Config

# An Ascend host's compile of a full-size step is not predicted here: this is of the order of the 100-760 s a
# full-size rank's dry-run compile takes on a 2-core host (docs/evidence/planner.md), which has no kernels to build.
COMPILE_S = 600.0
RESTARTS = ("scheduler requeue", "in-job restart", "in-job restart + compile cache")
# A relaunch that loads the compiled step from the cache instead of compiling it: the share of the compile it
# takes. Not measured on Ascend: a full-size rank loads in about 1% of its compile under the dry run, which builds
# no kernels, and a tiny model's in 7-9% on CPU (docs/evidence/launch.md); a fifth is the bound.
CACHE_LOAD_FRACTION = 0.2


def checkpoint_bytes(stages: list[dict]) -> float:
    """Bytes the busiest writer writes per checkpoint: a rank's weights and AdamW moments, of the stage holding most."""
    return max(s["weights"] + s["optimizer"] for s in stages)


def mean_time_between_failures_s(cfg: Config) -> float:
    return 3600.0 / (cfg.devices * cfg.hardware.failures_per_device_hour)


def save_blocked_s(cfg: Config, bytes_per_rank: float) -> float:
    """Seconds one checkpoint stops training: the copy to host memory when asynchronous, else the write."""
    hw = cfg.hardware
    if cfg.checkpoint.async_save and hw.host_link_gbps:
        return bytes_per_rank / (hw.host_link_gbps * 1e9)
    return bytes_per_rank / (hw.storage_gbps * 1e9)


def optimal_interval_s(delta: float, mtbf: float) -> float:
    """Daly's optimum seconds of training between checkpoints."""
    if delta >= 2 * mtbf:
        return mtbf
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(delta / (2 * mtbf)) / 3 + delta / (18 * mtbf)) - delta


def goodput(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """The share of wall time that trains (the module's formula)."""
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf))


def restart_s(cfg: Config, path: str, compile_s: float, load_s: float) -> float:
    """Seconds from a failure to training again, by restart path (RESTARTS)."""
    hw = cfg.hardware
    if path == "scheduler requeue":
        return hw.requeue_s + compile_s + load_s
    if path == "in-job restart":
        return hw.relaunch_s + compile_s + load_s
    return hw.relaunch_s + CACHE_LOAD_FRACTION * compile_s + load_s


def predict_goodput(cfg: Config, stages: list[dict], step_s: float, compile_s: float = COMPILE_S) -> dict:
    """Goodput of `cfg` (its stages' memory from memory.stage_memory, its predicted step) at its configured save
    interval and at the optimum, for each restart path."""
    hw = cfg.hardware
    bytes_per_rank = checkpoint_bytes(stages)
    mtbf = mean_time_between_failures_s(cfg)
    delta = save_blocked_s(cfg, bytes_per_rank)
    write_s = bytes_per_rank / (hw.storage_gbps * 1e9)
    load_s = write_s
    tau = optimal_interval_s(delta, mtbf)
    # an asynchronous write still running at the next save blocks it: the interval is at least the write
    tau = max(tau, write_s) if cfg.checkpoint.async_save else tau
    interval_steps = max(1, round(tau / step_s))
    configured = cfg.checkpoint.save_interval
    paths = {}
    for path in RESTARTS:
        restart = restart_s(cfg, path, compile_s, load_s)
        paths[path] = {
            "restart_s": restart,
            "goodput_at_optimum": goodput(interval_steps * step_s, delta, restart, mtbf),
            "goodput_configured": goodput(configured * step_s, delta, restart, mtbf) if configured else None,
        }
    return {
        "failures_per_device_hour": hw.failures_per_device_hour,
        "mtbf_s": mtbf,
        "checkpoint_bytes_per_rank": bytes_per_rank,
        "save_blocked_s": delta,
        "write_s": write_s,
        "load_s": load_s,
        "compile_s": compile_s,
        "optimal_interval_s": tau,
        "save_interval": interval_steps,
        "configured_save_interval": configured,
        "restarts": paths,
    }
