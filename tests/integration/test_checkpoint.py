"""Checkpoint folders: atomic writes, pruning, verification of truncated/corrupt copies."""
import os
import subprocess
import sys

import numpy as np
import pytest

from mindscale.train import checkpoint as ckpt


def tensors(seed):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


def test_save_load_round_trip_and_keep_last(tmp_path):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, tensors(step), {"adam_m.a": np.ones(3, np.float32)},
                             {"loss_scale": 1.0}, "run: {}\n", keep_last=2)
    kept = ckpt.complete_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_00000020", "step_00000030"]
    weights, optimizer, state = ckpt.load_checkpoint(kept[-1])
    np.testing.assert_array_equal(weights["a.weight"], tensors(30)["a.weight"])
    assert state == {"step": 30, "loss_scale": 1.0} and "adam_m.a" in optimizer
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
        "from mindscale.train import checkpoint as ckpt\n"
        f"root = {str(tmp_path)!r}\n"
        "for step in (1, 2):\n"
        "    ckpt.save_checkpoint(root, step, {'w': np.full(1000, step, np.float32)}, keep_last=1)\n")
    env = {**os.environ, "MINDSCALE_FAULT": "checkpoint_write:2"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ckpt.Path(__file__).parents[2])
    assert proc.returncode == -9
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001"
    assert ckpt.load_weights(latest)["w"][0] == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers  # the half-written folder is there, hidden, and ignored
    ckpt.save_checkpoint(tmp_path, 2, {"w": np.full(1000, 2, np.float32)}, keep_last=1)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000002"
