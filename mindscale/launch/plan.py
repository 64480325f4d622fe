"""Launching workers: the logic behind scripts/run_distribute.sh and scripts/run_standalone.sh.

    python -m mindscale.launch distribute CONFIG [NUM_DEVICES] [--set k=v ...] [--dry-run]
    python -m mindscale.launch standalone CONFIG [--set k=v ...]
    python -m mindscale.launch worker ENTRY [ARGS ...]     (what msrun starts in every process)

`distribute` resolves the config, decides the worker layout (devices per node from the hardware,
nodes from MASTER_ADDR / MASTER_PORT / NNODES / NODE_RANK), makes parallel.data_parallel agree
with NUM_DEVICES, and runs msrun under a supervisor. msrun alone reports a dead worker only after
the scheduler's heartbeat timeout (about 40 s here) and does not say which rank died; so every
process runs through `worker`, which pins CPU workers to their own cores, runs the entry point
as a child and records its exit status in `<log_dir>/worker_<rank>.exit`. The supervisor polls
those files (all ranks': on a shared run folder a peer node's failure is seen too) and, on the
first failure, stops the whole process tree at once and names the log.

Environment: MINDSCALE_ENTRY swaps the entry point (default run_train.py; relative paths are from
the repository root) -- a testing and debugging hook. MINDSCALE_CLUSTER_TIMEOUT is msrun's
--cluster_time_out (seconds a worker waits for the others to join; default 7200 on Ascend/GPU, as
MindFormers uses, 600 on CPU). On Ascend, HCCL_CONNECT_TIMEOUT (link set-up) and HCCL_EXEC_TIMEOUT (a
collective waiting for its peers, e.g. while a slower rank still compiles) default to 7200 s; set
them to override.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from mindscale.config import REPO_ROOT, Config, ConfigError, UserError, load_config
from mindscale.cli import OneLineParser, fail
from mindscale.io import write_atomically

CPU_WORKERS_DEFAULT = 2
CLUSTER_TIMEOUT_DEFAULT = {"CPU": 600, "GPU": 7200, "Ascend": 7200}
HCCL_TIMEOUTS_DEFAULT = {"HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "7200"}
MSRUN_PORT_DEFAULT = 8118
POLL_S = 0.5
CORES_ENV = "MINDSCALE_WORKER_CORES"
LOG_DIR_ENV = "MINDSCALE_LOG_DIR"


class LaunchError(UserError):
    """Bad launcher input (arguments, environment, worker count). One line; exit 2."""


# ----------------------------------------------------------------------------------------------
# Where we run: devices on this host, nodes from the environment


def count_devices(device: str, env: dict) -> int:
    """Accelerators of one kind visible here: the *_VISIBLE_DEVICES list, else the device files."""
    visible, pattern = {"Ascend": ("ASCEND_RT_VISIBLE_DEVICES", "/dev/davinci[0-9]*"),
                        "GPU": ("CUDA_VISIBLE_DEVICES", "/dev/nvidia[0-9]*")}[device]
    if env.get(visible, "").strip():
        return len([d for d in env[visible].split(",") if d.strip()])
    return len(glob.glob(pattern))


def detect_device(cfg: Config, env: dict) -> str:
    """run.device_target when it names a backend, else Ascend, then GPU, then CPU by device files."""
    if cfg.run.device_target != "auto":
        return cfg.run.device_target
    for device in ("Ascend", "GPU"):
        if count_devices(device, env):
            return device
    return "CPU"


def _positive_int(name: str, raw: str, hint: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", raw.strip()):
        raise LaunchError(f"{name}={raw!r}: must be a positive integer ({hint})")
    return int(raw)


@dataclass(frozen=True)
class Node:
    """This node's place in the job (same meaning as msrun's flags)."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: single node, pick a free port

    @classmethod
    def from_env(cls, env: dict) -> "Node":
        nnodes = _positive_int("NNODES", env.get("NNODES", "1"), "number of nodes")
        raw_rank = env.get("NODE_RANK", "0")
        if not re.fullmatch(r"[0-9]+", raw_rank.strip()) or int(raw_rank) >= nnodes:
            raise LaunchError(f"NODE_RANK={raw_rank!r}: must be an integer in [0, NNODES={nnodes})")
        if nnodes > 1 and not env.get("MASTER_ADDR"):
            raise LaunchError(f"NNODES={nnodes} needs MASTER_ADDR (address of node 0, reachable from every node)")
        port = env.get("MASTER_PORT")
        if port is not None:
            port = _positive_int("MASTER_PORT", port, "a free TCP port in 1024-65535")
            if not 1024 <= port <= 65535:
                raise LaunchError(f"MASTER_PORT={port}: must be in 1024-65535")
        elif nnodes > 1:
            port = MSRUN_PORT_DEFAULT
        return cls(nnodes, int(raw_rank), env.get("MASTER_ADDR", "127.0.0.1"), port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assign_cores(cores: list[int], workers: int) -> list[int]:
    """One core per local CPU worker: on CPU "a device" is one worker on one core (DESIGN.md §4,
    configs/hardware/cpu.yaml measures the peak on one core). More workers than cores share them
    round-robin; cores beyond the worker count stay idle."""
    return [cores[i % len(cores)] for i in range(workers)]


def fit_data_parallel(cfg: Config, world: int) -> str | None:
    """The `--set parallel.data_parallel=N` that makes the config use `world` devices, or None."""
    p = cfg.parallel
    if p.devices == world:
        return None
    other = p.model_parallel * p.pipeline_stage
    if world % other:
        raise LaunchError(
            f"{world} device(s) cannot hold parallel.model_parallel={p.model_parallel} x "
            f"parallel.pipeline_stage={p.pipeline_stage} = {other}; use a multiple of {other} devices")
    return f"parallel.data_parallel={world // other}"


# ----------------------------------------------------------------------------------------------
# The plan: everything msrun needs, decided before anything starts


@dataclass
class LaunchPlan:
    config: str
    overrides: list[str]
    entry: Path
    device: str
    local_workers: int
    node: Node
    master_port: int
    log_dir: Path
    cluster_timeout: int
    cores: list[int] | None  # CPU: the core of each local worker
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.node.nnodes * self.local_workers

    @property
    def first_rank(self) -> int:
        return self.node.node_rank * self.local_workers

    @property
    def local_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.local_workers)

    def worker_log(self, rank: int) -> Path:
        return self.log_dir / f"worker_{rank}.log"

    def entry_args(self) -> list[str]:
        return [str(self.entry), "--config", self.config, *[a for o in self.overrides for a in ("--set", o)]]

    def msrun_argv(self) -> list[str]:
        argv = ["msrun", "--worker_num", str(self.world), "--local_worker_num", str(self.local_workers),
                "--master_addr", self.node.master_addr, "--master_port", str(self.master_port),
                "--node_rank", str(self.node.node_rank), "--log_dir", str(self.log_dir), "--join", "True",
                "--cluster_time_out", str(self.cluster_timeout),
                # msrun (2.9, _get_node_id_and_log_path) numbers a worker node_rank x local_worker_num +
                # local index and tails the listed ids: the first local worker is this node's first rank
                "--tail_worker_log", str(self.first_rank)]
        if self.device == "Ascend":
            argv += ["--bind_core", "True"]
        # msrun starts `python <args>` from PATH; `-m mindscale.launch worker` wraps the entry point.
        return argv + ["python", "-m", "mindscale.launch", "worker", *self.entry_args()]

    def env(self, base: dict) -> dict:
        """The environment for msrun: this interpreter first on PATH (msrun runs `python`), the repo
        importable, the log dir and the CPU workers' cores for the `worker` wrapper."""
        env = dict(base)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", "")
        env["PYTHONPATH"] = with_repo_on_path(base)
        env[LOG_DIR_ENV] = str(self.log_dir)
        env.setdefault("GLOG_v", "3")  # MindSpore's own log: errors only (startup retries are noise)
        if self.device == "Ascend":
            for name, value in HCCL_TIMEOUTS_DEFAULT.items():
                env.setdefault(name, value)
        if self.cores:
            env[CORES_ENV] = ",".join(map(str, self.cores))
        return env

    def env_changes(self, base: dict) -> dict:
        env = self.env(base)
        return {k: v for k, v in env.items() if base.get(k) != v}


def with_repo_on_path(env: dict) -> str:
    """PYTHONPATH with the repository first (the repo runs from its root, model-zoo style)."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    return os.pathsep.join([str(REPO_ROOT), *parts])


def resolve_entry(env: dict) -> Path:
    raw = env.get("MINDSCALE_ENTRY") or "run_train.py"
    entry = Path(raw) if os.path.isabs(raw) else REPO_ROOT / raw
    if not entry.is_file():
        raise LaunchError(f"MINDSCALE_ENTRY={raw}: no such file (relative paths start at {REPO_ROOT})")
    return entry


def load_resolved(config: str, overrides: list[str]) -> Config:
    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


def plan_distribute(config: str, num_devices: str | None, overrides: list[str], env: dict) -> LaunchPlan:
    """Decide the job. NUM_DEVICES is per node (msrun's local_worker_num); world = NNODES x it."""
    node = Node.from_env(env)
    cfg = load_resolved(config, overrides)
    device = detect_device(cfg, env)
    notes = []
    if num_devices is not None:
        local = _positive_int("NUM_DEVICES", num_devices, "devices (workers) per node, e.g. 2")
        fitted = fit_data_parallel(cfg, node.nnodes * local)
        if fitted:
            notes.append(f"{node.nnodes * local} device(s): adding --set {fitted} "
                         f"(config has parallel.data_parallel={cfg.parallel.data_parallel})")
            overrides = [*overrides, fitted]
            cfg = load_resolved(config, overrides)
    elif device == "CPU":
        local = CPU_WORKERS_DEFAULT
    else:
        local = count_devices(device, env)
        if not local:
            raise LaunchError(f"run.device_target={device} but no {device} devices are visible here; "
                              "pass NUM_DEVICES or fix the device target")
    cores = None
    if device == "CPU":
        available = sorted(os.sched_getaffinity(0))
        cores = assign_cores(available, local)
        if local > len(available):
            notes.append(f"{local} workers share {len(available)} cores: per-device numbers (MFU) will be low")
    timeout = _positive_int("MINDSCALE_CLUSTER_TIMEOUT",
                            env.get("MINDSCALE_CLUSTER_TIMEOUT", str(CLUSTER_TIMEOUT_DEFAULT[device])), "seconds")
    log_dir = (Path(cfg.run.output_dir) / cfg.run.name / "logs").absolute()
    return LaunchPlan(config=config, overrides=list(overrides), entry=resolve_entry(env), device=device,
                      local_workers=local, node=node, master_port=node.master_port or free_port(),
                      log_dir=log_dir, cluster_timeout=timeout, cores=cores, notes=notes)


# ----------------------------------------------------------------------------------------------
# The `worker` wrapper: runs inside every msrun process


def exit_file(log_dir: str | Path, env: dict) -> Path:
    name = "scheduler" if env.get("MS_ROLE") == "MS_SCHED" else f"worker_{env.get('RANK_ID', '0')}"
    return Path(log_dir) / f"{name}.exit"


def pin_to_core(core: int, env) -> None:
    """Keep this process and its children on one core, and OpenMP to one thread. (msrun's own
    --bind_core reads cgroup-v1 cpuset files and the NPU topology, so it is used on Ascend only.)"""
    os.sched_setaffinity(0, [core])
    env["OMP_NUM_THREADS"] = "1"


def run_worker(entry_argv: list[str]) -> int:
    """Run the entry point as a child, forward SIGTERM/SIGINT, record the exit status atomically."""
    if os.environ.get(CORES_ENV) and os.environ.get("MS_ROLE") != "MS_SCHED":
        cores = [int(c) for c in os.environ[CORES_ENV].split(",")]
        local_rank = int(os.environ.get("DEVICE_ID", "0"))  # msrun sets DEVICE_ID to the local rank
        pin_to_core(cores[local_rank % len(cores)], os.environ)
    child = subprocess.Popen([sys.executable, *entry_argv])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    if os.environ.get(LOG_DIR_ENV):
        path = exit_file(os.environ[LOG_DIR_ENV], os.environ)
        write_atomically(path, f"{code}\n")
    return code if code >= 0 else 128 - code


# ----------------------------------------------------------------------------------------------
# The supervisor: msrun under watch


class Interrupted(Exception):
    """Ctrl+C or a scheduler's SIGTERM (e.g. scancel) reached the launcher."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, _frame):
    raise Interrupted(signum)


def exit_files(log_dir: Path) -> dict[Path, int]:
    """Exit-status files present now, with their modification times."""
    found = {}
    for path in log_dir.glob("*.exit"):
        try:
            found[path] = path.stat().st_mtime_ns
        except FileNotFoundError:
            pass
    return found


def first_failure(plan: LaunchPlan, stale: dict[Path, int]) -> tuple[Path, int] | None:
    """(log file, exit code) of the earliest non-zero exit of any rank or the scheduler. Other
    nodes' files count too when the run folder is shared, so a peer node's dead worker stops this
    node at once; files left by an earlier launch (`stale`, unchanged since we started) do not."""
    candidates = [(plan.log_dir / f"worker_{r}.exit", plan.worker_log(r)) for r in range(plan.world)]
    candidates.append((plan.log_dir / "scheduler.exit", plan.log_dir / "scheduler.log"))
    failed = []
    for status, log in candidates:
        try:
            mtime = status.stat().st_mtime_ns
            code = int(status.read_text())
        except (FileNotFoundError, ValueError):
            continue
        if code and stale.get(status) != mtime:
            failed.append((mtime, log, code))
    return min(failed)[1:] if failed else None


def stop_tree(proc: subprocess.Popen) -> None:
    """kill_tree, uninterruptible: a second Ctrl+C must not cut it short."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill msrun and every process under it (workers run in their own sessions, so a process
    group kill would miss them). msrun is frozen first so it cannot start anything new."""
    try:
        root = psutil.Process(proc.pid)
        root.suspend()
        tree = root.children(recursive=True)
        root.kill()
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=5)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


MINDSPORE_CHATTER = re.compile(r"^\[(INFO|WARNING)\] ")  # printed at exit whatever GLOG_v says


def report_failure(log: Path, code: int) -> int:
    """Show the end of the failed process's log (its error), then one line naming it."""
    name = "the scheduler" if log.stem == "scheduler" else f"rank {log.stem.split('_')[-1]}"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    tail = [line for line in lines if not MINDSPORE_CHATTER.match(line)][-10:]
    if tail:
        print(f"--- last lines of {log} ---", *tail, "---", sep="\n", file=sys.stderr)
    print(f"error: {name} {describe_exit(code)}; see {log}", file=sys.stderr)
    return 2 if code == 2 else 1


def supervise(plan: LaunchPlan, env: dict) -> int:
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    for rank in plan.local_ranks:
        (plan.log_dir / f"worker_{rank}.exit").unlink(missing_ok=True)
    if plan.node.node_rank == 0:
        (plan.log_dir / "scheduler.exit").unlink(missing_ok=True)
    stale = exit_files(plan.log_dir)
    for note in plan.notes:
        print(f"note: {note}", flush=True)
    which = "rank 0" if plan.first_rank == 0 else f"rank {plan.first_rank} (first on this node)"
    print(f"MindScale: {plan.world} worker(s) on {plan.node.nnodes} node(s), {plan.local_workers} here "
          f"({plan.device}); logs in {plan.log_dir}; following the {which} log {plan.worker_log(plan.first_rank)}",
          flush=True)
    proc = subprocess.Popen(plan.msrun_argv(), env=env)
    try:
        while True:
            failure = first_failure(plan, stale)
            if failure:
                stop_tree(proc)
                return report_failure(*failure)
            code = proc.poll()
            if code is not None:
                failure = first_failure(plan, stale)
                if failure:
                    return report_failure(*failure)
                if code:
                    print(f"error: msrun exited with code {code} and no worker reported a failure; "
                          f"see {plan.log_dir}", file=sys.stderr)
                    return 1
                print(f"MindScale: all {plan.local_workers} worker(s) on this node finished; logs in {plan.log_dir}")
                return 0
            time.sleep(POLL_S)
    except Interrupted as exc:
        stop_tree(proc)
        print(f"{signal.Signals(exc.signum).name}: stopped all workers; logs in {plan.log_dir}", file=sys.stderr)
        return 128 + exc.signum


# ----------------------------------------------------------------------------------------------
# Command line


def standalone(args: argparse.Namespace, env: dict) -> typing.NoReturn:
    """One device without msrun: data_parallel set to 1, pinned to one core on CPU, then exec."""
    cfg = load_resolved(args.config, args.overrides)
    fitted = fit_data_parallel(cfg, 1)
    overrides = args.overrides + ([fitted] if fitted else [])
    load_resolved(args.config, overrides)  # the fitted config must still validate (e.g. global batch)
    if detect_device(cfg, env) == "CPU":
        pin_to_core(min(os.sched_getaffinity(0)), env)
    cmd = [sys.executable, str(resolve_entry(env)), "--config", args.config,
           *[a for o in overrides for a in ("--set", o)]]
    os.execve(sys.executable, cmd, {**env, "PYTHONPATH": with_repo_on_path(env)})


def distribute(args: argparse.Namespace, env: dict) -> int:
    plan = plan_distribute(args.config, args.num_devices, args.overrides, env)
    if args.dry_run:
        for note in plan.notes:
            print(f"note: {note}", file=sys.stderr)
        changes = [f"{k}={v}" for k, v in sorted(plan.env_changes(env).items())]
        print(shlex.join(["env", *changes, *plan.msrun_argv()]))
        return 0
    bin_dir = os.path.dirname(sys.executable)
    for tool in ("msrun", "python"):  # msrun starts workers as `python ...` from PATH
        if os.path.dirname(shutil.which(tool, path=plan.env(env)["PATH"]) or "") != bin_dir:
            raise LaunchError(f"no {tool} in {bin_dir}; run with the python that has mindspore "
                              "(PYTHON=.venv/bin/python)")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    return supervise(plan, plan.env(env))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        if len(argv) < 2:
            fail("worker needs the entry point: python -m mindscale.launch worker ENTRY [ARGS ...]")
        return run_worker(argv[1:])
    parser = OneLineParser(prog="python -m mindscale.launch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dist = sub.add_parser("distribute", prog="scripts/run_distribute.sh",
                          help="msrun over all devices of this node (and NNODES nodes)")
    dist.add_argument("config")
    dist.add_argument("num_devices", nargs="?", help="devices (workers) per node; default: all NPUs/GPUs, 2 on CPU")
    dist.add_argument("--dry-run", action="store_true", help="print the msrun command, start nothing")
    alone = sub.add_parser("standalone", prog="scripts/run_standalone.sh", help="one device, no msrun")
    alone.add_argument("config")
    for p in (dist, alone):
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        return {"distribute": distribute, "standalone": standalone}[args.command](args, dict(os.environ))
    except LaunchError as exc:
        fail(str(exc))

