"""End-to-end training on CPU through the real entry points: signals, kills, stop votes and health guards.

Each run is a separate process, as a user would start it: MindSpore's global context makes
in-process runs leak into each other.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mindscale.train.checkpoints import folder as ckpt, commit
from mindscale.config import REPO_ROOT
from mindscale.launch import runlock
from tests.integration.tiny_runs import (
    TINY,
    digests,
    files_of,
    losses,
    metrics,
    processes_naming,
    sets,
    train,
    wait_for_records,
)


def test_killing_the_jobs_process_group_stops_every_worker(tmp_path):
    """A scheduler's kill -9 of the job's process group: msrun starts the workers in sessions of their
    own, so they used to train on (and checkpoint) as orphans; now they die within seconds. While the
    job lives, a second launcher into its run folder is refused naming it; once it is dead, the next
    launcher takes the lock over."""
    args = [
        "bash",
        "scripts/run_distribute.sh",
        TINY,
        "2",
        *sets(f"run.output_dir={tmp_path}", "run.name=orphans", "train.steps=100000", "train.micro_batch_size=2"),
    ]
    job = subprocess.Popen(
        args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    run_dir = tmp_path / "orphans"
    try:
        records = run_dir / "metrics.jsonl"
        deadline = time.time() + 240
        while not (records.is_file() and records.stat().st_size) and time.time() < deadline and job.poll() is None:
            time.sleep(1)
        assert records.is_file() and records.stat().st_size, "the workers never started training"
        trainers = [p for p in processes_naming(str(tmp_path)) if Path(p.cmdline()[1]).name == "run_train.py"]
        assert len(trainers) == 3  # two ranks and msrun's scheduler, each under its wrapper

        files, lock = files_of(run_dir), (run_dir / runlock.LOCK_NAME).read_text()
        second = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and second.stdout == "", second.stdout[-2000:] + second.stderr[-2000:]
        assert second.stderr.startswith(f"error: run folder {run_dir} is in use by pid {job.pid} on ")
        assert len(second.stderr.splitlines()) == 1 and "mindscale.launch distribute" in second.stderr
        assert files_of(run_dir) == files and (run_dir / runlock.LOCK_NAME).read_text() == lock

        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.time() + 10
        while processes_naming(str(tmp_path)) and time.time() < deadline:
            time.sleep(0.5)
        assert processes_naming(str(tmp_path)) == []
    finally:
        for p in processes_naming(str(tmp_path)):
            p.kill()
    probe = subprocess.run(
        args,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MINDSCALE_ENTRY": "tests/fixtures/allreduce_probe.py"},
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert f"note: took over the run folder lock of pid {job.pid} " in probe.stdout
    assert not (run_dir / runlock.LOCK_NAME).exists()  # released at the end


def test_sigterm_saves_a_committed_checkpoint_every_rank_agrees_on_and_resume_continues(tmp_path):
    """A scheduler's SIGTERM to the job's process group mid-run: both data-parallel ranks finish the
    same step, it is committed, the job exits 0 naming it. Resuming from it ends bit-identical to a
    run never stopped. A second signal right after the first stops everything at once."""

    def launch(name, *overrides):  # a constant LR: the schedule must not depend on train.steps
        return [
            "bash",
            "scripts/run_distribute.sh",
            TINY,
            "2",
            *sets(
                f"run.output_dir={tmp_path}",
                f"run.name={name}",
                "train.micro_batch_size=2",
                "train.lr_schedule=constant",
                *overrides,
            ),
        ]

    job = subprocess.Popen(
        launch("stopped", "train.steps=100000"),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    run = tmp_path / "stopped"
    wait_for_records(run / "metrics.jsonl", job, 3)
    os.killpg(job.pid, signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, out[-2000:] + err[-2000:]
    stop = metrics(run)[-1]["step"]
    root = run / "checkpoints"
    assert commit.committed_steps(root) == [stop] and stop < 100000
    assert out.splitlines()[-1].startswith(
        f"MindScale: all 2 worker(s) on this node stopped on SIGTERM; newest "
        f"committed checkpoint: {root / ckpt.step_dir_name(stop)}; logs in "
    )
    assert len(digests(run / "logs")) == 1  # both ranks stopped after the same step
    assert not (run / runlock.LOCK_NAME).exists()

    resumed = subprocess.run(
        launch("stopped", f"train.steps={stop + 2}"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{ckpt.step_dir_name(stop)} at step {stop}" in resumed.stdout
    straight = subprocess.run(
        launch("straight", f"train.steps={stop + 2}"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    again, once = losses(run), losses(tmp_path / "straight")
    assert sorted(again) == sorted(once) == list(range(1, stop + 3))
    assert again == once
    assert digests(run / "logs") == digests(tmp_path / "straight" / "logs")

    twice = subprocess.Popen(
        launch("twice", "train.steps=100000"),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_records(tmp_path / "twice" / "metrics.jsonl", twice, 1)
    twice.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    twice.send_signal(signal.SIGTERM)
    _, err = twice.communicate(timeout=30)
    assert twice.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.splitlines()[-1].startswith("SIGTERM: stopped all workers")
    assert processes_naming(str(tmp_path / "twice")) == []


def test_sigusr1_to_one_worker_stops_every_rank_after_the_same_step(tmp_path):
    """The signal reaches rank 1 alone: the step's vote tells rank 0, both save the same step, exit 0."""
    job = subprocess.Popen(
        [
            "bash",
            "scripts/run_distribute.sh",
            TINY,
            "2",
            *sets(f"run.output_dir={tmp_path}", "run.name=one", "train.micro_batch_size=2", "train.steps=100000"),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = tmp_path / "one"
    wait_for_records(run / "metrics.jsonl", job, 2)
    (rank1,) = [
        p
        for p in processes_naming(str(tmp_path))
        if Path(p.cmdline()[1]).name == "run_train.py"
        and p.environ().get("MS_ROLE") == "MS_WORKER"
        and p.environ().get("RANK_ID") == "1"
    ]
    rank1.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, out[-2000:] + err[-2000:]
    stop = metrics(run)[-1]["step"]
    assert commit.committed_steps(run / "checkpoints") == [stop]
    assert f"stopping after step {stop} of 100000: asked on 1 of 2 rank(s) (a signal to another rank)" in out
    assert "SIGUSR1: finishing this step" in (run / "logs" / "worker_1.log").read_text()
    assert len(digests(run / "logs")) == 1
    # the launcher got no signal: the heartbeats tell it the workers stopped before train.steps
    assert out.splitlines()[-1].startswith(
        f"MindScale: all 2 worker(s) on this node stopped gracefully after step {stop} "
        "of 100000 (asked by a signal to a worker or to another node's launcher); "
        f"newest committed checkpoint: {run / 'checkpoints' / ckpt.step_dir_name(stop)}"
    )


@pytest.mark.parametrize("interval", [None, 7], ids=["auto", "every_7"])
def test_sharded_stop_votes_every_n_steps_and_every_rank_stops_after_the_same_step(tmp_path, interval):
    """StopVotes (the sharded layouts' vote) over two msrun workers with a real all-reduce: rank 1 alone
    is signalled in step 5; both ranks vote at the same steps, agree on each interval, stop after the
    same step, at the first vote after the request. Auto: after the first three votes the ranks vote
    every many steps, and the stop waits at most MAX_VOTE_DELAY_S."""
    from mindscale.train.resilience.stop import MAX_VOTE_DELAY_S

    overrides = [
        f"run.output_dir={tmp_path}",
        "run.name=votes",
        f"run.stop_vote_interval={'null' if interval is None else interval}",
    ]
    probe = subprocess.run(
        ["bash", "scripts/run_distribute.sh", TINY, "2", *sets(*overrides)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MINDSCALE_ENTRY": "tests/fixtures/stop_vote_probe.py"},
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    lines = [
        json.loads(line.split("PROBE ", 1)[1])
        for log in sorted((tmp_path / "votes" / "logs").glob("worker_*.log"))
        for line in log.read_text().splitlines()
        if line.startswith("PROBE ")
    ]
    assert [r["rank"] for r in lines] == [0, 1]
    first, second = lines
    assert {k: first[k] for k in ("stopped_after", "voted_at", "intervals")} == {
        k: second[k] for k in ("stopped_after", "voted_at", "intervals")
    }
    stopped, voted = first["stopped_after"], first["voted_at"]
    assert stopped == voted[-1] and [v for v in voted if v >= 5] == [stopped]  # the first vote after step 5
    if interval:
        assert voted == [7] and stopped == 7
    else:
        assert voted[:3] == [1, 2, 3] and stopped > 5
        # a vote of milliseconds (measured ~7 ms here) against 20 ms steps: far fewer votes than steps,
        # each interval within the delay cap
        assert len(voted) < stopped / 10 and all(1 < n and 0.02 * n <= MAX_VOTE_DELAY_S for n in first["intervals"][3:])


def test_health_guards_stop_a_run_that_cannot_recover_with_exit_1(tmp_path):
    """fp16 with a fixed loss scale that overflows every step stops after train.max_skipped_steps; a
    non-finite loss without a dynamic scale stops at once. One line each, exit 1."""

    def refused(name, *overrides):
        proc = train(tmp_path, name, *overrides, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-2000:]
        return errors[0], metrics(tmp_path / name)

    line, records = refused(
        "overflow",
        "model.compute_dtype=float16",
        "train.loss_scale=1.0e+30",
        "train.steps=10",
        "train.max_skipped_steps=3",
    )
    assert "step 3: 3 steps in a row skipped for non-finite gradients or loss spikes (train.max_skipped_steps=3" in line
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["skipped_steps"] == 3
    # fp16 activations of weights drawn with std 1000 overflow in the first forward pass
    line, records = refused(
        "nan", "model.compute_dtype=float16", "train.loss_scale=null", "model.init_std=1000", "train.steps=3"
    )
    assert "step 1: the loss is nan and there is no dynamic loss scale to recover it (train.loss_scale=null)" in line
    assert [r["step"] for r in records] == [1] and not np.isfinite(records[0]["loss"])
