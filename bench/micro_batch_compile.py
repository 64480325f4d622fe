"""`make bench` phase 10: compile seconds against the micro-batch count, MindScale vs MindFormers.

    python bench/micro_batch_compile.py [--micro 8 64 256] [--json] [--markdown]

The shipped pipeline configs run 64 to 256 micro batches a step, and a step's graph holds every one of
them, so that is where a user pays the compile at every launch and restart. On the llama2_13b layout
(dp4·pp4, the widths of bench/dryrun_compare.py), rank 0 (the first stage) of each stack's training step
is compiled by MindSpore's dry run with only `parallel.micro_batch_num` changed: MindScale's worker
(mindscale/launch/dryrun_worker.py) against MindFormers 1.9's (bench/mf_dryrun.py), one compile at a
time, the two stacks alternating at each count so that both see the same host. The dry run compiles and
runs nothing: these are host-side compile seconds of this machine, not an Ascend measurement.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from bench.data_index import phase_main
from bench.dryrun_compare import LAYOUTS, TIMEOUT_S, WORKERS, overrides
from mindscale.config import REPO_ROOT, load_config
from mindscale.launch.dryrun_ranks import Job, compile_ranks, for_ascend

LAYOUT = LAYOUTS[0]  # llama2_13b: dp4·pp4
MICRO = (8, 64, 256)
TARGET_EACH, TARGET_AT_MOST = 1.0, 0.8  # issue 28: <= 1.0x MindFormers at every count, <= 0.8x at the largest


def compile_seconds(worker: str, sets: list[str], log_dir: Path) -> dict:
    """One stack's rank 0 compiled under the dry run: {compile_s} or {error}."""
    cfg, _ = for_ascend(load_config(REPO_ROOT / LAYOUT, sets))
    job = Job(
        config=str(REPO_ROOT / LAYOUT),
        overrides=tuple(sets),
        log_dir=log_dir,
        timeout=TIMEOUT_S,
        worker=worker,
        collectives=False,
    )
    report = next(iter(compile_ranks(cfg, job, [0], workers=1)))
    return {"compile_s": report["compile_s"]} if report["compiled"] else {"error": report.get("error")}


def run(log=print, micro=MICRO) -> dict:
    base = [s for s in overrides(LAYOUT) if not s.startswith("parallel.micro_batch_num=")]
    points = []
    with tempfile.TemporaryDirectory(prefix="mindscale-micro-compile-") as tmp:
        for i, count in enumerate(micro):
            sets = base + [f"parallel.micro_batch_num={count}"]
            point = {"micro_batches": count, "load_1m": os.getloadavg()[0]}
            order = list(WORKERS.items()) if i % 2 == 0 else list(WORKERS.items())[::-1]
            for system, worker in order:
                log(f"micro-batch compile: {system} at {count} micro batches")
                folder = Path(tmp) / f"{system}-{count}"
                folder.mkdir()
                point[system] = compile_seconds(worker, sets, folder)
            points.append(point)
    return {"config": LAYOUT, "overrides": base, "points": points}


def ratio(point: dict) -> float | None:
    ours, peer = point["mindscale"], point["mindformers"]
    return ours["compile_s"] / peer["compile_s"] if "compile_s" in ours and "compile_s" in peer else None


def targets(data: dict) -> tuple[str, str, bool]:
    """(target, measured ratios, met): every count at most TARGET_EACH, the largest at most TARGET_AT_MOST."""
    ratios = [ratio(p) for p in data["points"]]
    met = all(r is not None for r in ratios) and all(r <= TARGET_EACH for r in ratios) and ratios[-1] <= TARGET_AT_MOST
    shown = ", ".join(
        f"{p['micro_batches']}: {r:.2f}×" if r is not None else f"{p['micro_batches']}: failed"
        for p, r in zip(data["points"], ratios)
    )
    return (
        (
            f"MindScale ÷ MindFormers compile ≤ {TARGET_EACH}× at every micro-batch count and ≤ {TARGET_AT_MOST}× "
            f"at {data['points'][-1]['micro_batches']}"
        ),
        shown,
        met,
    )


def chart(data: dict) -> list[str]:
    """The curve as a Mermaid xychart (GitHub renders it; the table below carries the same numbers)."""
    points = [p for p in data["points"] if ratio(p) is not None]
    top = max(max(p["mindscale"]["compile_s"], p["mindformers"]["compile_s"]) for p in points)
    line = lambda system: ", ".join(f"{p[system]['compile_s']:.1f}" for p in points)  # noqa: E731
    return [
        "```mermaid",
        "xychart-beta",
        '    title "Compile seconds of rank 0 against micro batches a step (first line MindScale, second MindFormers)"',
        "    x-axis \"micro batches\" [" + ", ".join(str(p["micro_batches"]) for p in points) + "]",
        f'    y-axis "compile s" 0 --> {top * 1.1:.0f}',
        f"    line [{line('mindscale')}]",
        f"    line [{line('mindformers')}]",
        "```",
    ]


def section(results: dict) -> list[str]:
    """BENCHMARKS.md section 10 (empty without results)."""
    data = results.get("micro_batch_compile")
    if not data:
        return []
    rows = []
    for p in data["points"]:
        cells = [f"{p[s]['compile_s']:.1f}" if "compile_s" in p[s] else f"failed: `{p[s]['error']}`" for s in WORKERS]
        r = ratio(p)
        rows.append(
            f"| {p['micro_batches']} | {cells[0]} | {cells[1]} | {'' if r is None else f'{r:.2f}×'} "
            f"| {p['load_1m']:.1f} |"
        )
    label, shown, met = targets(data)
    sets = " ".join(f"`{s}`" for s in data["overrides"])
    return [
        "## 10. Compile time vs micro batches (dry run, rank 0 of llama2_13b's layout)",
        "",
        f"`{data['config']}`'s layout (dp4·pp4) at the widths of section 6 ({sets}), only "
        "`parallel.micro_batch_num` changed; rank 0 of each stack's training step compiled by MindSpore's dry "
        "run, one compile at a time, the stacks alternating (`bench/micro_batch_compile.py`). Host-side "
        "compile seconds of this 2-core machine; a dry run runs nothing on a device.",
        "",
        *(chart(data) if any(ratio(p) is not None for p in data["points"]) else []),
        "",
        "| micro batches | MindScale s | MindFormers s | MindScale ÷ MindFormers | host load |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Target (issue 28): {label} ({shown}): {'met' if met else 'NOT met'}.",
        "",
        "Command: `python bench/micro_batch_compile.py --micro "
        + " ".join(str(p["micro_batches"]) for p in data["points"])
        + "`.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    return phase_main(
        argv,
        __doc__,
        "micro_batch_compile",
        section,
        lambda parser: parser.add_argument("--micro", type=int, nargs="+", default=list(MICRO)),
        {},
        lambda a, log: run(log, a.micro),
    )


if __name__ == "__main__":
    sys.exit(main())
