"""Test-only fault hooks for restarts and hang detection, in the MINDSCALE_FAULT variable that the other
hooks use (checkpoint_write:STEP in checkpoints/folder.py, checkpoint_commit:STEP[@RANK] in
checkpoints/commit.py, loss_spike:STEP in the trainer).

    MINDSCALE_FAULT=kill:RANK:STEP     that rank SIGKILLs itself just before optimizer step STEP (1-based)
    MINDSCALE_FAULT=hang:RANK:STEP     that rank sleeps there, writing no more heartbeats, until killed

Several of these may be listed, comma-separated (kill:1:3,kill:1:5). Each fires once per run folder:
it leaves a marker `<run>/.fault-KIND-RANK-STEP` before acting, so the run a launcher restarts after it
(mindscale/launch/restarts.py) goes past that step. Delete the markers to arm the faults again.

A kill waits (at most PEERS_WAIT_S) until every other rank on its node has written the heartbeat of the
step before it: the step is then complete everywhere, as a crash between two steps leaves it. Without
the wait, how many steps the goodput ledger counts as lost depended on whether the launcher tore a peer
down before or after that peer's heartbeat, which a loaded host decides (a CI run counted 1, not 2).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from mindscale.train.resilience.heartbeat import LOG_DIR_ENV, read_heartbeat

FAULT_ENV = "MINDSCALE_FAULT"
KINDS = ("kill", "hang")
PEERS_WAIT_S = 60.0


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


def _wait_for_peers(rank: int, completed: int) -> None:
    """Until the other ranks' heartbeats in this node's log folder say `completed` steps are done."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return
    deadline = time.monotonic() + PEERS_WAIT_S
    while time.monotonic() < deadline:
        beats = [read_heartbeat(p) for p in Path(log_dir).glob("worker_*.heartbeat")]
        if all(b is not None and (b["rank"] == rank or (b["step"] or 0) >= completed) for b in beats):
            return
        time.sleep(0.05)


def before_step(run_dir: Path, rank: int, step: int) -> None:
    """Called by the trainer before optimizer step `step`: fire the faults asked for here, once."""
    for kind in _wanted(rank, step):
        if not _claim(Path(run_dir), kind, rank, step):
            continue
        print(
            f"fault: rank {rank} {'kills itself' if kind == 'kill' else 'hangs'} before step {step} "
            f"({FAULT_ENV}, test only)",
            file=sys.stderr,
            flush=True,
        )
        if kind == "kill":
            _wait_for_peers(rank, step - 1)
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)
