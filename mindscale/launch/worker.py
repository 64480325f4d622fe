"""`python -m mindscale.launch worker ENTRY [ARGS ...]`: what msrun starts in every process. It pins a
CPU worker to its own core, runs the entry point as a child and records its exit status in
`<log_dir>/worker_<rank>.exit`, which the supervisor (supervisor.py) polls.

msrun starts every worker in a session of its own, so a launcher or msrun killed by any signal (a
scheduler's SIGKILL of the job's process group) used to leave the workers training, and writing
checkpoints, re-parented to init. Now the wrapper dies with msrun and the entry point with the
wrapper (Linux's parent-death signal)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from mindscale.io import write_atomically
from mindscale.launch.msrun import CORES_ENV, LOG_DIR_ENV
from mindscale.train.resilience.stop import GRACEFUL


def exit_file(log_dir: str | Path, env: dict) -> Path:
    name = "scheduler" if env.get("MS_ROLE") == "MS_SCHED" else f"worker_{env.get('RANK_ID', '0')}"
    return Path(log_dir) / f"{name}.exit"


def pin_to_core(core: int, env) -> None:
    """Keep this process and its children on one core, and OpenMP to one thread. (msrun's own
    --bind_core reads cgroup-v1 cpuset files and the NPU topology, so it is used on Ascend only.)"""
    os.sched_setaffinity(0, [core])
    env["OMP_NUM_THREADS"] = "1"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits; at once if the parent is already gone."""
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _child_start() -> None:
    """In the entry point's process before exec: dies with us; the graceful-stop signals keep their
    default action (msrun's may be ignored, see supervisor.py) and stay blocked, but SIGINT is not."""
    die_with_parent()
    for sig in GRACEFUL:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def run_worker(entry_argv: list[str]) -> int:
    """Run the entry point as a child, forward SIGTERM/SIGINT/SIGUSR1, record the exit status
    atomically. The wrapper dies with msrun, the child with the wrapper."""
    die_with_parent()
    if os.environ.get(CORES_ENV) and os.environ.get("MS_ROLE") != "MS_SCHED":
        cores = [int(c) for c in os.environ[CORES_ENV].split(",")]
        local_rank = int(os.environ.get("DEVICE_ID", "0"))  # msrun sets DEVICE_ID to the local rank
        pin_to_core(cores[local_rank % len(cores)], os.environ)
    # Blocked until the handlers forward them, so none is lost or kills us before there is a child;
    # the child inherits the mask: the entry point takes them when it is ready (mindscale/train/resilience/stop.py).
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = subprocess.Popen([sys.executable, *entry_argv], preexec_fn=_child_start)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    code = child.wait()
    if os.environ.get(LOG_DIR_ENV):
        path = exit_file(os.environ[LOG_DIR_ENV], os.environ)
        write_atomically(path, f"{code}\n")
    return code if code >= 0 else 128 - code
