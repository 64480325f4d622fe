"""CLI progress (mindscale/progress.py): plain lines when stderr is not a terminal, a tqdm bar on one (a real
pty), nothing from work that is quick or fails; driven with real time."""

import fcntl
import io
import os
import pty
import re
import select
import struct
import termios
import time

import pytest

from mindscale.config import UserError
from mindscale.progress import EVERY_ENV, Progress


def test_plain_lines_every_interval_and_at_the_end_of_a_long_stage():
    out = io.StringIO()  # not a terminal
    with Progress("convert", stream=out, every_s=0.05) as progress:
        for _ in progress.track(range(6), "reading hf", 6, "tensor"):
            time.sleep(0.03)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) >= 3
    for line in lines[:-1]:
        assert re.fullmatch(
            r"convert: reading hf: [1-5]/6 tensors \(\d+%, [\d.]+/s\) elapsed 0:00:00, ETA 0:00:00", line
        ), line
    assert re.fullmatch(r"convert: reading hf: 6/6 tensors \(100%, [\d.]+/s\) in 0:00:00", lines[-1]), lines[-1]


def test_uncounted_total_single_stages_and_stage_order():
    out = io.StringIO()
    with Progress("preprocess", stream=out, every_s=0) as progress:
        progress.stage("writing samples", unit="sample")
        progress.advance(2000)
        with progress.single("writing manifest", "file"):
            pass
    *_, samples, manifest = out.getvalue().splitlines()
    assert re.fullmatch(r"preprocess: writing samples: 2,000 samples \([\d,.]+/s\) in 0:00:00", samples), samples
    assert manifest == "preprocess: writing manifest: done in 0:00:00"


def test_quick_or_failing_work_prints_nothing():
    out = io.StringIO()
    with Progress("reshard", stream=out) as progress:  # the default 10 s
        progress.track(range(3), "writing", 3, "rank folder")
        with progress.single("reading", "folder"):
            pass
    with pytest.raises(ValueError), Progress("reshard", stream=out, every_s=0) as progress:
        with progress.single("reading", "folder"):
            raise ValueError("bad checkpoint")
    assert out.getvalue() == ""


def read_all(master: int) -> str:
    """What was written to the pty's other end (closed)."""
    chunks = []
    while select.select([master], [], [], 0.5)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: nothing more from a closed slave
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return b"".join(chunks).decode()


def terminal_size(fd: int) -> None:
    """A new pty is 0 columns wide (tqdm would draw nothing): give it a terminal's 120 x 24."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))


def test_a_terminal_gets_a_tqdm_bar():
    master, slave = pty.openpty()
    terminal_size(slave)
    with open(slave, "w") as terminal:
        assert terminal.isatty()
        with Progress("reshard", stream=terminal, every_s=0) as progress:
            for _ in progress.track(range(4), "writing out", 4, "rank folder"):
                pass
    shown = read_all(master)
    assert "\r" in shown and "reshard: writing out: 100%" in shown and "4/4" in shown


def test_a_bad_interval_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(EVERY_ENV, "soon")
    with pytest.raises(UserError, match=f"^{EVERY_ENV}='soon' is not a number of seconds >= 0; unset it"):
        Progress("preprocess")
