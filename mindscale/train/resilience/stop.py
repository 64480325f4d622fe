"""Graceful stop: SIGTERM or SIGUSR1 asks a training process to finish its step, save a committed
checkpoint and exit 0; a later signal of either kind stops it at once.

A rank may be asked alone (a signal to one worker) or several times over (a scheduler signals
every process of the job, and the launcher and the worker wrapper forward theirs), so:
- here the request is only a flag; the trainer turns it into a decision all ranks share by a vote
  (Trainer._stop_votes), so every rank stops after the same step. A data-parallel step sums the flags
  in its own all-reduce of the loss, at every step for free; a sharded run votes with a collective of
  its own, which at thousands of ranks is latency added to the step, so it votes every N steps
  (StopVotes: N is run.stop_vote_interval, or agreed from measured costs);
- run alone (`escalate`), a signal DUPLICATE_S or more after the first restores the default action
  and raises it again, so the process dies of it; earlier ones are the same request arriving by
  several routes. Python runs a handler between bytecodes, so that time is when the handler runs:
  a copy that arrives during a long compiled step is timed when the step returns. Under the
  launcher a worker therefore never escalates (a scheduler's copy and the launcher's forwarded one
  may be a whole step apart): the launcher itself stops the job at once on a second signal.

The worker wrapper (mindscale/launch/worker.py) starts the entry point with these signals blocked:
one that comes before `install` stays pending instead of killing a process still importing.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

GRACEFUL = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_S = 2.0
VOTE_BUDGET = 0.001  # auto: a vote may cost this fraction of the training time between votes,
MAX_VOTE_DELAY_S = 10.0  # but a stop waits at most this long after the step it was asked in (or one step)


class StopRequest:
    def __init__(self, escalate: bool = True):
        self.signum: int | None = None
        self._first = 0.0
        self.escalate = escalate

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def reason(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None

    def install(self) -> "StopRequest":
        """Handle the graceful signals in this (main) thread, then take any that waited."""
        for sig in GRACEFUL:
            signal.signal(sig, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, GRACEFUL)
        return self

    def _on_signal(self, signum, _frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first = signum, now
            print(
                f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint and exiting "
                "(signal again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        elif self.escalate and now - self._first >= DUPLICATE_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def vote_interval(vote_s: float, step_s: float) -> int:
    """Steps between stop votes for a vote costing `vote_s` and steps of `step_s`: the fewest that keep
    the vote under VOTE_BUDGET of the training time, but no more than fit in MAX_VOTE_DELAY_S (at least 1)."""
    if step_s <= 0:
        return 1
    cheap_enough = math.ceil(vote_s / (VOTE_BUDGET * step_s))
    prompt_enough = math.floor(MAX_VOTE_DELAY_S / step_s)
    return max(1, min(cheap_enough, prompt_enough))


class StopVotes:
    """When a sharded run's ranks vote on a graceful stop, and what they decided.

    Every rank calls `after_step` after every step, with its own request and step time; a vote
    (`vote`: commit.RankVote) happens every `interval` steps (run.stop_vote_interval), so all ranks
    stop after the same step, at most that many steps after the request. With no interval set (auto)
    each vote also carries every rank's proposal for the next interval (vote_interval of its last
    vote's time and its steps' mean time since); the ranks take the ceiling of the proposals' mean,
    the same number on every rank because the sum is. The first three votes come after steps 1, 2
    and 3: the first one's time includes compiling the vote, so the third is the first whose proposal
    rests on a measured vote."""

    def __init__(self, vote, interval: int | None = None):
        self.vote = vote
        self.fixed = interval
        self.interval = interval or 1
        self.steps = 0  # steps since the last vote
        self.step_s = 0.0  # their time
        self.votes = 0
        self.vote_s: float | None = None  # the last (warm) vote's own time on this rank

    def after_step(self, requested: bool, step_s: float) -> int:
        """How many ranks asked to stop, at a voting step; 0 between votes."""
        self.steps += 1
        self.step_s += step_s
        if self.steps < self.interval:
            return 0
        proposal = self.fixed or (1 if self.vote_s is None else vote_interval(self.vote_s, self.step_s / self.steps))
        began = time.perf_counter()
        asked, proposals = self.vote.count(requested, proposal)
        self.vote_s = time.perf_counter() - began if self.votes else None
        self.votes += 1
        self.interval = self.fixed or math.ceil(proposals / self.vote.world)
        self.steps, self.step_s = 0, 0.0
        return asked
