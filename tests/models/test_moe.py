"""The mixture-of-experts layer (models/moe.py) against a numpy loop over tokens: routing, renormalised or raw
top-k weights, capacity dropping in priority order (every first choice before any second, then token order),
token groups (one per data-parallel rank), the shared expert and the router statistics (over every token or over
a loss mask's). The dropless case is also checked against transformers in test_hf_convert.py, test_generate.py
and, its gradients in SFT with padding, test_moe_sft_parity.py."""

import json
import math
import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindscale.config import REPO_ROOT
from mindscale.launch.standins import jemalloc
from models.moe import MoE, expert_capacity
from tests.modes import cpu_mode

pynative_mode = cpu_mode("pynative")

H, F, SHARED = 8, 12, 6


def silu(x):
    return x / (1 + np.exp(-x))


def swiglu(x, w1, w3, w2):
    return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference(layer: MoE, x: np.ndarray, capacity_factor, mask=None) -> tuple[np.ndarray, np.ndarray]:
    """(y, [aux, max load / mean load]) token by token; the statistics over the tokens `mask` marks (None: all),
    every token routed."""
    router = layer.router.weight.asnumpy()
    w1, w3, w2 = (getattr(layer.experts, w).asnumpy() for w in ("w1", "w3", "w2"))
    e, k, g = layer.num_experts, layer.top_k, layer.groups
    logits = x @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    choices = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, choices, -1)
    if layer.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    t = len(x) // g
    slots = expert_capacity(t, k, capacity_factor, e)
    for group in range(g):
        used = np.zeros(e, int)
        for j in range(k):  # first choices of the whole group first
            for token in range(group * t, (group + 1) * t):
                expert = choices[token, j]
                if used[expert] < slots:
                    used[expert] += 1
                    y[token] += weights[token, j] * swiglu(x[token], w1[expert], w3[expert], w2[expert])
    if layer.shared_expert is not None:
        s = layer.shared_expert
        y += swiglu(x, s.w1.weight.asnumpy(), s.w3.weight.asnumpy(), s.w2.weight.asnumpy())
    counted = np.ones(len(x), bool) if mask is None else mask.ravel() > 0
    fraction = np.zeros(e)
    np.add.at(fraction, choices[counted].ravel(), 1.0 / counted.sum())
    return y, np.array([e * (fraction * probs[counted].mean(0)).sum(), fraction.max() / fraction.mean()])


# an SFT loss mask [B, S] over the 24 tokens as 2 rows of 12: answers trained, prompts and padding not
SFT_MASK = np.array([[0] * 3 + [1] * 9, [0] * 2 + [1] * 4 + [0] * 6], np.float32)


@pytest.mark.parametrize(
    "experts, top_k, norm, capacity_factor, groups, shared, mask",
    [
        (4, 2, True, None, 1, 0, None),  # Mixtral-like, dropless
        (4, 2, True, None, 1, 0, SFT_MASK),  # the same, its statistics over the trained tokens only
        (8, 3, False, 0.75, 1, 0, None),  # Qwen3-MoE-like weights, a quarter of the slots short: tokens drop
        (4, 1, True, 1.0, 2, SHARED, SFT_MASK),  # Switch-like top-1 in two data-parallel groups, a shared expert
    ],
    ids=["mixtral", "mixtral-sft", "qwen3-moe-drops", "switch-groups-sft"],
)
def test_layer_matches_a_loop_over_tokens(experts, top_k, norm, capacity_factor, groups, shared, mask):
    ms.set_seed(0)
    layer = MoE(H, F, experts, top_k, norm, capacity_factor, groups, 1, shared, 0.5, 0.5, ms.float32, ms.float32)
    x = np.random.default_rng(1).normal(size=(24, H)).astype(np.float32)
    y, stats = layer(Tensor(x), None if mask is None else Tensor(mask))
    want_y, want_stats = reference(layer, x.astype(np.float64), capacity_factor, mask)
    np.testing.assert_allclose(y.asnumpy(), want_y, atol=1e-5)
    np.testing.assert_allclose(stats.asnumpy()[:2], want_stats, rtol=1e-5)  # [2]: the sequence-wise loss, 0 here
    if capacity_factor == 0.75:  # the case drops tokens, or it would not test dropping
        dropless, _ = reference(layer, x.astype(np.float64), None)
        assert not np.allclose(dropless, want_y, atol=1e-3)


def test_statistics_count_only_the_masked_tokens_and_none_is_zero_not_nan():
    """The padding's routing changes neither statistic; a mask with no trained token gives [0, 0]."""
    ms.set_seed(0)
    layer = MoE(H, F, 4, 2, True, None, 1, 1, 0, 0.5, 0.5, ms.float32, ms.float32)
    x = np.random.default_rng(1).normal(size=(24, H)).astype(np.float32)
    other_padding = x.copy()
    other_padding[SFT_MASK.ravel() == 0] = np.random.default_rng(2).normal(size=(11, H))
    stats = [layer(Tensor(rows), Tensor(SFT_MASK))[1].asnumpy() for rows in (x, other_padding)]
    np.testing.assert_array_equal(stats[0], stats[1])
    assert not np.allclose(layer(Tensor(other_padding))[1].asnumpy(), stats[0])  # unmasked, the padding counts
    np.testing.assert_array_equal(layer(Tensor(x), Tensor(np.zeros_like(SFT_MASK)))[1].asnumpy(), [0.0, 0.0, 0.0])


def test_capacity_is_mindformers_rounded_up_and_at_most_every_token():
    assert expert_capacity(24, 2, 1.25, 8) == math.ceil(2 * 24 * 1.25 / 8) == 8
    assert expert_capacity(24, 2, None, 8) == 24
    assert expert_capacity(24, 8, 4.0, 8) == 24


def test_sigmoid_router_matches_transformers_deepseek_v3_and_its_bias_steers_only_the_choice():
    """16 experts in 4 groups, 2 kept, top-4, renormalised and scaled by 2.5: transformers' DeepseekV3TopkRouter on
    the same logits and correction bias chooses the same experts with the same weights; the bias (positive, as
    HF's masked_fill(0) then agrees with the reference's -inf) changes choices; it is not trained."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from models.router import SigmoidRouting

    config = DeepseekV3Config(
        hidden_size=H,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    rng = np.random.default_rng(2)
    x, weight = rng.normal(size=(32, H)).astype(np.float32), rng.normal(size=(16, H)).astype(np.float32)
    bias = rng.uniform(0.0, 0.3, 16).astype(np.float32)
    hf = DeepseekV3TopkRouter(config)
    ours = SigmoidRouting(16, 4, 4, 2, True, 2.5)
    assert not ours.router_bias.requires_grad
    logits = Tensor(x @ weight.T)
    chosen = {}
    for b in (np.zeros(16, np.float32), bias):
        with torch.no_grad():
            hf.weight.copy_(torch.from_numpy(weight))
            hf.e_score_correction_bias.copy_(torch.from_numpy(b))
            want_experts, want_weights = (t.numpy() for t in hf(torch.from_numpy(x)))
        ours.router_bias.set_data(Tensor(b))
        weights, experts, probs = (t.asnumpy() for t in ours(logits))
        order, want_order = np.argsort(experts, -1), np.argsort(want_experts, -1)  # HF's top-k is unsorted
        np.testing.assert_array_equal(
            np.take_along_axis(experts, order, -1), np.take_along_axis(want_experts, want_order, -1)
        )
        np.testing.assert_allclose(
            np.take_along_axis(weights, order, -1), np.take_along_axis(want_weights, want_order, -1), rtol=1e-6
        )
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
        chosen[float(b.sum())] = np.sort(experts, -1)
    assert not np.array_equal(*chosen.values())


READ_STATISTICS = """
import json, sys
import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
import models
from mindscale.config import load_config

class Statistics(nn.Cell):
    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, ids):
        return self.model.decode(ids)[1]

cfg = load_config(sys.argv[1], ["model.moe.dense_layers=0", "model.num_layers=2", "model.seq_length=16",
                                "run.reuse_layer_graph=true", "parallel.data_parallel=1"])
model = models.build_model(cfg)
ids = Tensor(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16)).astype(np.int32))
out = []
for mode in (ms.GRAPH_MODE, ms.PYNATIVE_MODE):
    ms.set_context(mode=mode)
    out.append(Statistics(model)(ids).asnumpy().tolist())
print(json.dumps(out))
"""


@pytest.mark.integration
@pytest.mark.skipif(jemalloc() is None, reason="needs jemalloc (Debian: libjemalloc2) for its junk fill")
def test_statistics_through_the_reused_layer_graph_read_no_freed_memory(tmp_path):
    """Two expert layers in one reused graph, graph mode on CPU, every allocation and freed block filled with junk
    (jemalloc's junk:true): the router statistics equal PyNative's. With the constant `no_routing` fed to the
    reused graph as such, the second call read freed memory (2.03 for 4.06; CausalLM.decode's start_routing)."""
    env = {**os.environ, "LD_PRELOAD": jemalloc(), "MALLOC_CONF": "junk:true"}
    script = tmp_path / "statistics.py"  # a file: graph mode reads the Cell's source
    script.write_text(READ_STATISTICS)
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO_ROOT / "configs/tiny/deepseek_v3_tiny.yaml")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    graph, pynative = json.loads(proc.stdout.splitlines()[-1])
    np.testing.assert_allclose(graph, pynative, rtol=1e-5)
