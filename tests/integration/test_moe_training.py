"""End-to-end training on CPU through the real entry points: a mixture of experts.

Each run is a separate process, as a user would start it: MindSpore's global context makes
in-process runs leak into each other.
"""

import subprocess

import numpy as np

from mindscale.train.checkpoints import folder as ckpt
from mindscale.config import REPO_ROOT
from tests.integration.tiny_runs import (
    DEEPSEEK_V3_TINY,
    TWO_WORKER_DEEPSEEK,
    digests,
    global_batch_counts,
    metrics,
    router_biases,
    sets,
    train,
)


BIAS_RATE = 0.01


def test_deepseek_v3_trains_on_two_workers_and_balances_its_experts_by_the_global_counts(tmp_path, corpus):
    """configs/tiny/deepseek_v3_tiny.yaml (one dense layer, one of 8 sigmoid-routed experts) on two data-parallel
    workers (scripts/run_distribute.sh) with 2 micro batches a step and bias_update_rate 0.01: the loss falls on
    the real corpus; every record holds aux_loss, seq_aux_loss and the busiest expert's load over the mean (>= 1);
    both workers end with the same weights, router bias included; and over the last 3 steps each bias update is
    numpy's rate x sign(mean - count) of the counts of the step's whole global batch (both workers' rows, both
    micro batches), counted here in one forward of the previous checkpoint over those rows."""
    run = tmp_path / "moe"
    launch = subprocess.run(
        [
            "bash",
            "scripts/run_distribute.sh",
            DEEPSEEK_V3_TINY,
            "2",
            *sets(*TWO_WORKER_DEEPSEEK, f"run.output_dir={tmp_path}", f"data.path={corpus / 'mr'}"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, 21)) and records[-1]["devices"] == 2
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    for r in records:
        assert r["aux_loss"] > 0 and r["seq_aux_loss"] > 0 and r["expert_load_max"] >= 1
    assert len(digests(run / "logs")) == 1
    steps = [17, 18, 19, 20]
    biases = [router_biases(run / "checkpoints" / f"step_{s:08d}") for s in steps]
    assert np.any(biases[-1] != 0)
    counts = global_batch_counts(run, steps)
    for before, after, count in zip(biases, biases[1:], counts):
        expected = before + np.float32(BIAS_RATE) * np.sign(count.mean() - count).astype(np.float32)
        np.testing.assert_array_equal(after, expected)


# multi-head latent attention, a dense then an expert layer of capacity 1 (tokens dropped), the router bias moving,
# a multi-token-prediction module (its own expert layer and bias)
RESUMED = ["model.num_kv_heads=null", "model.num_layers=2", "model.moe.capacity_factor=1.0", "model.mtp_depth=1"]


def test_mixture_of_experts_resumes_bit_identical(tmp_path):
    """DeepSeek-V3 tiny with its multi-token-prediction module, three steps, then three more from the checkpoint:
    the same losses (the module's too), router statistics and weights, router biases included, as six steps in one
    go (one worker on one core: MindSpore's CPU kernels are
    deterministic). It did not resume so while the value padding's CPU gradient kernel was right on its first
    launch only (models/mla.py)."""
    for name, steps in (("straight", 6), ("resumed", 3), ("resumed", 6)):
        moe = [*RESUMED, f"model.moe.bias_update_rate={BIAS_RATE}", f"train.steps={steps}"]
        proc = train(tmp_path, name, *moe, config=DEEPSEEK_V3_TINY)
    assert "resumed from" in proc.stdout
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    kept = ("loss", "aux_loss", "mtp_loss", "expert_load_max")
    assert all(key in straight[0] for key in kept), straight[0]
    assert [[r[key] for key in kept] for r in resumed] == [[r[key] for key in kept] for r in straight]
    w_straight = ckpt.load_weights(tmp_path / "straight" / "checkpoints" / "step_00000006")
    w_resumed = ckpt.load_weights(tmp_path / "resumed" / "checkpoints" / "step_00000006")
    assert w_straight.keys() == w_resumed.keys() and any(k.endswith("experts.w1") for k in w_straight)
    assert "mtp.0.block.feed_forward.routing.router_bias" in w_straight
    assert all(np.array_equal(w_straight[k], w_resumed[k]) for k in w_straight)
    assert np.any(router_biases(tmp_path / "straight" / "checkpoints" / "step_00000006") != 0)
