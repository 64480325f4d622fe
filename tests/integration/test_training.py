"""End-to-end training on CPU through the real entry points (run_train.py, scripts/run_distribute.sh).

Each run is a separate process, as a user would start it: MindSpore's global context makes
in-process runs leak into each other.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mindscale.train.checkpoints import folder as ckpt, commit
from mindscale.config import REPO_ROOT
from mindscale.launch import runlock
from tests import shared
from tests.cores import one_core

TINY = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")
SMALL = [
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
    "model.seq_length=32",
    "train.log_interval=1",
    "train.warmup_steps=2",
    "checkpoint.save_interval=0",
]


def sets(*overrides):
    return [arg for o in (*SMALL, *overrides) for arg in ("--set", o)]


def train(tmp_path, name, *overrides, env=None, check=True):
    """run_train.py as one device: pinned to one core, as scripts/run_standalone.sh does."""
    args = [
        sys.executable,
        "run_train.py",
        "--config",
        TINY,
        *sets(f"run.output_dir={tmp_path}", f"run.name={name}", "parallel.data_parallel=1", *overrides),
    ]
    proc = subprocess.run(
        args,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        preexec_fn=one_core,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_worker_run() -> dict:
    """{"stdout", "run"}: run_train.py on one worker, micro batch 4, 6 steps, the uninterrupted run the
    data-parallel tests compare with; trained once a session (tests/shared.py), they only read it."""

    def run():
        parent = Path(tempfile.mkdtemp(dir=shared.ROOT, prefix="one_worker-"))
        return {
            "stdout": train(parent, "dp1", "train.micro_batch_size=4", "train.steps=6").stdout,
            "run": str(parent / "dp1"),
        }

    return shared.once(["one_worker_run"], run)


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_two_workers_match_one_worker_with_the_same_global_batch(tmp_path, accumulation):
    """Two data-parallel workers (each its micro batches accumulated in the graph, then one all-reduce)
    train as one worker on the whole batch."""
    launch = subprocess.run(
        [
            "bash",
            "scripts/run_distribute.sh",
            TINY,
            "2",
            *sets(
                f"run.output_dir={tmp_path}",
                "run.name=dp2",
                f"train.micro_batch_size={2 // accumulation}",
                f"parallel.gradient_accumulation_steps={accumulation}",
                "train.steps=6",
            ),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]
    single = one_worker_run()

    logs = tmp_path / "dp2" / "logs"
    digests = {re.search(r"weights sha256 (\w+)", (logs / f"worker_{r}.log").read_text()).group(1) for r in (0, 1)}
    assert len(digests) == 1, "data-parallel ranks ended with different weights"

    two, one = losses(tmp_path / "dp2"), losses(single["run"])
    assert sorted(two) == sorted(one) == list(range(1, 7))
    np.testing.assert_allclose([two[s] for s in two], [one[s] for s in two], rtol=2e-4)
    record = metrics(tmp_path / "dp2")[-1]
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "step_time_s",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "samples_per_s_per_device",
        "tflops_per_device",
        "mfu",
        "hfu",
        "memory_gib",
        "devices",
    ):
        assert key in record
    assert record["devices"] == 2
    assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 2)
    assert single["stdout"].count("weights sha256") == 1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small real corpus: text -> SentencePiece (400 pieces) -> MindRecord of 33-token samples."""
    root = tmp_path_factory.mktemp("corpus")
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jokes".split()
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(rng.choice(words, 12)) + "." for _ in range(300))
    (root / "text.txt").write_text(text)
    tools = [
        sys.executable,
        "tools/train_tokenizer.py",
        "--input",
        str(root / "text.txt"),
        "--vocab-size",
        "400",
        "--output",
        str(root / "tok"),
    ]
    subprocess.run(tools, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(root / "text.txt"),
            "--tokenizer",
            str(root / "tok.model"),
            "--seq-length",
            "32",
            "--output",
            str(root / "mr"),
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return root


def test_loss_falls_on_a_real_corpus(tmp_path, corpus):
    train(
        tmp_path,
        "fall",
        "model.vocab_size=512",
        f"data.path={corpus / 'mr'}",
        f"data.tokenizer={corpus / 'tok.model'}",
        "train.steps=30",
        "train.lr=0.01",
        "train.min_lr=0.001",
    )
    values = losses(tmp_path / "fall")
    assert values[30] < values[1] - 1.5, values


def test_a_loss_spike_skips_its_update_inside_the_step(tmp_path, corpus):
    """Step 22's labels are replaced by random ids (a fault hook): with train.loss_spike_factor its loss
    exceeds the limit, the compiled step skips the update, and its weights and optimizer state are
    exactly those after step 21. The recent losses go into state.json for a resume."""
    common = (
        "model.vocab_size=512",
        f"data.path={corpus / 'mr'}",
        f"data.tokenizer={corpus / 'tok.model'}",
        "train.lr=0.01",
        "train.min_lr=0.001",
        "train.lr_schedule=constant",
        "train.loss_spike_factor=1.3",
    )
    spiked = train(tmp_path, "spiked", *common, "train.steps=22", env={"MINDSCALE_FAULT": "loss_spike:22"})
    (line,) = [line for line in spiked.stdout.splitlines() if "optimizer update skipped" in line]
    assert line.startswith("step 22: loss ") and "x the median of the last 21 updated steps" in line
    assert metrics(tmp_path / "spiked")[-1]["spike_skipped_steps"] == 1
    before = train(tmp_path, "before", *common, "train.steps=21")
    assert "optimizer update skipped" not in before.stdout
    after = tmp_path / "spiked" / "checkpoints" / "step_00000022"
    then = tmp_path / "before" / "checkpoints" / "step_00000021"
    for a, b in [
        (ckpt.load_weights(after), ckpt.load_weights(then)),
        ckpt.load_checkpoint(after)[1:2] + ckpt.load_checkpoint(then)[1:2],
    ]:
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert len(json.loads((then / ckpt.STATE).read_text())["loss_history"]) == 21


def test_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path, corpus):
    proc = train(
        tmp_path,
        "small_vocab",
        "model.vocab_size=256",
        f"data.path={corpus / 'mr'}",
        f"data.tokenizer={corpus / 'tok.model'}",
        "train.steps=1",
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "vocab" in proc.stderr


def test_gradient_accumulation_equals_a_bigger_batch(tmp_path):
    train(tmp_path, "big", "train.micro_batch_size=4", "train.steps=4")
    train(tmp_path, "acc", "train.micro_batch_size=2", "parallel.gradient_accumulation_steps=2", "train.steps=4")
    big, acc = losses(tmp_path / "big"), losses(tmp_path / "acc")
    np.testing.assert_allclose([acc[s] for s in big], list(big.values()), rtol=1e-5)


@pytest.mark.parametrize("saving", ["sync", "async"])
def test_kill_during_checkpoint_write_then_resume_matches_uninterrupted_run(tmp_path, saving):
    """SIGKILL halfway through writing step 6 (on the writer thread with async_save): the rerun resumes
    from step 3 and ends bit-identical to a run never killed."""
    common = (
        "train.steps=8",
        "checkpoint.save_interval=3",
        "checkpoint.keep_last=2",
        f"checkpoint.async_save={saving == 'async'}",
    )
    train(tmp_path, "straight", *common)
    killed = train(tmp_path, "resumed", *common, env={"MINDSCALE_FAULT": "checkpoint_write:6"}, check=False)
    assert killed.returncode == -9
    run = tmp_path / "resumed"
    assert ckpt.latest_checkpoint(run / "checkpoints").name == "step_00000003"
    resumed = train(tmp_path, "resumed", *common)
    assert "resumed from" in resumed.stdout and "step_00000003" in resumed.stdout
    straight, again = losses(tmp_path / "straight"), losses(run)
    assert sorted(again) == list(range(1, 9))
    # On one core MindSpore's CPU kernels are deterministic: the resumed run is bit-identical.
    assert [again[s] for s in range(1, 9)] == [straight[s] for s in range(1, 9)]
    w_straight = ckpt.load_weights(tmp_path / "straight" / "checkpoints" / "step_00000008")
    w_again = ckpt.load_weights(run / "checkpoints" / "step_00000008")
    assert all(np.array_equal(w_straight[k], w_again[k]) for k in w_straight)
    assert commit.committed_steps(run / "checkpoints") == [6, 8]
    blocked = [r["save_blocked_s"] for r in metrics(run) if r["step"] == 7]  # the save at step 6
    assert len(blocked) == 1 and blocked[0] > 0
    assert "training blocked" in resumed.stdout


def test_fp16_overflowing_steps_are_skipped_and_counted(tmp_path):
    train(tmp_path, "overflow", "model.compute_dtype=float16", "train.loss_scale=1.0e+30", "train.steps=3")
    last = metrics(tmp_path / "overflow")[-1]
    assert last["skipped_steps"] == 3
    start = ckpt.load_weights(tmp_path / "overflow" / "checkpoints" / "step_00000003")
    train(
        tmp_path,
        "fresh",
        "model.compute_dtype=float16",
        "train.loss_scale=1.0e+30",
        "train.steps=1",
        "checkpoint.save_at_end=true",
    )
    first = ckpt.load_weights(tmp_path / "fresh" / "checkpoints" / "step_00000001")
    assert all(np.array_equal(start[k], first[k]) for k in start), "a skipped step changed the weights"
    train(tmp_path, "dynamic", "model.compute_dtype=float16", "train.loss_scale=dynamic", "train.steps=3")
    assert all(np.isfinite(r["loss"]) for r in metrics(tmp_path / "dynamic"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.path=/nonexistent/data"], "/nonexistent/data"),
        (["parallel.data_parallel=2"], "needs 2 devices"),
        (["parallel.model_parallel=2"], "needs Ascend or GPU"),
        (["hardware=ascend910b"], "add --set hardware=cpu"),
        (["hardware=ascend910a", "model.compute_dtype=bfloat16"], "the Ascend 910A has no bf16 matmul"),
        (["checkpoint.load_path=/nonexistent/ckpt"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, overrides, message):
    proc = subprocess.run(
        [
            sys.executable,
            "run_train.py",
            "--config",
            TINY,
            *sets(f"run.output_dir={tmp_path}", "train.steps=1", "parallel.data_parallel=1", *overrides),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0]


def test_truncated_checkpoint_as_load_path_is_refused(tmp_path):
    train(tmp_path, "src", "train.steps=1")
    step = tmp_path / "src" / "checkpoints" / "step_00000001"
    weights = step / ckpt.WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = train(tmp_path, "dst", "train.steps=1", f"checkpoint.load_path={step}", check=False)
    assert proc.returncode == 2 and "truncated" in proc.stderr
    assert not (tmp_path / "dst" / "checkpoints").exists()


def test_resume_with_more_steps_extends_the_run(tmp_path):
    """More train.steps recompute the cosine over the new length: the line at start says the learning rate
    step 4 runs at, which is the one logged, and the checkpoint's schedule's."""
    train(tmp_path, "extend", "train.steps=3")
    extended = train(tmp_path, "extend", "train.steps=5")
    assert "resumed from" in extended.stdout
    assert sorted(losses(tmp_path / "extend")) == [1, 2, 3, 4, 5]
    logged = {r["step"]: r["lr"] for r in metrics(tmp_path / "extend")}
    (line,) = [line for line in extended.stdout.splitlines() if line.startswith("learning rate:")]
    assert line == (
        f"learning rate: step 4 runs at {logged[4]:.3e} on this config's schedule, 3.000e-04 on the "
        "checkpoint's (train.steps 3 -> 5); the schedule is recomputed from the config's train keys"
    )


def test_corrupt_newest_checkpoint_is_skipped_on_one_line_and_resume_step_is_exact(tmp_path):
    common = ("checkpoint.save_interval=2", "checkpoint.keep_last=3")
    train(tmp_path, "run", "train.steps=6", *common)
    root = tmp_path / "run" / "checkpoints"
    assert commit.committed_steps(root) == [2, 4, 6]
    newest = root / "step_00000006" / ckpt.WEIGHTS
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    again = train(tmp_path, "run", "train.steps=7", *common)
    skipped = [line for line in again.stdout.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and "step_00000006" in skipped[0] and "checksum" in skipped[0], again.stdout
    assert "resumed from" in again.stdout and "step_00000004" in again.stdout
    assert commit.committed_steps(root) == [4, 6, 7]
    refused = train(tmp_path, "run", "train.steps=7", "checkpoint.resume_step=5", *common, check=False)
    assert refused.returncode == 2 and "resume_step=5 is not a committed step" in refused.stderr
    exact = train(tmp_path, "run", "train.steps=5", "checkpoint.resume_step=4", *common)
    assert "step_00000004 at step 4" in exact.stdout
    assert commit.committed_steps(root) == [4, 5]


def test_a_rank_killed_before_the_commit_leaves_its_step_uncommitted(tmp_path):
    """Rank 1 of 2 dies after rank 0 wrote step 4 whole: step 4 is not saved. The rerun on 1 worker with
    the 2 workers' micro batch is refused in one line (the global batch would halve), before compiling and
    changing nothing; with the accumulation the line names it resumes at step 2, continues the losses of an
    uninterrupted 1-worker run with the same global batch, and says where each save went."""
    save = ("train.steps=6", "checkpoint.save_interval=2", "checkpoint.keep_last=2")
    args = [
        "bash",
        "scripts/run_distribute.sh",
        TINY,
        "2",
        *sets(f"run.output_dir={tmp_path}", "run.name=dp2", "train.micro_batch_size=2", *save),
    ]
    killed = subprocess.run(
        args,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MINDSCALE_FAULT": "checkpoint_commit:4@1"},
    )
    assert killed.returncode == 1 and "rank 1 was killed by SIGKILL" in killed.stderr, killed.stderr[-2000:]
    root = tmp_path / "dp2" / "checkpoints"
    assert (root / "step_00000004" / ckpt.MARKER).is_file()  # rank 0's part is complete
    assert commit.committed_steps(root) == [2]
    refused = train(tmp_path, "dp2", "train.micro_batch_size=2", *save, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-2000:]
    assert errors[0] == (
        f"error: {root / 'step_00000002'} was trained at a global batch of 4, this run's is 2 "
        "(train.micro_batch_size=2 x parallel.data_parallel=1 x parallel.gradient_accumulation_steps="
        "1): resuming would move its data position (step x global batch) and learning-rate schedule; "
        "keep the batch with --set parallel.gradient_accumulation_steps=2, or 2 device(s) "
        "(parallel.data_parallel=2)"
    )
    assert "compiled the train step" not in refused.stdout and commit.committed_steps(root) == [2]
    fix = errors[0].split("keep the batch with --set ")[1].split(",")[0]
    resumed = train(tmp_path, "dp2", "train.micro_batch_size=2", fix, *save)
    assert "step_00000002 at step 2" in resumed.stdout
    for step in (4, 6):
        assert f"checkpoint: {root / ckpt.step_dir_name(step)} (training blocked " in resumed.stdout
    assert commit.committed_steps(root) == [4, 6]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000006"]
    two_then_one, one = losses(tmp_path / "dp2"), losses(one_worker_run()["run"])
    assert sorted(two_then_one) == sorted(one) == list(range(1, 7))
    np.testing.assert_allclose([two_then_one[s] for s in one], list(one.values()), rtol=2e-4)


def _processes_naming(marker):
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _files_of(run_dir):
    return sorted(str(p.relative_to(run_dir)) for p in Path(run_dir).rglob("*"))


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
        trainers = [p for p in _processes_naming(str(tmp_path)) if Path(p.cmdline()[1]).name == "run_train.py"]
        assert len(trainers) == 3  # two ranks and msrun's scheduler, each under its wrapper

        files, lock = _files_of(run_dir), (run_dir / runlock.LOCK_NAME).read_text()
        second = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and second.stdout == "", second.stdout[-2000:] + second.stderr[-2000:]
        assert second.stderr.startswith(f"error: run folder {run_dir} is in use by pid {job.pid} on ")
        assert len(second.stderr.splitlines()) == 1 and "mindscale.launch distribute" in second.stderr
        assert _files_of(run_dir) == files and (run_dir / runlock.LOCK_NAME).read_text() == lock

        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.time() + 10
        while _processes_naming(str(tmp_path)) and time.time() < deadline:
            time.sleep(0.5)
        assert _processes_naming(str(tmp_path)) == []
    finally:
        for p in _processes_naming(str(tmp_path)):
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


def _wait_for_records(records, job, count, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        if records.is_file() and len(records.read_text().splitlines()) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} steps were logged in {records}")


def _digests(log_dir):
    return {re.search(r"weights sha256 (\w+)", (log_dir / f"worker_{r}.log").read_text()).group(1) for r in (0, 1)}


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
    _wait_for_records(run / "metrics.jsonl", job, 3)
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
    assert len(_digests(run / "logs")) == 1  # both ranks stopped after the same step
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
    assert _digests(run / "logs") == _digests(tmp_path / "straight" / "logs")

    twice = subprocess.Popen(
        launch("twice", "train.steps=100000"),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_records(tmp_path / "twice" / "metrics.jsonl", twice, 1)
    twice.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    twice.send_signal(signal.SIGTERM)
    _, err = twice.communicate(timeout=30)
    assert twice.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.splitlines()[-1].startswith("SIGTERM: stopped all workers")
    assert _processes_naming(str(tmp_path / "twice")) == []


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
    _wait_for_records(run / "metrics.jsonl", job, 2)
    (rank1,) = [
        p
        for p in _processes_naming(str(tmp_path))
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
    assert len(_digests(run / "logs")) == 1
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


MIXTRAL_TINY = str(REPO_ROOT / "configs" / "tiny" / "mixtral_tiny.yaml")


def test_mixture_of_experts_trains_on_two_workers_and_logs_its_router(tmp_path, corpus):
    """configs/tiny/mixtral_tiny.yaml on two data-parallel workers (scripts/run_distribute.sh): the loss falls
    on the real corpus, and every record holds aux_loss (E x sum_e f_e P_e, top_k when perfectly balanced)
    and the busiest expert's load over the mean (>= 1)."""
    launch = subprocess.run(
        [
            "bash",
            "scripts/run_distribute.sh",
            MIXTRAL_TINY,
            "2",
            *sets(
                f"run.output_dir={tmp_path}",
                "run.name=moe",
                "model.vocab_size=512",
                f"data.path={corpus / 'mr'}",
                f"data.tokenizer={corpus / 'tok.model'}",
                "train.micro_batch_size=2",
                "train.steps=20",
                "train.lr=0.01",
                "train.min_lr=0.001",
            ),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]
    records = metrics(tmp_path / "moe")
    assert [r["step"] for r in records] == list(range(1, 21)) and records[-1]["devices"] == 2
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    for r in records:
        assert r["aux_loss"] >= 2 - 1e-4 and r["expert_load_max"] >= 1  # top_k 2: 2 when perfectly balanced


def test_mixture_of_experts_resumes_bit_identical(tmp_path):
    """Three steps, then three more from the checkpoint: the same losses, router statistics and weights as six
    steps in one go (one worker on one core: MindSpore's CPU kernels are deterministic)."""
    moe = [
        arg
        for o in ("model.moe.num_experts=4", "model.moe.top_k=2", "model.arch=mixtral", "model.moe.capacity_factor=1.0")
        for arg in ("--set", o)
    ]
    for name, steps in (("straight", 6), ("resumed", 3), ("resumed", 6)):
        args = [
            sys.executable,
            "run_train.py",
            "--config",
            TINY,
            *moe,
            *sets(f"run.output_dir={tmp_path}", f"run.name={name}", "parallel.data_parallel=1", f"train.steps={steps}"),
        ]
        proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, preexec_fn=one_core)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [(r["loss"], r["aux_loss"], r["expert_load_max"]) for r in resumed] == [
        (r["loss"], r["aux_loss"], r["expert_load_max"]) for r in straight
    ]
    w_straight = ckpt.load_weights(tmp_path / "straight" / "checkpoints" / "step_00000006")
    w_resumed = ckpt.load_weights(tmp_path / "resumed" / "checkpoints" / "step_00000006")
    assert w_straight.keys() == w_resumed.keys() and "layers.0.feed_forward.experts.w1" in w_straight
    assert all(np.array_equal(w_straight[k], w_resumed[k]) for k in w_straight)
