"""Launch plans: how many workers on which cores, the msrun command line and its environment, for
scripts/run_distribute.sh (mindscale/launch/__main__.py has the command line, supervisor.py watches
the run, worker.py wraps every process msrun starts).

`plan_distribute` resolves the config, decides the worker layout (devices per node from the hardware,
nodes from MASTER_ADDR / MASTER_PORT / NNODES / NODE_RANK), makes parallel.data_parallel agree
with NUM_DEVICES and refuses what no worker could run on this device, before msrun starts any.

Environment: MINDSCALE_ENTRY swaps the entry point (default run_train.py; relative paths are from
the repository root) -- a testing and debugging hook. MINDSCALE_CLUSTER_TIMEOUT is msrun's
--cluster_time_out (seconds a worker waits for the others to join; default 7200 on Ascend/GPU, as
MindFormers uses, 600 on CPU). On Ascend, HCCL_CONNECT_TIMEOUT (link set-up) and HCCL_EXEC_TIMEOUT (a
collective waiting for its peers) default to values derived from run.hang_timeout_s (hccl_timeouts);
set them to override. MINDSCALE_NODE_TIMEOUT: with NNODES > 1 and run.max_restarts, the seconds a node's
launcher may be silent, or late for a restart, before the job ends naming it (default 60; nodesync.py).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mindscale.config import REPO_ROOT, Config, Layout, UserError, load_config
from mindscale.devices import count_devices, detect_device
from mindscale.launch.nodesync import NODE_TIMEOUT_DEFAULT_S, NODE_TIMEOUT_ENV
from mindscale.launch.runlock import HOLDER_ENV, LOCK_NAME
from mindscale.train.loop.runnable import check_device
from mindscale.train.resilience.heartbeat import LOG_DIR_ENV

CPU_WORKERS_DEFAULT = 2
CLUSTER_TIMEOUT_DEFAULT = {"CPU": 600, "GPU": 7200, "Ascend": 7200}
# HCCL's ranges (CANN environment variable reference): HCCL_CONNECT_TIMEOUT [120, 7200] s; HCCL_EXEC_TIMEOUT
# (0, 17340] s on Atlas training series (910A, which rounds it down to a multiple of 68 s), [0, 2^31) on A2.
HCCL_CONNECT_MAX_S = 7200
HCCL_EXEC_MAX_S = 17340
HCCL_EXEC_GRANULE_S = 68
HCCL_WAIT_FLOOR_S = 7200  # a rank at its first collective while a slower one still compiles (not hang-timed)
HANG_MARGIN_S = 120  # HCCL waits this much past run.hang_timeout_s: the launcher names the rank first
MSRUN_PORT_DEFAULT = 8118
POLL_S = 0.5
CORES_ENV = "MINDSCALE_WORKER_CORES"
# MindSpore's own log, errors only, unless GLOG_v is set: its warnings on every run (start-up retries, a
# deprecated context key, "Some side effect nodes were eliminated by mistake" while it compiles) are noise
QUIET_MINDSPORE = ("GLOG_v", "3")


def hccl_timeouts(hang_timeout_s: float) -> dict[str, str]:
    """HCCL's timeouts on Ascend, from run.hang_timeout_s. A collective waits longer than the launcher's
    hang timeout (plus a margin for the stack dump and teardown), so a stalled rank is named and its
    stacks dumped before HCCL fails the ranks waiting for it; and at least HCCL_WAIT_FLOOR_S, because
    the first step, which compiles, is not hang-timed. Link set-up happens before the first step too:
    HCCL_CONNECT_TIMEOUT stays at its maximum. Above 17340 s HCCL_EXEC_TIMEOUT is capped (910A's limit)."""
    wait = max(HCCL_WAIT_FLOOR_S, hang_timeout_s + HANG_MARGIN_S)
    if wait > HCCL_WAIT_FLOOR_S:
        wait = -(-wait // HCCL_EXEC_GRANULE_S) * HCCL_EXEC_GRANULE_S  # 910A rounds down: round up first
    return {"HCCL_CONNECT_TIMEOUT": str(HCCL_CONNECT_MAX_S), "HCCL_EXEC_TIMEOUT": str(int(min(wait, HCCL_EXEC_MAX_S)))}


class LaunchError(UserError):
    """Bad launcher input (arguments, environment, worker count). One line; exit 2."""


# ----------------------------------------------------------------------------------------------
# Where we run: devices on this host, nodes from the environment


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


def assign_cores(cores: list[int], workers: int, first_rank: int = 0) -> list[int]:
    """One core per local CPU worker: on CPU "a device" is one worker on one core (docs/mfu.md,
    configs/hardware/cpu.yaml measures the peak on one core). Rank r takes the (r mod cores)-th usable
    core, so the nodes of a job that share one host (two launchers on one machine, as the tests run
    them) take different cores where there are enough, instead of every node starting at the first;
    on hosts of their own this only changes which cores. More workers than cores share them
    round-robin; cores beyond the worker count stay idle."""
    return [cores[(first_rank + i) % len(cores)] for i in range(workers)]


def fit_data_parallel(cfg: Config, world: int) -> str | None:
    """The `--set parallel.data_parallel=N` that makes the config use `world` devices, or None."""
    parallel = cfg.parallel
    if parallel.devices == world:
        return None
    dp = parallel.data_parallel_for(world)
    if dp is None:
        raise LaunchError(
            f"{world} device(s) cannot hold {parallel.replica_product('parallel.')} = {parallel.replica_devices}; "
            f"use a multiple of {parallel.replica_devices} devices"
        )
    return f"parallel.data_parallel={dp}"


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
    max_restarts: int = 0  # run.max_restarts (restarts.py)
    node_timeout_s: int = 60  # NNODES > 1 with restarts: how long a node may be silent (nodesync.py)
    hang_timeout_s: float = 0.0  # run.hang_timeout_s (heartbeat.py); 0 = not watched
    train_steps: int = 0  # train.steps: workers that exit 0 with fewer steps done were stopped gracefully
    step_rank: int = 0  # the rank that prints the step lines (step_rank)

    @property
    def world(self) -> int:
        return self.node.nnodes * self.local_workers

    @property
    def run_dir(self) -> Path:
        return self.log_dir.parent

    @property
    def first_rank(self) -> int:
        return self.node.node_rank * self.local_workers

    @property
    def local_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.local_workers)

    @property
    def tailed_ranks(self) -> list[int]:
        """The ranks whose logs the console follows: this node's first, and the one printing the step
        lines when it is here."""
        return sorted({self.first_rank} | ({self.step_rank} & set(self.local_ranks)))

    def worker_log(self, rank: int) -> Path:
        return self.log_dir / f"worker_{rank}.log"

    @property
    def msrun_log(self) -> Path:
        """msrun's output on this node: its own lines (the start of each process with its command, its
        errors), which the console leaves out, and the worker logs it follows."""
        return self.log_dir / f"msrun_node_{self.node.node_rank}.log"

    def entry_args(self) -> list[str]:
        return [str(self.entry), "--config", self.config, *[a for o in self.overrides for a in ("--set", o)]]

    def msrun_argv(self) -> list[str]:
        argv = [
            "msrun",
            "--worker_num",
            str(self.world),
            "--local_worker_num",
            str(self.local_workers),
            "--master_addr",
            self.node.master_addr,
            "--master_port",
            str(self.master_port),
            "--node_rank",
            str(self.node.node_rank),
            "--log_dir",
            str(self.log_dir),
            "--join",
            "True",
            "--cluster_time_out",
            str(self.cluster_timeout),
            # msrun (2.9, _get_node_id_and_log_path) numbers a worker node_rank x local_worker_num +
            # local index and tails the listed ids: the first local worker is this node's first rank
            "--tail_worker_log",
            ",".join(map(str, self.tailed_ranks)),
        ]
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
        env[HOLDER_ENV] = str(self.run_dir / LOCK_NAME)  # the workers leave the run-folder lock to us
        env.setdefault(*QUIET_MINDSPORE)
        if self.device == "Ascend":
            for name, value in hccl_timeouts(self.hang_timeout_s).items():
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


def plan_distribute(config: str, num_devices: str | None, overrides: list[str], env: dict) -> LaunchPlan:
    """Decide the job. NUM_DEVICES is per node (msrun's local_worker_num); world = NNODES x it."""
    node = Node.from_env(env)
    cfg = load_config(config, overrides)
    device = detect_device(cfg.run.device_target, env)
    notes = []
    if num_devices is not None:
        local = _positive_int("NUM_DEVICES", num_devices, "devices (workers) per node, e.g. 2")
        fitted = fit_data_parallel(cfg, node.nnodes * local)
        if fitted:
            notes.append(
                f"{node.nnodes * local} device(s): adding --set {fitted} "
                f"(config has parallel.data_parallel={cfg.parallel.data_parallel})"
            )
            overrides = [*overrides, fitted]
            cfg = load_config(config, overrides)
    elif device == "CPU":
        local = CPU_WORKERS_DEFAULT
    else:
        local = count_devices(device, env)
        if not local:
            raise LaunchError(
                f"run.device_target={device} but no {device} devices are visible here; "
                "pass NUM_DEVICES or fix the device target"
            )
    cores = None
    if device == "CPU":
        available = sorted(os.sched_getaffinity(0))
        cores = assign_cores(available, local, node.node_rank * local)
        if local > len(available):
            notes.append(f"{local} workers share {len(available)} cores: per-device numbers (MFU) will be low")
    timeout = _positive_int(
        "MINDSCALE_CLUSTER_TIMEOUT",
        env.get("MINDSCALE_CLUSTER_TIMEOUT", str(CLUSTER_TIMEOUT_DEFAULT[device])),
        "seconds",
    )
    node_timeout = _positive_int(NODE_TIMEOUT_ENV, env.get(NODE_TIMEOUT_ENV, str(NODE_TIMEOUT_DEFAULT_S)), "seconds")
    log_dir = (cfg.run_dir / "logs").absolute()
    entry = resolve_entry(env)
    check_device(cfg, device)  # what every worker would refuse: refused before msrun starts them
    world = node.nnodes * local
    return LaunchPlan(
        config=config,
        overrides=list(overrides),
        entry=entry,
        device=device,
        local_workers=local,
        node=node,
        master_port=node.master_port or free_port(),
        log_dir=log_dir,
        cluster_timeout=timeout,
        cores=cores,
        notes=notes,
        max_restarts=cfg.run.max_restarts,
        node_timeout_s=node_timeout,
        hang_timeout_s=cfg.run.hang_timeout_s,
        train_steps=cfg.train.steps,
        step_rank=step_rank(cfg, device, world),
    )


def step_rank(cfg: Config, device: str, world: int) -> int:
    """The rank whose log has the step lines (Layout.logging_rank: the trainer logs from it)."""
    return Layout.of(cfg, device, world).logging_rank
