"""The core a test's single-core process runs on.

Runs pinned to one core are deterministic (bit-identical losses across runs). `make test` runs several
pytest-xdist workers at once, so each worker pins its runs to a core of its own (worker gw<N> takes the
N-th core it may use, round-robin), instead of all taking the lowest one.
"""

import os


def worker_core() -> int:
    allowed = sorted(os.sched_getaffinity(0))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    return allowed[worker % len(allowed)]


def one_core() -> None:
    """A subprocess's preexec_fn: pin it to this worker's core, as scripts/run_standalone.sh pins a device."""
    os.sched_setaffinity(0, {worker_core()})
