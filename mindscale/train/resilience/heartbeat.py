"""Worker heartbeats: what a training process under the launcher writes so the launcher can tell a
stalled rank (mindscale/launch/hangwatch.py, run.hang_timeout_s) and account for the wall time
(mindscale/launch/goodput.py).

Under the launcher every training process writes `<logs>/worker_<rank>.heartbeat` (one JSON record,
padded to a fixed size and rewritten in place) before each optimizer step and after each checkpoint
save, and as a sign of life during a validation pass and a background save's join (`alive`): the
steps it has completed, the time, its pid, and a small ledger of where its time went. The
first heartbeat of a process is written before its first step, after the step's compile in graph
mode (a rank still compiling has written none); until the second one (`compiling` true) the rank is
not timed, so a long compile, or a first step waiting for a peer's, is not a hang. faulthandler
writes every thread's Python stack into the rank's log on STACK_SIGNAL (SIGTERM/SIGUSR1 are the
graceful stop, hence SIGUSR2).

Why in place and not mindscale.io.write_atomically: on this ext4 a rename over the previous file cost
2.0 ms per heartbeat (ext4 flushes the data of a file replaced by rename, auto_da_alloc), an in-place
pwrite of the record 3 us (docs/monitoring.md). A reader that meets a record half rewritten gets
invalid JSON and keeps the rank's previous heartbeat, so nothing is lost but one poll.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

LOG_DIR_ENV = "MINDSCALE_LOG_DIR"  # set by the launcher (mindscale/launch/msrun.py): the workers' log folder
STACK_SIGNAL = signal.SIGUSR2
RECORD_BYTES = 512  # every record padded to this size: a rewrite in place leaves no tail of a longer one


def heartbeat_file(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"worker_{rank}.heartbeat"


class Heartbeat:
    """A training process's heartbeat; does nothing outside the launcher (no one would read it).

    The ledger: `started` (time of the first heartbeat: imports, graph build and checkpoint read are
    done), `first_step` (the step this process started from), `first_step_s` (its first step, the
    compile included when the step was not compiled before it), `steps_s` and `steps` (the later steps:
    seconds and count), `save_s` (seconds checkpoint saves blocked training), `compile_s` and
    `compile_cache` (the step's compile before the first heartbeat, and whether it loaded MindSpore's
    compile cache: hit, miss or off; mindscale/train/loop/compile_cache.py). Step intervals exclude
    the saves made in them."""

    def __init__(self, path: Path | None, rank: int):
        self.path, self.rank, self.step = path, rank, None
        self.ledger = {
            "started": None,
            "first_step": None,
            "first_step_s": None,
            "steps_s": 0.0,
            "steps": 0,
            "save_s": 0.0,
            "compile_s": 0.0,
            "compile_cache": "off",
        }
        self._last = None
        self._saves_since_last = 0.0
        self._fd = self._size = None
        if path is not None:
            faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)

    @classmethod
    def of_worker(cls, rank: int) -> "Heartbeat":
        log_dir = os.environ.get(LOG_DIR_ENV)
        return cls(heartbeat_file(log_dir, rank) if log_dir else None, rank)

    def beat(self, completed: int) -> None:
        """Before a step (and once after the last): `completed` optimizer steps are done."""
        if self.path is None:
            return
        now = time.time()
        if self._last is None:
            self.ledger.update(started=now, first_step=completed)
        else:
            interval = now - self._last - self._saves_since_last
            if self.ledger["first_step_s"] is None:
                self.ledger["first_step_s"] = interval
            else:
                self.ledger["steps_s"] += interval
                self.ledger["steps"] += 1
        self._last, self._saves_since_last, self.step = now, 0.0, completed
        self._write(now)

    def compiled(self, seconds: float, cache: str) -> None:
        """The step compiled before the first heartbeat: in `seconds`, loading the compile cache or not."""
        self.ledger.update(compile_s=seconds, compile_cache=cache)

    def alive(self) -> None:
        """A sign of life between two beats (each validation batch, around a background save's join): the
        time only, no step counted, the ledger unchanged. A validation pass longer than run.hang_timeout_s
        is then not taken for a hang, only one of its parts would be. Nothing before the first beat."""
        if self.path is None or self._last is None:
            return
        self._write(time.time())

    def saved(self, seconds: float) -> None:
        """A checkpoint save blocked training for `seconds` (a sign of life too)."""
        if self.path is None:
            return
        self.ledger["save_s"] += seconds
        self._saves_since_last += seconds
        self._write(time.time())

    def _write(self, now: float) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "step": self.step,
            "time": now,
            "compiling": self.ledger["first_step_s"] is None,
            **self.ledger,
        }
        data = json.dumps(record).ljust(RECORD_BYTES).encode()
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._fd, data, 0)
        if len(data) != self._size:  # only if a record outgrew RECORD_BYTES
            os.ftruncate(self._fd, len(data))
            self._size = len(data)


def diverged_file(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"worker_{rank}.diverged"


def record_divergence(rank: int, cause: str) -> None:
    """Under the launcher, before a health guard's exit 1 (docs/launch.md: exit 0, 2, and 1 for anything
    else): its one line, in `<logs>/worker_<rank>.diverged`. The launcher does not restart such a
    failure: from the same checkpoint the run would diverge again (mindscale/launch/supervisor.py)."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if log_dir:
        diverged_file(log_dir, rank).write_text(cause + "\n")


def read_heartbeat(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
