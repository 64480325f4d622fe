"""MindFormers import: a tiny MindFormers 1.9 LlamaForCausalLM with random weights (separate and fused
q/k/v and gate/up), saved with ms.save_checkpoint, gives MindScale the same logits as MindFormers' own
forward, through the library, `checkpoint.load_path` and tools/convert_checkpoint.py --direction mf2ms."""

import json
import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import models
from mindscale.config import REPO_ROOT, config_from_tree
from mindscale.io import CheckpointError
from models.mf_convert import is_mindformers_checkpoint, mf_views, model_config_from_mf, read_mindformers
from models.tensor_file import open_ckpt
from tests.slices import assert_every_slice_matches
from tests.modes import cpu_mode

os.environ.setdefault("LOG_MF_PATH", str(REPO_ROOT / "output" / "mindformers_log"))

DIMS = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    n_kv_heads=2,
    intermediate_size=96,
    vocab_size=128,
    seq_length=16,
    rms_norm_eps=1e-5,
    theta=20000.0,
)
MF_YAML = {"model": {"model_config": {"type": "LlamaConfig", **DIMS}, "arch": {"type": "LlamaForCausalLM"}}}


pynative_mode = cpu_mode("pynative")


@pytest.fixture(scope="module", params=[False, True], ids=["separate", "qkv_concat"])
def saved(request, tmp_path_factory):
    """(ckpt path, yaml path, MindFormers logits of fixed ids, ids)."""
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    import yaml

    ms.set_seed(0)
    config = LlamaConfig(
        batch_size=2,
        **DIMS,
        compute_dtype="float32",
        param_init_type="float32",
        layernorm_compute_type="float32",
        softmax_compute_type="float32",
        rotary_dtype="float32",
        use_rope_slice=True,
        fused_rms_norm=False,
        use_flash_attention=False,
        qkv_concat=request.param,
    )
    network = LlamaForCausalLM(config)
    rng = np.random.default_rng(0)
    for p in network.get_parameters():  # norms too: nothing hides behind an initial value
        p.set_data(Tensor(rng.normal(0, 0.2 if p.ndim == 2 else 1.0, p.shape).astype(np.float32)))
    network.set_train(False)
    ids = rng.integers(1, DIMS["vocab_size"], (2, DIMS["seq_length"])).astype(np.int32)
    logits = network(Tensor(ids))[0].asnumpy().reshape(2, DIMS["seq_length"], -1)
    folder = tmp_path_factory.mktemp("mf")
    ms.save_checkpoint(network, str(folder / "llama.ckpt"))
    (folder / "llama.yaml").write_text(yaml.safe_dump(MF_YAML))
    return folder / "llama.ckpt", folder / "llama.yaml", logits, ids


def ours(cfg, weights, ids) -> np.ndarray:
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    return model(Tensor(ids)).asnumpy()


def test_logits_equal_mindformers_forward(saved):
    ckpt, yaml_path, mf_logits, ids = saved
    assert is_mindformers_checkpoint(ckpt)
    state = read_mindformers(ckpt)
    keys = model_config_from_mf(state, yaml_path)
    assert keys == {
        "arch": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_layers": 2,
        "ffn_hidden_size": 96,
        "tie_embeddings": False,
        "num_heads": 4,
        "num_kv_heads": 2,
        "rope_theta": 20000.0,
        "norm_eps": 1e-5,
        "seq_length": 16,
    }
    cfg = config_from_tree({"model": keys})
    weights = models.weights.SlicedWeights(mf_views(state, 4, 2))
    np.testing.assert_allclose(ours(cfg, weights, ids), mf_logits, atol=1e-5)
    # checkpoint.load_path takes the file as it is, split by the run config's head counts
    np.testing.assert_allclose(ours(cfg, models.load_pretrained(ckpt, cfg), ids), mf_logits, atol=1e-5)


def test_a_sharded_rank_reads_its_slices_of_the_fused_tensors(saved):
    """load_pretrained(..., sliced=True) of a MindFormers .ckpt (a sharded run's checkpoint.load_path):
    every rank's slice, read through the rows of the fused w_qkv and w_gate_hidden, equals the same slice
    of the whole conversion, for splits of each dimension, with and without the optimizer shard."""
    ckpt = saved[0]
    cfg = config_from_tree({"model": model_config_from_mf(read_mindformers(ckpt), saved[1])})
    whole = models.load_pretrained(ckpt, cfg)
    lazy = models.load_pretrained(ckpt, cfg, sliced=True)
    assert isinstance(lazy, models.weights.SlicedWeights) and lazy.keys() == whole.keys()
    assert_every_slice_matches(lazy, whole)


def _rchar() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/io") if line.startswith("rchar:"))


def test_a_ckpt_is_read_lazily_as_mindspore_wrote_it(tmp_path, monkeypatch):
    """models/tensor_file.py's .ckpt reader against MindSpore's own: a BF16 tensor, a scalar, an int
    counter, a CRC trailer, and tensors MindSpore writes in several pieces (its 512 MB piece size lowered
    to 16 KB here, so a small tensor is cut as a large one is) read to the same values, whole and in
    parts; opening the file reads headers only (the optimizer moments' bytes are never read)."""
    import mindspore.train.serialization as serialization

    rng = np.random.default_rng(0)
    big = rng.standard_normal((300, 70)).astype(np.float32)
    tensors = {
        "model.big": Tensor(big),
        "model.half": Tensor(rng.standard_normal((6, 4)).astype(np.float32), ms.bfloat16),
        "model.scale": Tensor(np.float32(2.5)),
        "global_step": Tensor(np.array([7], np.int32)),
        "adam_m.big": Tensor(rng.standard_normal((3000, 70)).astype(np.float32)),
    }
    monkeypatch.setattr(serialization, "SLICE_SIZE", 16)  # KB
    ms.save_checkpoint([{"name": n, "data": t} for n, t in tensors.items()], str(tmp_path / "x.ckpt"), crc_check=True)
    theirs = ms.load_checkpoint(str(tmp_path / "x.ckpt"))
    ours = open_ckpt(tmp_path / "x.ckpt", lambda name: True)
    assert ours.keys() == theirs.keys() and len(ours["model.big"].extents) > 1
    for name, value in theirs.items():
        expected = (value.astype(ms.float32) if value.dtype == ms.bfloat16 else value).asnumpy()
        np.testing.assert_array_equal(ours[name][...], expected, err_msg=name)
    np.testing.assert_array_equal(ours["model.big"][(slice(40, 250), slice(3, 9))], big[40:250, 3:9])
    np.testing.assert_array_equal(ours["model.big"][(np.array([0, 5, 299]), slice(0, 70))], big[[0, 5, 299]])
    before = _rchar()
    model_only = open_ckpt(tmp_path / "x.ckpt", lambda name: name.startswith("model."))
    assert sorted(model_only) == ["model.big", "model.half", "model.scale"]
    assert _rchar() - before < (tmp_path / "x.ckpt").stat().st_size // 20  # 256-byte headers, no contents


def test_a_foreign_or_truncated_ckpt_is_one_line(tmp_path, saved):
    (tmp_path / "junk.ckpt").write_bytes(b"\x0a\xff\xff\xff\x0fnot a checkpoint")
    (tmp_path / "cut.ckpt").write_bytes(saved[0].read_bytes()[:1000])
    for name in ("junk.ckpt", "cut.ckpt"):
        with pytest.raises(CheckpointError, match=f"{name} cannot be read as a MindSpore checkpoint") as error:
            read_mindformers(tmp_path / name)
        assert "\n" not in str(error.value)


@pytest.mark.integration
def test_cli_mf2ms_and_bad_input(saved, tmp_path):
    ckpt, yaml_path, mf_logits, ids = saved

    def run(*args):
        return subprocess.run(
            [sys.executable, "tools/convert_checkpoint.py", "--direction", "mf2ms", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    proc = run("--input", str(ckpt), "--mf-yaml", str(yaml_path), "--output", str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    weights = models.weights.load_weights(result["output"])
    cfg = config_from_tree({"model": model_config_from_mf(read_mindformers(ckpt), yaml_path)})
    np.testing.assert_allclose(ours(cfg, weights, ids), mf_logits, atol=1e-5)
    for args, needle in (
        (["--input", str(ckpt)], "head counts"),
        (["--input", str(tmp_path / "none.ckpt"), "--mf-yaml", str(yaml_path)], "none.ckpt"),
    ):
        proc = run(*args, "--output", str(tmp_path / "bad"))
        errors = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-1000:]
        assert not (tmp_path / "bad").exists()
