"""MindSpore's dry run of chosen ranks of a config, each compiled in its own process, next to what the
planner says of the same ranks (tools/dryrun.py prints it; docs/dryrun.md says what a dry run does and
does not verify).

Each rank runs mindscale.launch.dryrun_worker (the per-rank worker) with MS_SIMULATION_LEVEL=0 and, where CANN
is not installed, the stand-in libraries of mindscale.launch.standins, in a process forked from one that
imported them once (mindscale.launch.dryrun_forks). A rank's report is the worker's
JSON, or {"compiled": False, "error": ...} when its process failed; a compiled one gets `planned`: the
planner's bytes for that rank's stage and its predicted communication, with ratios to the compiled ones.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mindscale.config import REPO_ROOT, Config, ConfigError, Layout
from mindscale.io import CheckpointError
from mindscale.launch.dryrun_memory import reserve
from mindscale.launch.standins import cann_lib64, dryrun_environment, libgomp
from mindscale.perf import planner
from mindscale.progress import Progress

DEFAULT_TIMEOUT_S = 3600
ASCEND = "run.device_target=Ascend"  # the dry run compiles for Ascend whatever the host
PARALLEL_ERROR = re.compile(r"^\[ERROR\] PARALLEL\([^\]]*\] [^\]]*\] (.*)$", re.M)
# MindSpore's Ascend plugin complains about CANN's Python packages on a host without them: harmless here
NOISE = re.compile(r"WARNING|No module named 'te'|relies on whl package \"te\"|Cannot find opp path")


@dataclass(frozen=True)
class Job:
    """What every rank's compile process is given."""

    config: str  # the YAML file as named on the command line
    overrides: tuple[str, ...]  # --set assignments
    log_dir: Path  # dryrun_forks.log, and each rank's dryrun_rank<R>.log and rank<R>/ (its
    # working folder, and report.json: what it printed)
    packed: bool = False  # inputs carry segment_ids (packed SFT data)
    collectives: bool = True  # dump the compiled graph to read its collectives
    timeout: float = DEFAULT_TIMEOUT_S
    worker: str = "mindscale.launch.dryrun_worker"  # the module compiling a rank (bench/mf_dryrun.py: MindFormers')
    ir_dir: Path | None = None  # keep each rank's validate IR in <ir_dir>/rank<R> (default: read, then deleted)
    # MindSpore's compile cache in this folder (bench/compile_cache.py measures it); None: off, whatever the
    # environment says, because a rank loaded from the cache runs none of the parallel passes a dry run checks
    compile_cache: Path | None = None
    # "plan": MindSpore's level-1 dry run, the rank's device-memory plan (mindscale.launch.dryrun_memory); "run":
    # and one step executed (the rank's parameters are then allocated on the host)
    memory: str | None = None


def for_ascend(cfg: Config) -> tuple[Config, Layout]:
    """`cfg` as the worker compiles it (run.device_target=Ascend) and its layout; a hardware profile
    that is not Ascend's is refused."""
    cfg = planner.with_overrides(cfg, [ASCEND])
    if cfg.hardware.device_target != "Ascend":
        raise ConfigError(
            f"hardware={cfg.hardware.name!r}: the dry run compiles for Ascend; add --set "
            "hardware=ascend910b (or ascend910a)"
        )
    return cfg, Layout.of(cfg, "Ascend")


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
        raise ConfigError(f"--ranks {spec}: use first,last, stages or a list of ranks like 0,7") from None
    wrong = [r for r in ranks if not 0 <= r < layout.devices]
    if wrong:
        raise ConfigError(
            f"--ranks {spec}: rank {wrong[0]} is outside 0..{layout.devices - 1} (the config's "
            f"{layout.devices} devices)"
        )
    return list(dict.fromkeys(ranks))  # a rank named twice is compiled once


def ring_send_bytes(row: dict) -> float:
    """Bytes one rank sends for a collective in a ring (the planner's unit)."""
    n, size, kind = row["group_size"], row["bytes"], row["kind"]
    if n <= 1 or kind == "Receive":
        return 0.0
    if kind == "Send":
        return float(size)
    factor = 2 * (n - 1) / n if kind == "AllReduce" else (n - 1) / n
    return factor * size


def planned(cfg: Config, report: dict) -> dict:
    """The planner's per-rank bytes for this rank's stage next to the compiled ones."""
    stage = report["stage"]
    memory = planner.stage_memory(cfg, stage)
    comm = planner.communication(cfg, stage)
    compiled_comm = sum(ring_send_bytes(row) for row in report["collectives"])
    out = {key: memory[key] for key in ("weights", "grads", "optimizer")}
    shapes = planner.stored_shapes(cfg, stage)
    weights = {p.name for p in planner.parameter_slices(cfg)}
    compiled = {
        name: tuple(shape)
        for name, shape in report["local_shapes"].items()
        if name.split(".", 1)[0] in ("adam_m", "adam_v", "accu_grads") or name in weights
    }
    out["shape_mismatches"] = {
        name: [list(compiled.get(name, ())), list(shapes.get(name, ()))]
        for name in sorted(set(compiled) | set(shapes))
        if compiled.get(name) != shapes.get(name)
    }
    out["comm_bytes_per_step"] = comm["total"]
    out["compiled_comm_bytes_per_step"] = compiled_comm
    out["comm_ratio"] = compiled_comm / comm["total"] if comm["total"] else None
    if report.get("device_memory"):  # the planner's device memory inside MindSpore's pool, next to MindSpore's
        out["device_memory_bytes"] = memory["total"] - memory["reserve"]
        out["device_memory_ratio"] = out["device_memory_bytes"] / report["device_memory"]["peak_bytes"]
    return out


def compiler_reason(log: str) -> str | None:
    """The first reason MindSpore's parallel compiler logged (its exception names only the op)."""
    match = PARALLEL_ERROR.search(log)
    return match.group(1).strip() if match else None


def shared_environment(job: Job, devices: int) -> dict:
    """The environment every rank of the job shares (each child takes it, and the process they are forked from
    is started with its STARTUP variables: dryrun_forks.py); each child adds its own RANK_ID and
    MS_DEV_SAVE_GRAPHS_PATH."""
    env = dryrun_environment(dict(os.environ), 0, devices, level=1 if job.memory else 0)
    if job.memory:  # SOMAS writes its plan (rank_<R>/Ascend_somas_tensor_offset_<graph>.ir) with the tracker on
        env["MS_ALLOC_CONF"] = "memory_tracker:True"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(
        {"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": str(job.compile_cache)}
        if job.compile_cache
        else {"MS_COMPILER_CACHE_ENABLE": "0"}
    )
    if job.collectives:  # the compiled graph as text: MindSpore writes only this pass's IR
        env.update({"MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_DUMP_IR_PASSES": "validate"})
    return env


def rank_report(job: Job, rank: int, returncode: int, stdout: str) -> dict:
    """A rank's report from what its process printed and logged, or why the process failed. Bad input the
    worker found comes back as {"compiled": False, "rank": rank, "bad_input": <its one line>}."""
    log = job.log_dir / f"dryrun_rank{rank}.log"
    text = log.read_text()
    if returncode == -signal.SIGALRM:
        return {"compiled": False, "error": f"compile did not finish in {job.timeout} s (log {log})", "rank": rank}
    if returncode == 2:  # bad input the worker found: reported by the caller, in one line
        said = [line for line in text.splitlines() if line.startswith("error: ")]
        return {"compiled": False, "rank": rank, "bad_input": (said or ["error: bad input"])[-1][len("error: ") :]}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines and returncode == 0:
        report = json.loads(lines[-1])
        reason = compiler_reason(text)
        if not report["compiled"] and reason:
            report["error"] += f"; {reason}"
        return report
    tail = [line for line in text.splitlines() if line.strip() and not NOISE.search(line)][-3:]
    cause = (
        (f"signal {-returncode}" + (" (SIGKILL: most likely out of host memory)" if returncode == -9 else ""))
        if returncode < 0
        else f"exit {returncode}"
    )
    return {
        "compiled": False,
        "error": f"the compile process ended with {cause}: {' | '.join(tail)} (log {log})",
        "rank": rank,
    }


# the variables a process reads before or while it imports MindSpore (the loader's, Python's, glog's and
# MindSpore's): a fork server started with other values of these is not reused (dryrun_forks.py)
STARTUP = ("LD_", "PYTHON", "GLOG_", "MS_", "ASCEND_", "HCCL_", "OMP_")
_idle_servers: dict[tuple, list[subprocess.Popen]] = {}
_servers: set[subprocess.Popen] = set()


def stop_server(proc: subprocess.Popen) -> None:
    """End a fork server and every compile it runs (its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        stream.close()
    _servers.discard(proc)


@atexit.register
def stop_servers() -> None:
    for proc in list(_servers):
        stop_server(proc)


def fork_server(worker: str, env: dict, log: Path) -> tuple[tuple, subprocess.Popen]:
    """An idle fork server of `worker` started with `env`'s start-up variables, or a new one whose imports log
    to `log`. (A worker's imports stay in its server: MindFormers' are not forked into MindScale's ranks.)"""
    key = (worker, *sorted((k, v) for k, v in env.items() if k.startswith(STARTUP)))
    idle = _idle_servers.setdefault(key, [])
    while idle:
        proc = idle.pop()
        if proc.poll() is None:
            return key, proc
        stop_server(proc)
    with open(log, "a") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mindscale.launch.dryrun_forks"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    _servers.add(proc)
    return key, proc


def forked_ranks(job: Job, ranks: list[int], devices: int, workers: int) -> Iterator[dict]:
    """Each rank's report, in the order the ranks finish: every rank a child of a process that imported
    MindSpore and the worker once (mindscale.launch.dryrun_forks), `workers` compiling at once. The process
    serves the next job with the same start-up variables; one that stops early is ended with its compiles."""
    scratch = Path(tempfile.mkdtemp(prefix="mindscale-ir-"))
    log = job.log_dir / "dryrun_forks.log"
    spec = {
        "worker": job.worker,
        "jobs": workers,
        "timeout": job.timeout,
        "env": shared_environment(job, devices),
        "log": str(log),
        "ranks": [],
        "argv": [
            "--config",
            str(Path(job.config).resolve()),
            *[x for o in [*job.overrides, ASCEND] for x in ("--set", o)],
            *(["--packed"] if job.packed else []),
            *(["--run-step"] if job.memory == "run" else []),
        ],
    }
    for index, rank in enumerate(ranks):
        workdir = job.log_dir / f"rank{rank}"  # MindSpore writes what it dumps on a failure here (analyze_fail.ir)
        workdir.mkdir(exist_ok=True)
        ir = job.ir_dir / f"rank{rank}" if job.ir_dir else scratch / f"rank{rank}"
        own = {"RANK_ID": str(rank), **({"MS_DEV_SAVE_GRAPHS_PATH": str(ir)} if job.collectives else {})}
        files = {"stdout": workdir / "report.json", "log": job.log_dir / f"dryrun_rank{rank}.log"}
        for path in files.values():  # empty before the compile: a child that fails early, or a reused --log-dir
            path.write_text("")
        spec["ranks"].append({"index": index, "env": own, "cwd": str(workdir), **{k: str(v) for k, v in files.items()}})
    log.write_text("")
    key, proc = fork_server(job.worker, spec["env"], log)
    reported, done = set(), False
    try:
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        for message in (json.loads(line) for line in proc.stdout if line.startswith("{")):
            if message.get("done"):
                done = True
                break
            index = message["index"]
            reported.add(index)
            shutil.rmtree(scratch / f"rank{ranks[index]}", ignore_errors=True)
            stdout = Path(spec["ranks"][index]["stdout"]).read_text()
            yield {"index": index, **rank_report(job, ranks[index], message["returncode"], stdout)}
    except BrokenPipeError:  # it died before reading the job: reported below
        pass
    finally:  # a caller that stops early (bad input), or a process that died, leaves no compile running
        if done:
            _idle_servers[key].append(proc)
        else:
            stop_server(proc)
        shutil.rmtree(scratch, ignore_errors=True)
    if done:
        return
    tail = [line for line in log.read_text().splitlines() if line.strip() and not NOISE.search(line)][-3:]
    ended = (
        f"did not import MindSpore in {job.timeout} s"
        if proc.returncode == -signal.SIGALRM
        else f"ended with exit {proc.returncode}"
    )
    for index in sorted(set(range(len(ranks))) - reported):
        yield {
            "index": index,
            "compiled": False,
            "rank": ranks[index],
            "error": f"the dry-run process {ended} before compiling this rank"
            f"{': ' + ' | '.join(tail) if tail else ''} (log {log})",
        }


def compile_ranks(cfg: Config, job: Job, ranks: list[int], workers: int = 1) -> Iterator[dict]:
    """Each rank's report, in the order of `ranks`, `workers` compiling at once; `cfg` as `for_ascend`
    returns it. The stand-ins are built (once) first; bad input a worker found raises ConfigError."""
    cann_lib64()  # StandinError (one line) when a tool is missing
    libgomp()
    devices = Layout.of(cfg, "Ascend").devices
    finished, following = {}, 0
    with contextlib.closing(forked_ranks(job, ranks, devices, workers)) as reports:  # bad input stops the rest now
        for report in reports:
            finished[report.pop("index")] = report
            while following in finished:
                report = finished.pop(following)
                following += 1
                if "bad_input" in report:
                    raise ConfigError(report["bad_input"])
                if report["compiled"]:
                    if report.get("device_memory"):
                        report["device_memory"]["reserve"] = reserve(cfg)
                    report["planned"] = planned(cfg, report)
                yield report


def size(n: float) -> str:
    """Bytes in the largest binary unit that leaves a number of at least 1, to 4 figures: `1.002 GiB`, `384 KiB`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def line(report: dict) -> str:
    """One rank's report for reading: compiled bytes next to the planner's, the collectives, offload's copies."""
    head = f"rank {report['rank']:>4}  stage {report.get('stage', '?')}"
    if not report["compiled"]:
        return f"{head}  FAILED  {report['error']}"
    b, p = report["bytes"], report.get("planned", {})
    kinds = {}
    for row in report["collectives"]:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + row["count"]
    comm = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    ratio = p.get("comm_ratio")
    out = sum(c["bytes"] for c in report.get("offload_copies", []) if c["to"] == "CPU")
    return (
        f"{head}  compiled in {report['compile_s']:.1f} s (host peak {report['host_peak_rss_gib']:.1f} GiB)  "
        f"weights {size(b['weights'])}, grads {size(b['grads'])}, optimizer {size(b['optimizer'])} "
        f"(planner {size(p['weights'])}, {size(p['grads'])}, {size(p['optimizer'])})  "
        f"collectives: {comm or 'none'}; sent {p['compiled_comm_bytes_per_step'] / 1e9:.3g} GB/step"
        + (f" ({ratio:.2f}x the planner's)" if ratio else "")
        + (f"; offloaded {size(out)}/step to host memory" if out else "")
        + memory_line(report)
    )


def memory_line(report: dict) -> str:
    """MindSpore's device memory for the rank (level 1), next to the planner's; empty without it."""
    m = report.get("device_memory")
    if not m:
        return ""
    mib = 2**20
    ran = f"; a step executed: {m['executed_peak_bytes'] / mib:,.0f} MiB" if "executed_peak_bytes" in m else ""
    host = (  # activation offload's host copies, which SOMAS lays in its device block (dryrun_memory)
        f" ({m['host_copy_bytes'] / mib:,.0f} MiB of it offload's host copies; {m['device_used_bytes'] / mib:,.0f} "
        "MiB without them)"
        if m.get("host_copy_bytes")
        else ""
    )
    top = ", ".join(f"{t['node'].rsplit('/', 1)[-1]} {t['bytes'] / mib:,.0f}" for t in m["top_tensors"][:3])
    p = report.get("planned", {})
    return (
        f"\n    device memory (MindSpore's plan): used {m['used_bytes'] / mib:,.0f} MiB{host}, with fragments "
        f"{m['peak_bytes'] / mib:,.0f} MiB (persistent {m['persistent_bytes'] / mib:,.0f} + SOMAS block "
        f"{m['somas_bytes'] / mib:,.0f}){ran}; planner "
        f"{p.get('device_memory_bytes', 0) / mib:,.0f} MiB ({p.get('device_memory_ratio', 0):.2f}x); at the peak: "
        f"{top} MiB; not counted: {m['reserve']['not_counted']} "
        f"({m['reserve']['outside_pool_bytes'] / 2**30:g} GiB outside the pool)"
    )


def rank_layouts(config: str, overrides: list[str], cfg: Config, jobs: int, progress: Progress) -> dict[int, dict]:
    """Every rank's compiled layout of each tensor it holds, from a dry run of each stage's first rank."""
    cfg, layout = for_ascend(cfg)
    job = Job(config, tuple(overrides), Path(tempfile.mkdtemp(prefix="mindscale-reshard-")), collectives=False)
    by_rank = {}
    firsts = choose_ranks("stages", layout)
    with contextlib.closing(compile_ranks(cfg, job, firsts, jobs)) as compiled:  # a failed stage stops the rest now
        for report in progress.track(compiled, "compiling the target layout (dry run)", len(firsts), "stage"):
            if not report["compiled"]:
                raise CheckpointError(f"the target layout does not compile: {report['error']}")
            raw = {  # the local shape as the slice's: a 3D weight's map lists a dimension split over two axes flat
                n: (dev, tmap, report["local_shapes"][n], 1, True, group, shape)
                for n, (dev, tmap, shape, group) in report["layouts"].items()
            }
            for rank in layout.stage_ranks(report["stage"]):
                by_rank[rank] = raw
    return by_rank
