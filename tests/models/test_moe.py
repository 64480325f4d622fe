"""The mixture-of-experts layer (models/moe.py) against a numpy loop over tokens: routing, renormalised or raw
top-k weights, capacity dropping in priority order (every first choice before any second, then token order),
token groups (one per data-parallel rank), the shared expert and the router statistics. The dropless case is
also checked against transformers in test_hf_convert.py and test_generate.py."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from models.moe import MoE, expert_capacity
from tests.modes import cpu_mode

pynative_mode = cpu_mode("pynative")

H, F, SHARED = 8, 12, 6


def silu(x):
    return x / (1 + np.exp(-x))


def swiglu(x, w1, w3, w2):
    return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference(layer: MoE, x: np.ndarray, capacity_factor) -> tuple[np.ndarray, np.ndarray]:
    """(y, [aux, max load / mean load]) token by token."""
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
    fraction = np.zeros(e)
    np.add.at(fraction, choices.ravel(), 1.0 / len(x))
    return y, np.array([e * (fraction * probs.mean(0)).sum(), fraction.max() / fraction.mean()])


@pytest.mark.parametrize("experts, top_k, norm, capacity_factor, groups, shared", [
    (4, 2, True, None, 1, 0),      # Mixtral-like, dropless
    (8, 3, False, 0.75, 1, 0),     # Qwen3-MoE-like weights, a quarter of the slots short: tokens drop
    (4, 1, True, 1.0, 2, SHARED),  # Switch-like top-1 in two data-parallel groups, with a shared expert
])
def test_layer_matches_a_loop_over_tokens(experts, top_k, norm, capacity_factor, groups, shared):
    ms.set_seed(0)
    layer = MoE(H, F, experts, top_k, norm, capacity_factor, groups, 1, shared, 0.5, 0.5, ms.float32, ms.float32)
    x = np.random.default_rng(1).normal(size=(24, H)).astype(np.float32)
    y, stats = layer(Tensor(x))
    want_y, want_stats = reference(layer, x.astype(np.float64), capacity_factor)
    np.testing.assert_allclose(y.asnumpy(), want_y, atol=1e-5)
    np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)
    if capacity_factor == 0.75:  # the case drops tokens, or it would not test dropping
        dropless, _ = reference(layer, x.astype(np.float64), None)
        assert not np.allclose(dropless, want_y, atol=1e-3)


def test_capacity_is_mindformers_rounded_up_and_at_most_every_token():
    assert expert_capacity(24, 2, 1.25, 8) == math.ceil(2 * 24 * 1.25 / 8) == 8
    assert expert_capacity(24, 2, None, 8) == 24
    assert expert_capacity(24, 8, 4.0, 8) == 24
