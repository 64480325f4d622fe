"""Checkpoint folders: atomic writes, pruning, verification of truncated/corrupt copies."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mindscale.train.checkpoints import folder as ckpt, commit


def tensors(seed):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


def test_save_load_round_trip(tmp_path):
    for step in (10, 20):
        ckpt.save_checkpoint(
            tmp_path, step, tensors(step), {"adam_m.a": np.ones(3, np.float32)}, {"loss_scale": 1.0}, "run: {}\n"
        )
    kept = ckpt.complete_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_00000010", "step_00000020"]
    weights, optimizer, state = ckpt.load_checkpoint(kept[-1])
    np.testing.assert_array_equal(weights["a.weight"], tensors(20)["a.weight"])
    assert state == {"step": 20, "loss_scale": 1.0} and "adam_m.a" in optimizer
    assert (kept[-1] / "config.yaml").read_text() == "run: {}\n"


def test_truncated_or_unmarked_checkpoints_are_skipped_and_refused(tmp_path):
    good = ckpt.save_checkpoint(tmp_path, 1, tensors(1))
    bad = ckpt.save_checkpoint(tmp_path, 2, tensors(2))
    weights_file = bad / ckpt.WEIGHTS
    weights_file.write_bytes(weights_file.read_bytes()[:-7])
    assert ckpt.latest_checkpoint(tmp_path) == good
    with pytest.raises(ckpt.CheckpointError, match="missing or truncated"):
        ckpt.load_weights(bad)
    (good / ckpt.MARKER).unlink()
    assert ckpt.latest_checkpoint(tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match="no COMPLETE marker"):
        ckpt.load_weights(good)


def test_checksum_mismatch_is_caught_on_full_load(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, tensors(1), state={})
    data = bytearray((path / ckpt.WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (path / ckpt.WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="checksum"):
        ckpt.load_checkpoint(path)


def test_garbage_safetensors_file_is_a_one_line_error(tmp_path):
    file = tmp_path / "x.safetensors"
    file.write_bytes(b"not a tensor file")
    with pytest.raises(ckpt.CheckpointError, match="truncated or not safetensors") as info:
        ckpt.load_weights(file)
    assert "\n" not in str(info.value)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load_weights(tmp_path / "missing")


def test_sigkill_during_write_leaves_previous_checkpoint(tmp_path):
    script = (
        "import numpy as np\n"
        "from mindscale.train.checkpoints import folder as ckpt\n"
        f"root = {str(tmp_path)!r}\n"
        "for step in (1, 2):\n"
        "    ckpt.save_checkpoint(root, step, {'w': np.full(1000, step, np.float32)})\n"
    )
    env = {**os.environ, "MINDSCALE_FAULT": "checkpoint_write:2"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ckpt.Path(__file__).parents[2])
    assert proc.returncode == -9
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001"
    assert ckpt.load_weights(latest)["w"][0] == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers  # the half-written folder is there, hidden, and ignored
    ckpt.save_checkpoint(tmp_path, 2, {"w": np.full(1000, 2, np.float32)})
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000002"


# -- the run-level commit (mindscale/train/checkpoints/commit.py), one rank ---------------------------------------
def saved_and_committed(root, steps, keep_last=2):
    vote = commit.RankVote(1, sharded=False)
    for step in steps:
        ckpt.save_checkpoint(root, step, tensors(step), state={})
        commit.commit(root, root, step, vote, 0, keep_last)
    return vote


def test_commit_records_steps_and_prunes_only_committed_ones(tmp_path):
    ckpt.save_checkpoint(tmp_path, 5, tensors(5), state={})  # written, never committed (a rank died)
    saved_and_committed(tmp_path, [10, 20, 30])
    assert commit.committed_steps(tmp_path) == [20, 30]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000020", "step_00000030"]


def test_resume_takes_the_newest_readable_committed_step_and_names_what_it_skips(tmp_path):
    vote = saved_and_committed(tmp_path, [10, 20])
    ckpt.save_checkpoint(tmp_path, 30, tensors(30), state={})  # complete but not committed: not a candidate
    said = []
    assert commit.resume_point(tmp_path, tmp_path, vote, 0, None, said.append).name == "step_00000020"
    newest = tmp_path / "step_00000020" / ckpt.WEIGHTS
    data = bytearray(newest.read_bytes())
    data[-1] ^= 1
    newest.write_bytes(bytes(data))
    assert commit.resume_point(tmp_path, tmp_path, vote, 0, None, said.append).name == "step_00000010"
    assert len(said) == 1 and "skipping" in said[0] and "step_00000020" in said[0] and "checksum" in said[0]
    assert commit.committed_steps(tmp_path) == [10]  # the skipped step left the run's history
    with pytest.raises(ckpt.CheckpointError, match=r"resume_step=20 is not a committed step .*\[10\]"):
        commit.resume_point(tmp_path, tmp_path, vote, 0, 20)


def test_resume_step_refuses_an_unreadable_step_instead_of_falling_back(tmp_path):
    vote = saved_and_committed(tmp_path, [10, 20])
    (tmp_path / "step_00000010" / ckpt.WEIGHTS).write_bytes(b"")
    assert commit.resume_point(tmp_path, tmp_path, vote, 0, 20).name == "step_00000020"
    assert commit.committed_steps(tmp_path) == [10, 20]
    with pytest.raises(ckpt.CheckpointError, match="resume_step=10: .*truncated.*pick another"):
        commit.resume_point(tmp_path, tmp_path, vote, 0, 10)


def test_no_readable_committed_step_refuses_instead_of_starting_over(tmp_path):
    vote = saved_and_committed(tmp_path, [10, 20])
    for step in (10, 20):
        (tmp_path / ckpt.step_dir_name(step) / ckpt.WEIGHTS).write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match=r"no committed step .*\(\[10, 20\]\) can be read by every rank"):
        commit.resume_point(tmp_path, tmp_path, vote, 0, None, print)


def test_resume_prefers_a_healthy_step_and_takes_the_newest_readable_when_none_is(tmp_path):
    vote = commit.RankVote(1, sharded=False)
    bad = {"healthy": False, "health": {"steps": 10, "non_finite_losses": 2, "longest_skip_streak": 0}}
    for step, state in [(10, {}), (20, {"healthy": True}), (30, bad)]:  # 10: saved before the flag existed
        ckpt.save_checkpoint(tmp_path, step, tensors(step), state=state)
        commit.commit(tmp_path, tmp_path, step, vote, 0, keep_last=3)
    said = []
    assert commit.resume_point(tmp_path, tmp_path, vote, 0, None, said.append).name == "step_00000020"
    assert said == [
        "checkpoint: passing over unhealthy step 30 (2 non-finite loss(es), 0 update(s) in a row skipped "
        "in the 10 steps before it); resuming from healthy step 20; the later steps leave the run's "
        "history (their folders are removed at the next save)"
    ]
    assert commit.committed_steps(tmp_path) == [10, 20]  # the passed-over step left the run's history
    none_healthy = tmp_path / "none_healthy"
    for step in (10, 20):
        ckpt.save_checkpoint(none_healthy, step, tensors(step), state=bad)
        commit.commit(none_healthy, none_healthy, step, vote, 0, keep_last=3)
    said.clear()
    assert commit.resume_point(none_healthy, none_healthy, vote, 0, None, said.append).name == "step_00000020"
    assert said == [
        "checkpoint: no healthy committed step; resuming from unhealthy step 20 (2 non-finite loss(es), "
        "0 update(s) in a row skipped in the 10 steps before it)"
    ]


def test_a_run_without_a_commit_record_resumes_from_its_complete_folders(tmp_path):
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, tensors(step), state={})
    (tmp_path / "step_00000002" / ckpt.MARKER).unlink()
    assert commit.committed_steps(tmp_path) is None
    assert commit.resume_point(tmp_path, tmp_path, commit.RankVote(1, sharded=False), 0, None).name == "step_00000001"
    assert commit.resume_point(tmp_path / "none", tmp_path / "none", commit.RankVote(1, sharded=False), 0, None) is None


def test_a_sharded_rank_reads_only_its_slice_of_full_weights(tmp_path):
    """checkpoint.load_path in a sharded run (models.SlicedWeights): one rank's eighth of a 256 MiB tensor
    is read without the rest. Measured by the kernel before and after the read, with the result held:
    the bytes read (/proc/self/io rchar) and the process's own resident memory (RssAnon: page cache is
    not held) grow by the whole tensor for a whole read, by about its eighth for a slice."""
    from safetensors.numpy import save_file

    file = tmp_path / "model.safetensors"
    save_file({"w": np.arange(8192 * 8192, dtype=np.float32).reshape(8192, 8192)}, str(file))
    layout = ([8], [0, -1], None, 1, True, "", [8192, 8192])  # dim 0 split 8 ways
    script = (
        "import os, sys\n"
        "from models.weights import SlicedWeights\n"
        "rss = lambda: int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1]) >> 10\n"
        "rchar = lambda: int(next(l for l in open('/proc/self/io') if l.startswith('rchar')).split()[1])\n"
        f"lazy = SlicedWeights.of_file({str(file)!r})\n"
        "before, read = rss(), rchar()\n"
        f"part = lazy.local('w', {layout!r}, 2) if sys.argv[1] == 'slice' else lazy['w']\n"
        "print(float(part[0, 0]), part.shape[0], rss() - before, (rchar() - read) >> 20)\n"
    )
    added, read = {}, {}
    for how in ("slice", "whole"):
        out = subprocess.run(
            [sys.executable, "-c", script, how],
            cwd=ckpt.Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout.split()
        added[how], read[how] = int(out[2]), int(out[3])
        if how == "slice":
            assert float(out[0]) == 2 * 1024 * 8192 and int(out[1]) == 1024  # rank 2's rows start at 2048
    assert added["whole"] >= 250 and added["slice"] <= 40, added  # MiB
    assert read == {"slice": 32, "whole": 256}, read


def test_pruning_keeps_the_newest_healthy_step_beyond_keep_last(tmp_path):
    """A run that keeps saving while unhealthy must still be able to go back to its last healthy step."""
    vote = commit.RankVote(1, sharded=False)
    bad = {"healthy": False, "health": {"steps": 10, "non_finite_losses": 1, "longest_skip_streak": 0}}
    for step in (10, 20, 30, 40):
        healthy = step <= 20
        ckpt.save_checkpoint(tmp_path, step, tensors(step), state={"healthy": True} if healthy else bad)
        commit.commit(tmp_path, tmp_path, step, vote, 0, keep_last=2, healthy=healthy)
    assert commit.committed_steps(tmp_path) == [20, 30, 40]  # keep_last 2, and the newest healthy one
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000020", "step_00000030", "step_00000040"]
    assert commit.resume_point(tmp_path, tmp_path, vote, 0, None, lambda line: None).name == "step_00000020"
    assert commit.committed_steps(tmp_path) == [20]
    ckpt.save_checkpoint(tmp_path, 30, tensors(30), state={"healthy": True})
    commit.commit(tmp_path, tmp_path, 30, vote, 0, keep_last=2)
    assert commit.committed_steps(tmp_path) == [20, 30]  # healthy again: keep_last alone


def test_a_save_removes_temporary_folders_a_killed_save_left(tmp_path):
    stale = tmp_path / ".tmp-step_00000010-99999999"  # the pid of a process killed mid-write
    stale.mkdir(parents=True)
    (stale / ckpt.WEIGHTS).write_bytes(b"partial")
    ckpt.save_checkpoint(tmp_path, 20, tensors(20), state={})
    assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020"]


# -- what a resume refuses before the step compiles -------------------------------------------------------
def sharded_steps(root, step: int, ranks: int) -> dict:
    """A sharded run's committed step as its ranks write it: rank_<r>/step_X with the layout record."""
    from mindscale.config import REPO_ROOT, Layout, load_config

    cfg = load_config(
        REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml",
        [
            "hardware=ascend910b",
            "parallel.data_parallel=2",
            "parallel.model_parallel=2",
            "parallel.pipeline_stage=2",
            "parallel.micro_batch_num=2",
            "model.compute_dtype=float16",
        ],
    )
    record = ckpt.layout_record(cfg, Layout.of(cfg, "Ascend"))
    for rank in range(ranks):
        ckpt.save_checkpoint(root / f"rank_{rank}", step, tensors(rank), state={"layout": record})
    commit.record_steps(root, [step])
    return record


def test_a_step_of_another_layout_is_refused_naming_the_resharding_tool(tmp_path):
    """One worker resuming a folder of a sharded run's rank folders (or a sharded run an unsharded step)
    is told to reshard, not to start over (which would throw the run away)."""
    record = sharded_steps(tmp_path, 4, ranks=8)
    vote = commit.RankVote(1, sharded=False)
    with pytest.raises(ckpt.CheckpointError) as refused:
        commit.resume_point(tmp_path, tmp_path, vote, 0, None, layout={})
    folder = tmp_path / "rank_0" / "step_00000004"
    assert str(refused.value) == (
        f"{folder} was written sharded over 8 devices (data_parallel 2, model_parallel 2, pipeline_stage 2, "
        "expert_parallel 1, optimizer_shard False), this run is unsharded (rank 0 writes whole tensors): its tensors "
        f"do not load here; reshard it: python tools/reshard.py --input {folder} --config <this run's config> "
        "--output <a new run>/checkpoints, then resume with that run.name"
    )
    whole = tmp_path / "whole"
    ckpt.save_checkpoint(whole, 4, tensors(4), state={"layout": {}})
    commit.record_steps(whole, [4])
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"step_00000004 was written unsharded \(rank 0 writes whole "
        r"tensors\), this run is sharded over 8 devices .*tools/reshard.py",
    ):
        commit.resume_point(whole, whole / "rank_3", vote, 3, None, layout=record)
    assert commit.committed_steps(tmp_path) == [4] and commit.committed_steps(whole) == [4]  # nothing changed


def test_a_folder_no_rank_can_read_is_not_advised_away(tmp_path):
    vote = saved_and_committed(tmp_path, [10])
    (tmp_path / "step_00000010" / ckpt.WEIGHTS).write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError) as refused:
        commit.resume_point(tmp_path, tmp_path, vote, 0, None, lambda line: None)
    assert "resume=false" not in str(refused.value) and "name a new run.name and keep these steps" in str(refused.value)


@pytest.mark.integration
def test_a_checkpoint_of_another_model_shape_is_refused_before_the_step_compiles(tmp_path):
    """checkpoint.load_path and a resume, with model.hidden_size 128 against a checkpoint of 64: one line
    naming the first parameter, both shapes, the model key its config.yaml differs in and the fix, from the
    files' headers, before the compile (the shared one-worker run's step 6)."""
    from tests.integration.tiny_runs import one_worker_run, train
    import shutil

    run = ckpt.Path(one_worker_run()["run"])
    step = run / "checkpoints" / "step_00000006"
    loaded = train(
        tmp_path, "wider", "model.hidden_size=128", f"checkpoint.load_path={step}", "train.steps=1", check=False
    )
    shutil.copytree(run / "checkpoints", tmp_path / "resumed" / "checkpoints")
    resumed = train(
        tmp_path, "resumed", "model.hidden_size=128", "train.micro_batch_size=4", "train.steps=7", check=False
    )
    differ = (
        "tok_embeddings.weight is (256, 64) there, (256, 128) here (and 11 more); its config.yaml has "
        "model.hidden_size=64 (this run 128)"
    )
    for proc, source, fix in [
        (loaded, f"checkpoint.load_path={step}", "use the model config it was trained with"),
        (
            resumed,
            tmp_path / "resumed" / "checkpoints" / "step_00000006",
            "resume with the model keys it was saved with (its config.yaml)",
        ),
    ]:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and errors == [f"error: {source} does not fit this model: {differ}: {fix}"], (
            proc.stderr[-2000:]
        )
        assert "compiled the train step" not in proc.stdout
    assert not (tmp_path / "wider" / "checkpoints").exists()
    assert commit.committed_steps(tmp_path / "resumed" / "checkpoints") == [6]
