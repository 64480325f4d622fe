"""End-to-end training on CPU through the real entry points (run_train.py, scripts/run_distribute.sh):
data parallel, accumulation, a real corpus, checkpoints and bad input.

Each run is a separate process, as a user would start it: MindSpore's global context makes
in-process runs leak into each other.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mindscale.train.checkpoints import folder as ckpt, commit
from mindscale.config import REPO_ROOT
from tests import shared
from tests.integration.tiny_runs import TINY, losses, metrics, one_worker_run, sets, train

# the uninterrupted run the kill tests compare with (sync and async saving compute the same numbers), and the
# checkpoints other tests damage a copy of
KILL_RUN = ("train.steps=8", "checkpoint.save_interval=3", "checkpoint.keep_last=2")


def straight_run() -> Path:
    """run_train.py with KILL_RUN, never interrupted, trained once a session (tests/shared.py)."""

    def run():
        parent = Path(tempfile.mkdtemp(dir=shared.ROOT, prefix="straight-"))
        train(parent, "straight", *KILL_RUN)
        return str(parent / "straight")

    return Path(shared.once(["straight kill run"], run))


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
    common = (*KILL_RUN, f"checkpoint.async_save={saving == 'async'}")
    killed = train(tmp_path, "resumed", *common, env={"MINDSCALE_FAULT": "checkpoint_write:6"}, check=False)
    assert killed.returncode == -9
    run = tmp_path / "resumed"
    assert ckpt.latest_checkpoint(run / "checkpoints").name == "step_00000003"
    resumed = train(tmp_path, "resumed", *common)
    assert "resumed from" in resumed.stdout and "step_00000003" in resumed.stdout
    straight, again = losses(straight_run()), losses(run)
    assert sorted(again) == list(range(1, 9))
    # On one core MindSpore's CPU kernels are deterministic: the resumed run is bit-identical.
    assert [again[s] for s in range(1, 9)] == [straight[s] for s in range(1, 9)]
    w_straight = ckpt.load_weights(straight_run() / "checkpoints" / "step_00000008")
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
    proc = train(tmp_path, "bad", "train.steps=1", *overrides, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0]


def test_truncated_checkpoint_as_load_path_is_refused(tmp_path):
    step = tmp_path / "src" / "checkpoints" / "step_00000008"
    shutil.copytree(straight_run() / "checkpoints" / "step_00000008", step)
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
