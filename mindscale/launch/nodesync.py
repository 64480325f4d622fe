"""Restarts across nodes: the launchers of a multi-node job agree, through the run folder they share,
that every node stopped its workers, and then relaunch together (restarts.py).

Why the run folder and not msrun's scheduler: the scheduler is a process of node 0's msrun tree, which a
restart kills with the workers, and msrun 2.9 never relaunches by itself: on a worker's failure it kills the
node's other workers and raises; its worker start/kill callbacks are driven only by MindX's TaskD plugin
(docs/launch.md). The launchers already share the run folder:
they read every rank's exit file and heartbeat there, and their logs, checkpoints and the compile cache
live in it.

The protocol, in `<logs>/nodes/`:
- Each launcher touches `node_<k>.alive` every BEAT_S from a thread of its own, so a peer tells it lives
  by the file's modification time changing (measured on the reader's clock: the nodes' clocks may
  differ). Before the first attempt every launcher waits to see all the others beat (`join`): a run
  folder that is not shared is refused there, before anything starts.
- An attempt (generation g) that ends on a node, by success or failure, is reported in
  `gen_<g>/node_<k>.json`, after that node's workers are gone: whether it wants a restart, the cause,
  and on node 0 the scheduler port of generation g + 1 (a new one: the old may linger in TIME_WAIT).
  A launcher whose attempt still runs stops its workers on a peer's failed report (`failed_peer`).
- A launcher that wants a restart waits for every node's report (`gather`): all of them wanting one,
  the nodes relaunch together from the newest committed step; any that does not ends the job with its
  cause. A node that neither reports within the timeout nor beats ends the job in one line naming it
  (`NodeLost`), so the scheduler's requeue takes over.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from mindscale.io import write_atomically

SYNC_DIR = "nodes"
NODE_TIMEOUT_ENV = "MINDSCALE_NODE_TIMEOUT"
NODE_TIMEOUT_DEFAULT_S = 60
BEAT_S = 0.5


class NodeLost(Exception):
    """A peer node did not beat or report within the timeout: the job ends (exit 1)."""


@dataclass(frozen=True)
class Report:
    """How generation g ended on one node."""

    node: int
    restart: bool  # this node wants a restart (a restartable failure, budget left, no stop asked)
    failed: bool  # its attempt ended in a failure (a peer still running stops on it)
    cause: str | None
    port: int | None = None  # node 0: msrun's scheduler port for the next generation


class NodeSync:
    """One launcher's side of the protocol (module docstring). `clock` and `sleep` are injectable for
    the unit tests; `generation` is the attempt in progress (restarts.run advances it)."""

    def __init__(
        self,
        log_dir: Path,
        nnodes: int,
        node: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.folder = Path(log_dir) / SYNC_DIR
        self.nnodes, self.node, self.timeout_s = nnodes, node, timeout_s
        self.clock, self.sleep = clock, sleep
        self.generation = 0
        self.peers = [k for k in range(nnodes) if k != node]
        self._beating: threading.Event | None = None
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.glob(f"gen_*/node_{node}.json"):  # an earlier job's, in this run folder
            old.unlink(missing_ok=True)
        self._seen = {peer: self._mtime(peer) for peer in self.peers}  # the alive files' last mtimes
        self._changed: dict[int, float | None] = dict.fromkeys(self.peers)  # our clock when one last changed

    def alive_file(self, node: int) -> Path:
        return self.folder / f"node_{node}.alive"

    def report_file(self, generation: int, node: int) -> Path:
        return self.folder / f"gen_{generation}" / f"node_{node}.json"

    # ------------------------------------------------------------------------------------------
    # Liveness

    def beat(self) -> None:
        path = self.alive_file(self.node)
        path.touch()
        os.utime(path)

    def start_beating(self) -> None:
        self.beat()
        self._beating = threading.Event()
        threading.Thread(target=self._beat_loop, args=(self._beating,), daemon=True).start()

    def stop_beating(self) -> None:
        if self._beating is not None:
            self._beating.set()

    def _beat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(BEAT_S):
            try:
                self.beat()
            except OSError:  # the shared folder is gone for a moment: the peers judge the silence
                pass

    def _mtime(self, node: int) -> int | None:
        try:
            return self.alive_file(node).stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def _watch(self) -> dict[int, float | None]:
        """Per peer: seconds (our clock) since its alive file last changed; None while it has not changed
        since we began watching (a file left by an earlier job, or no file yet)."""
        now, silent = self.clock(), {}
        for peer in self.peers:
            mtime = self._mtime(peer)
            if mtime != self._seen[peer]:
                self._seen[peer], self._changed[peer] = mtime, now
            changed = self._changed[peer]
            silent[peer] = None if changed is None else now - changed
        return silent

    def silent_peer(self) -> int | None:
        """A peer seen beating that has been silent for longer than the timeout and has not reported this
        generation (one that did, its workers finished, may have exited while ours still save)."""
        silent = [peer for peer, s in self._watch().items() if s is not None and s > self.timeout_s]
        reported = self.reports() if silent else {}
        return next((peer for peer in silent if peer not in reported), None)

    def join(self, timeout_s: float) -> list[int]:
        """Wait until every peer has beaten since we started watching; the peers not seen within
        `timeout_s` (empty when all joined)."""
        began = self.clock()
        while True:
            missing = [peer for peer, silent in self._watch().items() if silent is None]
            if not missing or self.clock() - began > timeout_s:
                return missing
            self.sleep(BEAT_S)

    # ------------------------------------------------------------------------------------------
    # Reports

    def report(self, report: Report) -> None:
        path = self.report_file(self.generation, self.node)
        path.parent.mkdir(exist_ok=True)
        write_atomically(path, json.dumps(asdict(report)) + "\n")

    def reports(self) -> dict[int, Report]:
        found = {}
        for node in range(self.nnodes):
            try:
                found[node] = Report(**json.loads(self.report_file(self.generation, node).read_text()))
            except (FileNotFoundError, ValueError, TypeError):
                continue
        return found

    def failed_peer(self) -> Report | None:
        """The first peer (by node) whose attempt of this generation failed."""
        for node, report in sorted(self.reports().items()):
            if node != self.node and report.failed:
                return report
        return None

    def gather(self) -> dict[int, Report]:
        """Every node's report of this generation; NodeLost naming the first node that neither reported
        within the timeout nor (if it still beats) ever will: a live peer gets the timeout too, since it
        reports as soon as its workers are gone."""
        began = self.clock()
        while True:
            found = self.reports()
            missing = [k for k in range(self.nnodes) if k not in found]
            if not missing:
                return found
            if self.clock() - began > self.timeout_s:
                raise NodeLost(
                    f"node {missing[0]} did not come back within {self.timeout_s:g} s of the restart "
                    f"({NODE_TIMEOUT_ENV}); ending the job so the scheduler can requeue it"
                )
            self.sleep(BEAT_S)


def decide(reports: dict[int, Report]) -> tuple[bool, Report]:
    """(restart, the report that decides): every node wants a restart, or the first that does not."""
    refusing = [r for _, r in sorted(reports.items()) if not r.restart]
    return (not refusing), (refusing[0] if refusing else reports[0])
