"""Test-only fault hooks for restarts and hang detection, in the MINDSCALE_FAULT variable that the other
hooks use (checkpoint_write:STEP in checkpoints/folder.py, checkpoint_commit:STEP[@RANK] in
checkpoints/commit.py, loss_spike:STEP in the trainer).

    MINDSCALE_FAULT=kill:RANK:STEP     that rank SIGKILLs itself just before optimizer step STEP (1-based)
    MINDSCALE_FAULT=hang:RANK:STEP     that rank sleeps there, writing no more heartbeats, until killed

Several of these may be listed, comma-separated (kill:1:3,kill:1:5). Each fires once per run folder:
it leaves a marker `<run>/.fault-KIND-RANK-STEP` before acting, so the run a launcher restarts after it
(mindscale/launch/restarts.py) goes past that step. Delete the markers to arm the faults again.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

FAULT_ENV = "MINDSCALE_FAULT"
KINDS = ("kill", "hang")


def _wanted(rank: int, step: int) -> list[str]:
    """The kill/hang faults of MINDSCALE_FAULT aimed at this rank and step."""
    found = []
    for spec in os.environ.get(FAULT_ENV, "").split(","):
        parts = spec.strip().split(":")
        if len(parts) == 3 and parts[0] in KINDS and parts[1:] == [str(rank), str(step)]:
            found.append(parts[0])
    return found


def _claim(run_dir: Path, kind: str, rank: int, step: int) -> bool:
    """Create the fault's marker; False when an earlier run of this folder already fired it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(run_dir / f".fault-{kind}-{rank}-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def before_step(run_dir: Path, rank: int, step: int) -> None:
    """Called by the trainer before optimizer step `step`: fire the faults asked for here, once."""
    for kind in _wanted(rank, step):
        if not _claim(Path(run_dir), kind, rank, step):
            continue
        print(f"fault: rank {rank} {'kills itself' if kind == 'kill' else 'hangs'} before step {step} "
              f"({FAULT_ENV}, test only)", file=sys.stderr, flush=True)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)
