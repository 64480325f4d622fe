"""Worker heartbeats and the launcher's hang watch (run.hang_timeout_s).

Under the launcher every training process writes `<logs>/worker_<rank>.heartbeat` (one JSON record,
padded to a fixed size and rewritten in place) before each optimizer step and after each checkpoint save: the steps it has completed,
the time, its pid, and a small ledger of where its time went (the launcher's goodput summary,
mindscale/launch/goodput.py). The first heartbeat of a process is written before its first step,
which compiles the graph: until the second one (`compiling` true) the rank is not timed, so a long
compile is not a hang (a rank that never reaches its first collective is left to msrun's
--cluster_time_out and, on Ascend, HCCL's timeouts).

The launcher reads every rank's heartbeat (all nodes' when the run folder is shared) at each poll.
When a timed rank has been silent for more than run.hang_timeout_s, the stalled ranks are those at
the lowest completed step: a rank stuck in host code falls behind, while its peers finish the step
they share with it and wait in the next one's collective. The launcher sends the local ones
STACK_SIGNAL, on which faulthandler writes every thread's Python stack into the rank's log, then
stops the job. SIGTERM/SIGUSR1 are the graceful stop, hence SIGUSR2 here.

Why in place and not mindscale.io.write_atomically: on this ext4 a rename over the previous file cost
2.0 ms per heartbeat (ext4 flushes the data of a file replaced by rename, auto_da_alloc), an in-place
pwrite of the record 3 us (docs/monitoring.md). A reader that meets a record half rewritten gets
invalid JSON and keeps the rank's previous heartbeat (HangWatch), so nothing is lost but one poll.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from mindscale.launch.plan import LOG_DIR_ENV

STACK_SIGNAL = signal.SIGUSR2
RECORD_BYTES = 512  # every record padded to this size: a rewrite in place leaves no tail of a longer one
DUMP_WAIT_S = 1.0  # faulthandler writes from its signal handler; time to reach the log before teardown


def heartbeat_file(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"worker_{rank}.heartbeat"


class Heartbeat:
    """A training process's heartbeat; does nothing outside the launcher (no one would read it).

    The ledger: `started` (time of the first heartbeat: imports, graph build and checkpoint read are
    done), `first_step` (the step this process started from), `first_step_s` (its first step, the
    compile included), `steps_s` and `steps` (the later steps: seconds and count), `save_s` (seconds
    checkpoint saves blocked training). Step intervals exclude the saves made in them."""

    def __init__(self, path: Path | None, rank: int):
        self.path, self.rank, self.step = path, rank, None
        self.ledger = {"started": None, "first_step": None, "first_step_s": None, "steps_s": 0.0, "steps": 0,
                       "save_s": 0.0}
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

    def saved(self, seconds: float) -> None:
        """A checkpoint save blocked training for `seconds` (a sign of life too)."""
        if self.path is None:
            return
        self.ledger["save_s"] += seconds
        self._saves_since_last += seconds
        self._write(time.time())

    def _write(self, now: float) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "step": self.step, "time": now,
                  "compiling": self.ledger["first_step_s"] is None, **self.ledger}
        data = json.dumps(record).ljust(RECORD_BYTES).encode()
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._fd, data, 0)
        if len(data) != self._size:  # only if a record outgrew RECORD_BYTES
            os.ftruncate(self._fd, len(data))
            self._size = len(data)


def read_heartbeat(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


@dataclass(frozen=True)
class Stall:
    ranks: list[int]   # the ranks at the lowest completed step
    step: int          # their last completed step
    silent_s: float    # seconds since the newest heartbeat among them
    timeout_s: float

    def describe(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else "ranks " + ", ".join(map(str, self.ranks))
        return (f"{who} stalled: no heartbeat for {self.silent_s:.0f} s, the last one after step {self.step} "
                f"(run.hang_timeout_s={self.timeout_s:g})")


class HangWatch:
    """The launcher's side: fresh heartbeats of every rank, stalls, stack dumps. Heartbeat files left
    by an earlier launch (unchanged since this one began) do not count, as with the exit files."""

    def __init__(self, log_dir: Path, world: int, local_ranks: range, timeout_s: float):
        self.paths = {rank: heartbeat_file(log_dir, rank) for rank in range(world)}
        self.local_ranks, self.timeout_s = local_ranks, timeout_s
        for rank in local_ranks:
            self.paths[rank].unlink(missing_ok=True)
        self.stale = {rank: self._mtime(path) for rank, path in self.paths.items()}
        self.last_good: dict[int, dict] = {}  # a record read half rewritten counts as the previous one

    @staticmethod
    def _mtime(path: Path) -> int | None:
        try:
            return path.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def beats(self, ranks=None) -> dict[int, dict]:
        """The newest readable heartbeat of each rank (of `ranks`, default all) written in this launch."""
        for rank in self.paths if ranks is None else ranks:
            path = self.paths[rank]
            mtime = self._mtime(path)
            if mtime is not None and mtime != self.stale[rank]:
                beat = read_heartbeat(path)
                if beat is not None:
                    self.last_good[rank] = beat
        return {r: b for r, b in self.last_good.items() if ranks is None or r in ranks}

    def stalled(self, now: float | None = None) -> Stall | None:
        """The stall, once a timed rank has been silent for longer than the timeout (0: never). Each poll
        reads this node's heartbeats; all ranks' only when one of them is late (a stall elsewhere leaves
        this node's ranks waiting in a collective, silent too)."""
        if not self.timeout_s:
            return None
        now = time.time() if now is None else now
        if find_stall(self.beats(self.local_ranks), now, self.timeout_s) is None:
            return None
        return find_stall(self.beats(), now, self.timeout_s)

    def dump_stacks(self, stall: Stall, msrun_pid: int) -> list[int]:
        """Ask the stalled local ranks for their Python stacks (only processes under our msrun)."""
        try:
            ours = {p.pid for p in psutil.Process(msrun_pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            return []
        beats, asked = self.beats(), []
        for rank in stall.ranks:
            pid = beats.get(rank, {}).get("pid")
            if rank in self.local_ranks and pid in ours:
                os.kill(pid, STACK_SIGNAL)
                asked.append(rank)
        if asked:
            time.sleep(DUMP_WAIT_S)
        return asked


def find_stall(beats: dict[int, dict], now: float, timeout_s: float) -> Stall | None:
    """Ranks past their first step whose heartbeat is older than `timeout_s`: None, or the ranks at
    the lowest completed step among all timed ranks."""
    timed = {rank: b for rank, b in beats.items() if not b["compiling"]}
    if not any(now - b["time"] > timeout_s for b in timed.values()):
        return None
    lowest = min(b["step"] for b in timed.values())
    behind = sorted(rank for rank, b in timed.items() if b["step"] == lowest)
    return Stall(behind, lowest, now - max(timed[r]["time"] for r in behind), timeout_s)
