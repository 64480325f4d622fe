"""Compile a config's sharded training graph for chosen ranks with MindSpore's dry run, on any host.

    python tools/dryrun.py --config configs/llama2/llama2_70b.yaml                 # rank 0 and the last stage's first rank
    python tools/dryrun.py --config C --rank 5 [--set k=v ...] [--json]
    python tools/dryrun.py --config C --ranks stages                               # the first rank of every stage
    python tools/dryrun.py --config C --ranks 0,7 --packed                         # packed SFT inputs (segment_ids)

Each rank compiles in its own process (mindscale.launch.dryrun) with MS_SIMULATION_LEVEL=0 and, where CANN
is not installed, the stand-in libraries of mindscale.launch.standins (built once; needs gcc and binutils).
A dry run verifies that MindSpore's parallel compiler accepts the graph (strategies, redistribution,
pipeline split, optimizer shard) and reports the compiled layouts and collectives. It does not
verify kernels, numerics, speed or device memory (docs/dryrun.md).

--json prints one JSON object per rank, one per line: compiled, error, rank, stage, devices,
local_shapes, bytes, groups, collectives, compile_s, host_peak_rss_gib, and `planned` (the planner's
bytes for that rank's stage and its predicted communication, with ratios to the compiled ones).
Exit status: 0 every rank compiled, 1 a compile failed, 2 bad input.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mindscale.perf import planner
from mindscale.config import REPO_ROOT, ConfigError
from mindscale.cli import OneLineParser, add_config_arguments, config_from_args, fail
from mindscale.config import Layout

GIB = 2 ** 30
DEFAULT_TIMEOUT_S = 3600
# MindSpore's Ascend plugin complains about CANN's Python packages on a host without them: harmless here
PARALLEL_ERROR = re.compile(r"^\[ERROR\] PARALLEL\([^\]]*\] [^\]]*\] (.*)$", re.M)
NOISE = re.compile(r"WARNING|No module named 'te'|relies on whl package \"te\"|Cannot find opp path")


def choose_ranks(spec: str, layout: Layout) -> list[int]:
    """`first,last` (rank 0 and the last stage's first rank), `stages` (every stage's first rank) or a
    comma-separated list of ranks."""
    firsts = [layout.stage_ranks(stage)[0] for stage in range(layout.pp)]
    if spec == "first,last":
        return sorted({firsts[0], firsts[-1]})
    if spec == "stages":
        return firsts
    try:
        ranks = [int(r) for r in spec.split(",")]
    except ValueError:
        fail(f"--ranks {spec}: use first,last, stages or a list of ranks like 0,7")
    wrong = [r for r in ranks if not 0 <= r < layout.devices]
    if wrong:
        fail(f"--ranks {spec}: rank {wrong[0]} is outside 0..{layout.devices - 1} (the config's "
             f"{layout.devices} devices)")
    return ranks


def ring_send_bytes(row: dict) -> float:
    """Bytes one rank sends for a collective in a ring (the planner's unit)."""
    n, size, kind = row["group_size"], row["bytes"], row["kind"]
    if n <= 1 or kind == "Receive":
        return 0.0
    if kind == "Send":
        return float(size)
    factor = 2 * (n - 1) / n if kind == "AllReduce" else (n - 1) / n
    return factor * size


def planned(cfg, report: dict) -> dict:
    """The planner's per-rank bytes for this rank's stage next to the compiled ones."""
    stage = report["stage"]
    memory = planner.stage_memory(cfg, stage)
    comm = planner.communication(cfg, stage)
    compiled_comm = sum(ring_send_bytes(row) for row in report["collectives"])
    out = {key: memory[key] for key in ("weights", "grads", "optimizer")}
    shapes = planner.stored_shapes(cfg, stage)
    weights = {p.name for p in planner.parameter_slices(cfg)}
    compiled = {name: tuple(shape) for name, shape in report["local_shapes"].items()
                if name.split(".", 1)[0] in ("adam_m", "adam_v", "accu_grads") or name in weights}
    out["shape_mismatches"] = {name: [list(compiled.get(name, ())), list(shapes.get(name, ()))]
                               for name in sorted(set(compiled) | set(shapes)) if compiled.get(name) != shapes.get(name)}
    out["comm_bytes_per_step"] = comm["total"]
    out["compiled_comm_bytes_per_step"] = compiled_comm
    out["comm_ratio"] = compiled_comm / comm["total"] if comm["total"] else None
    return out


def standins_or_fail() -> None:
    """Build the stand-ins once (and find libgomp) before the ranks start; a missing tool is one line."""
    from mindscale.launch.standins import StandinError, cann_lib64, libgomp
    try:
        cann_lib64()
        libgomp()
    except StandinError as exc:
        fail(str(exc))


def run_rank(args, rank: int, devices: int, log_dir: Path) -> dict:
    from mindscale.launch.standins import dryrun_environment
    env = dryrun_environment(dict(os.environ), rank, devices)
    with tempfile.TemporaryDirectory(prefix=f"mindscale-ir-rank{rank}-") as ir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        if not args.no_collectives:  # the compiled graph as text: MindSpore writes only this pass's IR
            env.update({"MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_SAVE_GRAPHS_PATH": ir, "MS_DEV_DUMP_IR_PASSES": "validate"})
        argv = [sys.executable, "-m", "mindscale.launch.dryrun", "--config", str(Path(args.config).resolve()),
                *[x for o in [*args.overrides, "run.device_target=Ascend"] for x in ("--set", o)]]
        if args.packed:
            argv.append("--packed")
        log = log_dir / f"dryrun_rank{rank}.log"
        workdir = log_dir / f"rank{rank}"  # MindSpore writes what it dumps on a failure here (analyze_fail.ir)
        workdir.mkdir(exist_ok=True)
        try:
            with open(log, "w") as err:
                proc = subprocess.run(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                      timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"compiled": False, "error": f"compile did not finish in {args.timeout} s (log {log})",
                    "rank": rank}
    text = log.read_text()
    if proc.returncode == 2:  # bad input the worker found: reported by the main thread, in one line
        said = [line for line in text.splitlines() if line.startswith("error: ")]
        return {"compiled": False, "rank": rank, "bad_input": (said or ["error: bad input"])[-1][len("error: "):]}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines and proc.returncode == 0:
        report = json.loads(lines[-1])
        reason = compiler_reason(text)
        if not report["compiled"] and reason:
            report["error"] += f"; {reason}"
        return report
    tail = [line for line in text.splitlines() if line.strip() and not NOISE.search(line)][-3:]
    cause = (f"signal {-proc.returncode}" + (" (SIGKILL: most likely out of host memory)" if proc.returncode == -9
                                              else "")) if proc.returncode < 0 else f"exit {proc.returncode}"
    return {"compiled": False, "error": f"the compile process ended with {cause}: {' | '.join(tail)} (log {log})",
            "rank": rank}


def compiler_reason(log: str) -> str | None:
    """The first reason MindSpore's parallel compiler logged (its exception names only the op)."""
    match = PARALLEL_ERROR.search(log)
    return match.group(1).strip() if match else None


def line(report: dict) -> str:
    head = f"rank {report['rank']:>4}  stage {report.get('stage', '?')}"
    if not report["compiled"]:
        return f"{head}  FAILED  {report['error']}"
    b, p = report["bytes"], report.get("planned", {})
    kinds = {}
    for row in report["collectives"]:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + row["count"]
    comm = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    ratio = p.get("comm_ratio")
    return (f"{head}  compiled in {report['compile_s']:.1f} s (host peak {report['host_peak_rss_gib']:.1f} GiB)  "
            f"weights {b['weights'] / GIB:.3f} GiB, grads {b['grads'] / GIB:.3f}, optimizer {b['optimizer'] / GIB:.3f} "
            f"(planner {p['weights'] / GIB:.3f}, {p['grads'] / GIB:.3f}, {p['optimizer'] / GIB:.3f})  "
            f"collectives: {comm or 'none'}; sent {p['compiled_comm_bytes_per_step'] / 1e9:.3g} GB/step"
            + (f" ({ratio:.2f}x the planner's)" if ratio else ""))


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="compile this rank")
    which.add_argument("--ranks", default="first,last", help="first,last (default), stages, or a list like 0,7")
    parser.add_argument("--packed", action="store_true", help="inputs carry segment_ids (packed SFT data)")
    parser.add_argument("--no-collectives", action="store_true",
                        help="do not dump the compiled graph to read its collectives (saves time and memory)")
    parser.add_argument("--jobs", type=int, default=1, help="ranks compiled at once (each in its own process)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per rank")
    parser.add_argument("--log-dir", help="where each rank's compile log goes (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank, one per line")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    args.overrides = list(args.overrides)
    try:
        cfg = planner.with_overrides(cfg, ["run.device_target=Ascend"])
    except ConfigError as exc:
        fail(str(exc))
    if cfg.hardware.device_target != "Ascend":
        fail(f"hardware={cfg.hardware.name!r}: the dry run compiles for Ascend; add --set hardware=ascend910b "
             "(or ascend910a)")
    layout = Layout.of(cfg, "Ascend")
    ranks = [args.rank] if args.rank is not None else choose_ranks(args.ranks, layout)
    if args.jobs < 1:
        fail(f"--jobs {args.jobs}: must be >= 1")
    if args.rank is not None and not 0 <= args.rank < layout.devices:
        fail(f"--rank {args.rank} is outside 0..{layout.devices - 1} (the config's {layout.devices} devices)")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mindscale-dryrun-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    standins_or_fail()
    failed = False
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for report in pool.map(lambda rank: run_rank(args, rank, layout.devices, log_dir), ranks):
            if "bad_input" in report:
                fail(report["bad_input"])
            if report["compiled"]:
                report["planned"] = planned(cfg, report)
            failed |= not report["compiled"]
            print(json.dumps(report) if args.json else line(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
