"""Graceful stop: SIGTERM or SIGUSR1 asks a training process to finish its step, save a committed
checkpoint and exit 0; a later signal of either kind stops it at once.

A rank may be asked alone (a signal to one worker) or several times over (a scheduler signals
every process of the job, and the launcher and the worker wrapper forward theirs), so:
- here the request is only a flag; the trainer turns it into a decision all ranks share by a vote
  after every step (Trainer._stop_votes), so every rank stops after the same step;
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

import os
import signal
import sys
import time

GRACEFUL = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_S = 2.0


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
            print(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint and exiting "
                  "(signal again to stop at once)", file=sys.stderr, flush=True)
        elif self.escalate and now - self._first >= DUPLICATE_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
