"""TensorBoard event files of the metrics records (`run.tensorboard`, docs/monitoring.md).

Every record MetricsLogger appends to metrics.jsonl becomes one scalar per numeric value, under the
record's own key (a per-source dict's values under KEY/SOURCE), at the record's step: what TensorBoard
plots is what metrics.jsonl holds, including keys added later. Written by tensorboardX (requirements.txt),
imported only when the key is on.

A resumed run re-logs the steps after its checkpoint, and metrics.jsonl drops its records after that
step. Here each process start opens a new event file in <run>/tensorboard/ that begins with a
SessionLog.START event at the first step it will log (tensorboardX's `purge_step`): TensorBoard's
reader then drops the events of the earlier files from that step on, so both show the same history.

The training thread only queues events; tensorboardX's writer thread writes them and flushes the
file every FLUSH_SECS, so a live `tensorboard --logdir` sees a record within seconds, and the writer
closes itself at interpreter exit (atexit) when close() was not reached, e.g. after a health guard.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mindscale.config import ConfigError

FOLDER = "tensorboard"  # in the run folder
FLUSH_SECS = 2
QUEUE_EVENTS = 4096  # tensorboardX blocks the caller when its queue is full; a record has ~25 scalars


def scalars(record: dict) -> dict[str, float]:
    """The values TensorBoard gets from a record: every int and float but the step itself, and those of a
    per-source dict (data_tokens, val_loss_by_source) under KEY/SOURCE, one plot per source in KEY's group
    (nulls, such as the first record's eta_s, flags, strings and lists are not scalars)."""
    flat = {key: value for key, value in record.items() if key != "step" and _is_scalar(value)}
    for key, values in record.items():
        if isinstance(values, dict):
            flat.update({f"{key}/{name}": value for name, value in values.items() if _is_scalar(value)})
    return flat


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardLog:
    """An event file in <run_dir>/tensorboard/ for the records of a process that logs from `first_step` + 1."""

    def __init__(self, run_dir: Path, first_step: int):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError(
                "run.tensorboard=true needs the tensorboardX package: pip install -r requirements.txt, "
                "or set run.tensorboard=false"
            ) from None
        # tensorboardX names a file by the second it opened it: the suffix keeps two starts within a second
        # apart and in start order, the order TensorBoard reads (and purges) them in
        self.writer = SummaryWriter(
            str(Path(run_dir) / FOLDER),
            purge_step=first_step + 1,
            max_queue=QUEUE_EVENTS,
            flush_secs=FLUSH_SECS,
            filename_suffix=f".{time.time_ns()}.{os.getpid()}",
        )

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        """Write what is queued and close the file."""
        self.writer.close()
