"""End-to-end training on CPU through the real entry points: a mixture of experts.

Each run is a separate process, as a user would start it: MindSpore's global context makes
in-process runs leak into each other.
"""

import subprocess
import sys

import numpy as np

from mindscale.train.checkpoints import folder as ckpt
from mindscale.config import REPO_ROOT
from tests.cores import one_core
from tests.integration.tiny_runs import TINY, metrics, sets


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
