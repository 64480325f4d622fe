"""The run-folder lock: one job at a time writes into a run folder.

`<run>/run.lock` names its holder in JSON: pid, host, the process's start time and its command. The
launcher takes it (scripts/run_distribute.sh on node 0, before it writes anything) and tells the
workers so through MINDSCALE_RUN_LOCK; run_train.py takes it itself when it runs without the
launcher (scripts/run_standalone.sh, or by hand).

The holder keeps the file open under an exclusive flock for its whole life, so the kernel lets go
when it dies by any signal, kill -9 included; the record says who it was. A second job then:
- finds the flock taken: it refuses in one line naming the holder (exit 2), having written nothing;
- finds it free, naming a process of this host that is gone (no such pid, or the pid now belongs
  to a process started at another time): it takes the lock over and says so in one line;
- finds it free, naming a process on another host: it refuses, because this host cannot tell
  whether that process lives (file systems differ in whether they share flocks between hosts), and
  says to delete the file once that job is known to be gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from mindscale.config import UserError

LOCK_NAME = "run.lock"
HOLDER_ENV = "MINDSCALE_RUN_LOCK"  # set by the launcher for its workers: the lock file it holds
START_TIME_SLACK_S = 0.5  # /proc start times are in clock ticks; the same process reads the same value


class RunLocked(UserError):
    """Another job holds the run folder. One line naming it; exit 2."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: float  # the process's start time (psutil.create_time): tells a reused pid apart
    command: str

    @classmethod
    def me(cls) -> "Holder":
        proc = psutil.Process()
        command = " ".join(shlex.join(proc.cmdline()).split())  # one line, whatever the arguments hold
        return cls(proc.pid, socket.gethostname(), proc.create_time(), command[:300])

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} (started {started}: {self.command})"

    def alive(self) -> bool | None:
        """Whether this process still runs; None when it ran on another host (cannot be told here)."""
        if self.host != socket.gethostname():
            return None
        try:
            return abs(psutil.Process(self.pid).create_time() - self.started) < START_TIME_SLACK_S
        except psutil.NoSuchProcess:
            return False


def _read_holder(fd: int) -> Holder | None:
    """The record in the open lock file; None when it is empty or not a record (a holder killed
    between creating and writing it)."""
    text = os.pread(fd, 1 << 16, 0).decode(errors="replace")
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return None


def _holder_of_busy_lock(fd: int) -> Holder | None:
    """The holder of a lock whose flock is taken; it may be writing its record this instant."""
    for _ in range(20):
        holder = _read_holder(fd)
        if holder is not None:
            return holder
        time.sleep(0.05)
    return None


class RunLock:
    """A held lock: `note` says whose lock was taken over, if any; release() gives it back, and removes
    the folders `acquire` created for it if nothing was written into them."""

    def __init__(self, path: Path, fd: int, holder: Holder, note: str | None, created: list[Path]):
        self.path, self.fd, self.holder, self.note, self.created = path, fd, holder, note, created

    def release(self) -> None:
        if self.fd is None:
            return
        if _read_holder(self.fd) == self.holder:
            self.path.unlink(missing_ok=True)  # while the flock is held: no one else is in it
        os.close(self.fd)
        self.fd = None
        remove_if_empty(self.created)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist, deepest first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_if_empty(folders: list[Path]) -> None:
    """rmdir `folders` in order (deepest first) while they are empty: a job that failed before writing
    anything leaves no run folder behind, and nothing anyone wrote is touched."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (something was written), or already gone
            return


def _open_locked(path: Path) -> tuple[int, bool]:
    """(fd, True) when this process now holds the flock of `path`, or the file system has no flocks
    (ENOLCK: then the record alone decides); (fd, False) when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return fd, False
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            return fd, True  # no flocks here: the record alone decides
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, True
        os.close(fd)  # the holder released (removed) the file between our open and flock: again


def _in_use(run_dir: Path, holder: Holder | None) -> RunLocked:
    who = holder.describe() if holder else "another process (its record is unreadable)"
    return RunLocked(f"run folder {run_dir} is in use by {who}; stop that job first, or set another run.name")


def acquire(run_dir: str | Path) -> RunLock:
    """Take `<run_dir>/run.lock` for this process (creating the run folder), or raise RunLocked."""
    run_dir = Path(run_dir)
    created = missing_folders(run_dir.absolute())
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd, free = _open_locked(path)
    if not free:
        holder = _holder_of_busy_lock(fd)
        os.close(fd)
        raise _in_use(run_dir, holder)
    me = Holder.me()
    previous = _read_holder(fd)
    note = None
    if previous is not None and (previous.pid, previous.host) != (me.pid, me.host):
        alive = previous.alive()
        if alive is not False:
            os.close(fd)
            if alive is None:
                raise RunLocked(
                    f"run folder {run_dir} is locked by {previous.describe()}, another host; if that job "
                    f"is gone, delete {path}, else stop it first or set another run.name"
                )
            raise _in_use(run_dir, previous)
        note = f"took over the run folder lock of {previous.describe()}: that process is gone"
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
    os.fsync(fd)
    return RunLock(path, fd, me, note, created)


def held_by_launcher(run_dir: str | Path) -> bool:
    """Whether our launcher holds `run_dir`'s lock for us (HOLDER_ENV names exactly that lock file: a
    variable inherited from an unrelated job does not turn locking off for another run folder)."""
    held = os.environ.get(HOLDER_ENV)
    return held is not None and Path(held).resolve() == (Path(run_dir) / LOCK_NAME).resolve()


def hold(run_dir: str | Path, takes_it: bool) -> contextlib.AbstractContextManager:
    """The lock for a job's lifetime, `with hold(...):`, when this process `takes_it` (the launcher of
    node 0; run_train.py's rank 0 when no launcher holds it); otherwise nothing. A takeover is said
    in one line."""
    if not takes_it:
        return contextlib.nullcontext()
    lock = acquire(run_dir)
    if lock.note:
        print(f"note: {lock.note}", flush=True)
    return lock
