"""The compile cache (run.compile_cache, mindscale/train/loop/compile_cache.py) measured: step compile
seconds of a first launch against a relaunch and a --max-restarts restart, and under the dry run.

    python bench/compile_cache.py [--json]                       # both parts
    python bench/compile_cache.py --part cpu|dryrun [--micro 8,128,256]
    python bench/compile_cache.py --part full [--config configs/llama2/llama2_13b.yaml]

cpu: the 2-worker data-parallel demo (scripts/run_distribute.sh configs/tiny/llama_tiny.yaml 2, 6 steps,
a checkpoint every 2). (a) A launch whose rank 1 SIGKILLs itself before step 4 (it compiles; the job
fails), then the same command again (a relaunch: it resumes from step 2 in the same run folder);
(b) in a fresh run folder the same fault under --max-restarts 1 (the restart relaunches every worker).
Each attempt's step compile is each rank's `compile_s` in its heartbeat ledger (the compile before its
first step, cache load included); the losses of the relaunch are compared with those the killed launch
logged for the same steps.

dryrun: tools/dryrun.py's rank 0 of the llama2_13b layout (dp4 pp4, bench/dryrun_compare.py's scaled
widths) at each micro-batch count, compiled twice with MindSpore's cache on in a temporary folder
(dryrun_ranks.Job.compile_cache): `compile_s` of each. The dry run compiles and runs nothing;
tools/dryrun.py turns the cache off (a dry run exists to compile).

full: a shipped config at full size, its first and last stage's first rank, each compiled and then loaded from the
cache under the dry run (one rank at a time): compile seconds both ways, and whether the loaded step's parameter
layouts and local shapes equal the compiled ones name by name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mindscale.cli import OneLineParser
from mindscale.config import REPO_ROOT, load_config
from mindscale.launch.dryrun_ranks import Job, compile_ranks, for_ascend
from mindscale.train.resilience.heartbeat import heartbeat_file

TINY = "configs/tiny/llama_tiny.yaml"
CPU_SETS = [
    "train.steps=6",
    "train.micro_batch_size=2",
    "checkpoint.save_interval=2",
    "checkpoint.keep_last=3",
    "train.log_interval=1",
]
LAYOUT = "configs/llama2/llama2_13b.yaml"


def distribute(out: Path, name: str, *args: str, fault: str | None = None) -> dict:
    """One scripts/run_distribute.sh job: its exit status and each rank's last heartbeat ledger."""
    env = {k: v for k, v in os.environ.items() if k != "MINDSCALE_FAULT"}
    if fault:
        env["MINDSCALE_FAULT"] = fault
    sets = [x for o in (f"run.output_dir={out}", f"run.name={name}", *CPU_SETS) for x in ("--set", o)]
    proc = subprocess.run(
        ["bash", "scripts/run_distribute.sh", TINY, "2", *sets, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    logs = out / name / "logs"
    ranks = {}
    for rank in (0, 1):
        record = json.loads(heartbeat_file(logs, rank).read_text())
        ranks[rank] = {"compile_s": round(record["compile_s"], 2), "cache": record["compile_cache"]}
    return {"returncode": proc.returncode, "ranks": ranks}


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of metrics.jsonl, the last record of a step winning (a relaunch redoes lost steps)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def cpu_part() -> dict:
    out = Path(tempfile.mkdtemp(prefix="mindscale-ccache-"))
    try:
        killed = distribute(out, "relaunch", fault="kill:1:4")
        before = losses(out / "relaunch")
        relaunched = distribute(out, "relaunch")
        after = losses(out / "relaunch")
        same = all(after[s] == before[s] for s in before if s > 2)  # step 3: logged by both launches
        restarted = distribute(out, "restart", "--max-restarts", "1", fault="kill:1:4")
        goodput = json.loads((out / "restart" / "goodput.json").read_text())
        return {
            "first_launch": killed,
            "relaunch": relaunched,
            "relaunch_losses_equal": same,
            "restart": restarted,
            "restart_goodput": {k: goodput[k] for k in ("compile_s", "cache_load_s", "compile_cache")},
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


def dryrun_part(micro: list[int]) -> dict:
    from bench.dryrun_compare import overrides

    rows = {}
    for m in micro:
        sets = (*overrides(LAYOUT), f"parallel.micro_batch_num={m}")
        cfg, _ = for_ascend(load_config(REPO_ROOT / LAYOUT, list(sets)))
        folder = Path(tempfile.mkdtemp(prefix="mindscale-ccache-dry-"))
        job = Job(
            config=str(REPO_ROOT / LAYOUT),
            overrides=sets,
            log_dir=folder,
            collectives=False,
            timeout=3600,
            compile_cache=folder / "cache",
        )
        try:
            times = [next(compile_ranks(cfg, job, [0])) for _ in range(2)]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rows[m] = {
            name: r["compile_s"] if r["compiled"] else r["error"] for name, r in zip(("first_s", "cached_s"), times)
        }
    return rows


def full_size_part(config: str) -> dict:
    """A shipped config at full size, its first and last stage, each compiled and then loaded from the cache:
    compile seconds both ways, and whether the loaded step's layouts (completed from those kept beside the
    cache, compile_cache.completed_layouts) and local shapes equal the compiled ones, parameter by parameter."""
    cfg, layout = for_ascend(load_config(REPO_ROOT / config))
    folder = Path(tempfile.mkdtemp(prefix="mindscale-ccache-full-"))
    job = Job(config=config, overrides=(), log_dir=folder, collectives=False, compile_cache=folder / "cache")
    rows = {}
    try:
        for rank in sorted({0, layout.stage_ranks(layout.pp - 1)[0]}):
            first, loaded = (next(compile_ranks(cfg, job, [rank])) for _ in range(2))
            if not (first["compiled"] and loaded["compiled"]):
                rows[rank] = {"error": first["error"] or loaded["error"]}
                continue
            rows[rank] = {
                "first_s": first["compile_s"],
                "cached_s": loaded["compile_s"],
                "cache": [first["compile_cache"], loaded["compile_cache"]],
                "layouts_equal": first["layouts"] == loaded["layouts"],
                "local_shapes_equal": first["local_shapes"] == loaded["local_shapes"],
                "parameters": len(first["layouts"]),
            }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def micro_counts(raw: str) -> list[int]:
    try:
        counts = [int(m) for m in raw.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: positive integers, comma-separated, e.g. 8,128")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cpu", "dryrun", "both", "full"), default="both")
    parser.add_argument("--config", default=LAYOUT, help="full: the shipped config compiled at full size")
    parser.add_argument(
        "--micro", type=micro_counts, default=[32, 128], help="dry run: micro-batch counts, comma-separated"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = {}
    if args.part in ("cpu", "both"):
        result["cpu"] = cpu_part()
    if args.part in ("dryrun", "both"):
        result["dryrun"] = dryrun_part(args.micro)
    if args.part == "full":
        result["full_size"] = {args.config: full_size_part(args.config)}
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
