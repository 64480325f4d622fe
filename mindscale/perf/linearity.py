"""Multi-device linearity of a device-count sweep: run folders of one config at different device
counts (tools/linearity.py prints it; the definition is in docs/mfu.md).

Throughput of a run = its tokens over its time in the steps after warm-up (mindscale/perf/mfu.py's
`of_run`, docs/mfu.md: what tools/mfu.py prints). With base = the smallest device count, linearity
at N = (throughput_N / N) / (throughput_base / base), which needs the same per-device batch at every N.
The sweep is kept as `RESULT_FILE` in every run folder, where mindscale/perf/compare.py reads it.
"""

from __future__ import annotations

from pathlib import Path

from mindscale.perf.metrics_io import RunDataError, config_differences, load_run, warn_if_truncated
from mindscale.perf.mfu import of_run

# Keys that may differ between the runs of one sweep: the device count, the run's identity, and
# the global batch derived from the device count.
SWEEP_KEYS = ("parallel.data_parallel", "run.name", "run.output_dir", "train.global_batch_size")
RESULT_FILE = "linearity.json"
TARGET = 0.8  # linearity below this is flagged; the seed preset of tools/compare_runs.py judges it too


def sweep(run_dirs: list[str], threshold: float, warmup: int) -> dict:
    """Load, check and measure the runs; returns the JSON-able result."""
    if len(run_dirs) < 2:
        raise RunDataError("linearity needs at least two run folders at different device counts")
    if threshold <= 0:
        raise RunDataError(f"--threshold {threshold}: must be > 0, e.g. 0.8")
    runs = [load_run(d) for d in run_dirs]
    for run in runs:
        warn_if_truncated(run)
    reference = runs[0]
    for run in runs[1:]:
        diff = config_differences(reference.config, run.config, SWEEP_KEYS)
        if diff:
            shown = ", ".join(diff[:4]) + (" ..." if len(diff) > 4 else "")
            raise RunDataError(
                f"{run.path} differs from {reference.path} in {shown}; a linearity sweep "
                "may only change parallel.data_parallel (re-run with the same config)"
            )
        if run.config.train.micro_batch_size != reference.config.train.micro_batch_size:
            raise RunDataError("runs differ in train.micro_batch_size; linearity needs the same per-device batch")
    by_devices: dict[int, object] = {}
    for run in runs:
        n = run.config.devices
        if n in by_devices:
            raise RunDataError(f"{by_devices[n].path} and {run.path} both ran on {n} devices; pass one run per count")
        by_devices[n] = run

    points = []
    for n in sorted(by_devices):
        run = by_devices[n]
        s = of_run(run, warmup)
        points.append(
            {
                "devices": n,
                "run": str(run.path),
                "tokens_per_s": s["tokens_per_s"],
                "tokens_per_s_per_device": s["tokens_per_s"] / n,
                "samples_per_s_per_device": s["samples_per_s_per_device"],
                "step_time_s": s["step_time_s"],
                "records_used": s["records_used"],
            }
        )
    base = points[0]
    for p in points:
        p["linearity"] = p["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
        p["below_threshold"] = p["linearity"] < threshold
    return {
        "base_devices": base["devices"],
        "threshold": threshold,
        "points": points,
        "flagged": [p["devices"] for p in points if p["below_threshold"]],
        "definition": "linearity_N = (tokens_per_s_N / N) / (tokens_per_s_base / base), "
        "same per-device batch, tokens over time of the steps after warm-up",
    }


def plot(result: dict, path: Path) -> None:
    """Per-device throughput and linearity against device count, with the ideal lines, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    n = [p["devices"] for p in points]
    per_device = [p["tokens_per_s_per_device"] for p in points]
    lin = [p["linearity"] for p in points]
    bad = [p["below_threshold"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(n, per_device, "o-", label="measured")
    left.axhline(per_device[0], color="gray", linestyle="--", label="ideal (flat)")
    left.set_ylabel("tokens/s per device")
    left.set_ylim(0, max(per_device) * 1.15)
    right.plot(n, lin, "o-", label="measured")
    right.axhline(1.0, color="gray", linestyle="--", label="ideal")
    right.axhline(result["threshold"], color="red", linestyle=":", label=f"threshold {result['threshold']:g}")
    right.scatter(
        [x for x, b in zip(n, bad) if b],
        [y for y, b in zip(lin, bad) if b],
        s=120,
        facecolors="none",
        edgecolors="red",
        zorder=3,
        label="below threshold",
    )
    for x, y in zip(n, lin):
        right.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    right.set_ylabel("linearity")
    right.set_ylim(0, max(1.1, max(lin) * 1.05))
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("devices")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Linearity (base = {result['base_devices']} device(s))")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(result: dict) -> str:
    """One line per device count, then the definition and the threshold's verdict."""
    lines = [
        f"{'devices':>7} {'tokens/s':>11} {'tok/s/dev':>10} {'samples/s/dev':>13} {'step s':>8} {'linearity':>9}  run"
    ]
    for p in result["points"]:
        flag = "  < threshold" if p["below_threshold"] else ""
        lines.append(
            f"{p['devices']:>7} {p['tokens_per_s']:>11.1f} {p['tokens_per_s_per_device']:>10.1f} "
            f"{p['samples_per_s_per_device']:>13.3f} {p['step_time_s']:>8.4f} {p['linearity']:>9.3f}  "
            f"{p['run']}{flag}"
        )
    lines.append(
        f"{result['definition']}; threshold {result['threshold']:g}: "
        + (f"below at {result['flagged']} devices" if result["flagged"] else "all points meet it")
    )
    return "\n".join(lines)
