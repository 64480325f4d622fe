"""The launcher's hang watch (run.hang_timeout_s) over the workers' heartbeats (mindscale/train/resilience/heartbeat.py).

The launcher reads this node's heartbeats at each poll, and every rank's (all nodes' when the run
folder is shared) once one of its own is late. When a timed rank has been silent for more than
run.hang_timeout_s, the stalled ranks are those at the lowest completed step: a rank stuck in host
code falls behind, while its peers finish the step they share with it and wait in the next one's
collective (a rank whose heartbeat still says `compiling` counts as at its first step). The launcher
sends the local ones STACK_SIGNAL, on which faulthandler writes every thread's Python stack into the
rank's log, then stops the job. A rank that never reaches its first
collective is left to msrun's --cluster_time_out and, on Ascend, HCCL's timeouts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from mindscale.train.resilience.heartbeat import STACK_SIGNAL, heartbeat_file, read_heartbeat

DUMP_WAIT_S = 1.0  # faulthandler writes from its signal handler; time to reach the log before teardown


@dataclass(frozen=True)
class Stall:
    ranks: list[int]  # the ranks at the lowest completed step
    step: int  # their last completed step
    silent_s: float  # seconds since the newest heartbeat among them
    timeout_s: float

    def describe(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else "ranks " + ", ".join(map(str, self.ranks))
        return (
            f"{who} stalled: no heartbeat for {self.silent_s:.0f} s, the last one after step {self.step} "
            f"(run.hang_timeout_s={self.timeout_s:g})"
        )


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
    """Once a rank past its first step (timed) has a heartbeat older than `timeout_s`: the ranks at the
    lowest completed step, else None. A rank still `compiling` then counts as at its first step (its
    heartbeat's step): stuck before its first timed beat, it holds its timed peers in their next
    collective, so it is the one behind."""
    timed = [b for b in beats.values() if not b["compiling"]]
    if not any(now - b["time"] > timeout_s for b in timed):
        return None
    lowest = min(b["step"] for b in beats.values())
    behind = sorted(rank for rank, b in beats.items() if b["step"] == lowest)
    return Stall(behind, lowest, now - max(beats[r]["time"] for r in behind), timeout_s)
