"""The run-folder lock (mindscale/launch/runlock.py) between real processes: a live holder is named
and refused, a dead one (kill -9) is taken over, a reused pid or another host's record is told
apart, and run_train.py refuses a live run without writing into it."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mindscale.config import REPO_ROOT
from mindscale.launch import runlock

HOLD = textwrap.dedent("""
    import sys, time
    from mindscale.launch import runlock
    lock = runlock.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def holder(tmp_path):
    """A separate process holding <tmp>/run's lock until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_is_named_and_a_dead_one_is_taken_over(tmp_path, holder):
    run = tmp_path / "run"
    record = (run / runlock.LOCK_NAME).read_text()
    with pytest.raises(runlock.RunLocked, match=f"is in use by pid {holder.pid} on ") as refused:
        runlock.acquire(run)
    assert "\n" not in str(refused.value) and "-c" in str(refused.value)  # names the holder's command
    assert (run / runlock.LOCK_NAME).read_text() == record and os.listdir(run) == [runlock.LOCK_NAME]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with runlock.acquire(run) as lock:
        assert lock.note.startswith(f"took over the run folder lock of pid {holder.pid} ")
        assert json.loads((run / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (run / runlock.LOCK_NAME).exists()  # released


def test_a_reused_pid_is_dead_and_another_hosts_record_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    me = runlock.Holder.me()
    # a live pid (our parent's), but recorded with another start time: the recorded process is gone
    (run / runlock.LOCK_NAME).write_text(json.dumps({**me.__dict__, "pid": os.getppid(), "started": 0.0}))
    with runlock.acquire(run) as lock:
        assert lock.note.startswith(f"took over the run folder lock of pid {os.getppid()} ")
    for pid in (1, me.pid):  # our own pid on another host (containers) is another process too
        (run / runlock.LOCK_NAME).write_text(json.dumps({**me.__dict__, "pid": pid, "host": "elsewhere"}))
        with pytest.raises(runlock.RunLocked, match=f"delete {run / runlock.LOCK_NAME}"):
            runlock.acquire(run)


def test_only_the_lock_of_this_run_folder_counts_as_the_launchers(tmp_path, monkeypatch):
    """A HOLDER_ENV inherited from another job does not turn locking off for this run folder."""
    monkeypatch.setenv(runlock.HOLDER_ENV, str(tmp_path / "other" / runlock.LOCK_NAME))
    assert not runlock.held_by_launcher(tmp_path / "run")
    monkeypatch.setenv(runlock.HOLDER_ENV, str(tmp_path / "run" / runlock.LOCK_NAME))
    assert runlock.held_by_launcher(tmp_path / "run")


def test_run_train_refuses_a_live_run_and_writes_nothing(tmp_path, holder):
    proc = subprocess.run(
        [
            sys.executable,
            "run_train.py",
            "--config",
            "configs/tiny/llama_tiny.yaml",
            "--set",
            f"run.output_dir={tmp_path}",
            "--set",
            "run.name=run",
            "--set",
            "parallel.data_parallel=1",
            "--set",
            "train.steps=1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != runlock.HOLDER_ENV},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"in use by pid {holder.pid}" in errors[0]
    assert os.listdir(tmp_path / "run") == [runlock.LOCK_NAME]


def test_a_job_that_wrote_nothing_leaves_no_folder_behind(tmp_path):
    """The lock creates the run folder (and any missing parents); a job that ends before writing anything
    (a refused data path, a bad checkpoint) removes only those, and only while they are empty. It used to
    leave an empty `output/<name>/` behind."""
    run = tmp_path / "output" / "deep" / "run"
    with runlock.acquire(run):
        assert (run / runlock.LOCK_NAME).is_file()
    assert os.listdir(tmp_path) == []
    with runlock.acquire(run):
        (run / "config.yaml").write_text("written\n")
    assert os.listdir(run) == ["config.yaml"]
    (run / "config.yaml").unlink()
    run.rmdir()
    run.parent.rmdir()
    (tmp_path / "output" / "theirs").mkdir()  # beside the folders it creates: "output" is not empty
    with runlock.acquire(run):
        pass
    assert os.listdir(tmp_path / "output") == ["theirs"]
