"""Progress of long command-line work on stderr (tools/preprocess_data.py, convert_checkpoint.py, reshard.py).

A terminal gets a tqdm bar per stage of the work. A pipe or a log file gets plain lines instead of a
bar's carriage returns: one every `every_s` seconds (MINDSCALE_PROGRESS_EVERY_S, default 10) while a
stage runs and one when a stage that lasted that long ends, each with the count, the rate and, when the
total is known, the share done and an ETA. Work quicker than that prints nothing, and a stage that
fails prints no line of its own, so bad input found early still ends in the one-line error alone on
stderr. stdout stays the tool's answer (--json).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys
import time
from typing import Iterable, Iterator, TextIO

from mindscale.config import UserError

EVERY_ENV, PLAIN_EVERY_S = "MINDSCALE_PROGRESS_EVERY_S", 10.0


def clock(seconds: float | None) -> str:
    """0:01:05 for 65 s, '1 day, 2:00:00'; '?' when unknown."""
    return "?" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def plain_every_s() -> float:
    """Seconds between plain lines: MINDSCALE_PROGRESS_EVERY_S, else 10 (0: a line per item)."""
    text = os.environ.get(EVERY_ENV, str(PLAIN_EVERY_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise UserError(f"{EVERY_ENV}={text!r} is not a number of seconds >= 0; unset it or give one, e.g. 10")
    return seconds


class Progress:
    """`with Progress("reshard") as progress:` then `progress.stage(what, total, unit)` and `advance()` per
    item; the next stage, or the end of the block, ends the stage."""

    def __init__(self, tool: str, stream: TextIO | None = None, every_s: float | None = None):
        self.tool = tool
        self.every_s = plain_every_s() if every_s is None else every_s
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None
        self.what = None

    def stage(self, what: str, total: int | None = None, unit: str = "item") -> None:
        """Start counting `what` (ending the stage before it): `total` items of `unit` if known."""
        self._end()
        self.what, self.total, self.unit, self.count = what, total, unit, 0
        self.began = self.last_line = time.monotonic()
        if self.stream.isatty():
            from tqdm import tqdm

            single = {"bar_format": "{desc}: {elapsed}"} if total == 1 else {}  # a 1/1 bar says nothing
            self.bar = tqdm(
                total=total,
                desc=f"{self.tool}: {what}",
                unit=f" {unit}",
                file=self.stream,
                dynamic_ncols=True,
                **single,
            )

    def advance(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
        elif (self.total is None or self.count < self.total) and time.monotonic() - self.last_line >= self.every_s:
            self.last_line = time.monotonic()
            self._line()

    @contextlib.contextmanager
    def single(self, what: str, unit: str = "step"):
        """A stage of one item, done when the block ends: `with progress.single("writing hf_out", "file"): ...`."""
        self.stage(what, 1, unit)
        yield
        self.advance()

    def track(self, items: Iterable, what: str, total: int | None = None, unit: str = "item") -> Iterator:
        """`items` as a stage: advanced after each one."""
        self.stage(what, total, unit)
        for item in items:
            yield item
            self.advance()

    def _line(self, done: bool = False) -> None:
        """`tool: what: 120/291 tensors (41%, 12.5/s) elapsed 0:00:10, ETA 0:00:14`, or `... in 0:00:23` at the
        end; a single item's stage only says `done in`."""
        elapsed = time.monotonic() - self.began
        if self.total == 1:
            text = f"done in {clock(elapsed)}"
        else:
            rate = self.count / elapsed if elapsed > 0 else 0.0
            count = f"{self.count:,}" + (f"/{self.total:,}" if self.total is not None else "")
            share = f"{self.count / self.total:.0%}, " if self.total else ""
            eta = f", ETA {clock((self.total - self.count) / rate) if rate else '?'}" if self.total else ""
            when = f"in {clock(elapsed)}" if done else f"elapsed {clock(elapsed)}{eta}"
            shown = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
            text = f"{count} {self.unit}s ({share}{shown}/s) {when}"
        print(f"{self.tool}: {self.what}: {text}", file=self.stream, flush=True)

    def _end(self, failed: bool = False) -> None:
        if self.what is None:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif not failed and time.monotonic() - self.began >= self.every_s:
            self._line(done=True)
        self.what = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, error, trace) -> None:
        self._end(failed=kind is not None)


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


def quiet(tool: str = "") -> Progress:
    """A Progress that prints nothing: for library calls made outside a command line."""
    return Progress(tool, stream=_Discard(), every_s=PLAIN_EVERY_S)
