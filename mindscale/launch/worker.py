"""`python -m mindscale.launch worker ENTRY [ARGS ...]`: what msrun starts in every process. It pins a
CPU worker to its own core, runs the entry point as a child and records its exit status in
`<log_dir>/worker_<rank>.exit`, which the supervisor (supervisor.py) polls."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from mindscale.io import write_atomically
from mindscale.launch.plan import CORES_ENV, LOG_DIR_ENV


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
