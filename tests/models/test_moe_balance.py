"""DeepSeek-V3's load balancing on CPU in graph mode (models/moe.py, mindscale/train/loop/step.py ExpertBalance):
the auxiliary-loss-free bias update against numpy over micro batches, a skipped step, a deliberately
unbalanced router, and the sequence-wise balance loss against numpy."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from mindscale.config import Layout, load_config
from mindscale.train.loop.step import EXPERT_LOAD, build_train_graph
from models.moe import MoE
from models.router import SigmoidRouting
from tests.modes import cpu_mode

graph_mode = cpu_mode("graph")

DEEPSEEK_TINY = "configs/tiny/deepseek_v3_tiny.yaml"
RATE = 0.05
SMALL = [
    "model.num_layers=1",
    "model.moe.dense_layers=0",
    "model.vocab_size=128",
    "model.seq_length=16",
    "model.moe.aux_loss_coeff=0",
    "parallel.data_parallel=1",
    "parallel.gradient_accumulation_steps=2",
    "train.micro_batch_size=2",
    "train.loss_spike_factor=3",
]
E, K = 8, 2


class RouterCounts(nn.Cell):
    """The model's forward over every row at once: each MoE layer adds its tokens to its counter."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, ids):
        return self.model.decode(ids)[1]


def build(rate: float):
    ms.set_seed(0)
    cfg = load_config(DEEPSEEK_TINY, [*SMALL, f"model.moe.bias_update_rate={rate}"])
    graph = build_train_graph(cfg, Layout.of(cfg, "CPU", 1))
    bias = next(p for p in graph.model.get_parameters() if p.name.endswith("routing.router_bias"))
    counters = [p for p in graph.step.get_parameters() if p.name.startswith(f"{EXPERT_LOAD}.")]
    return graph, bias, counters


@pytest.fixture(scope="module")
def balanced():
    return build(RATE)


def tokens(seed: int) -> np.ndarray:
    """One step's rows [micro batches x micro batch size, seq + 1]."""
    return np.random.default_rng(seed).integers(0, 128, (4, 17)).astype(np.int32)


def global_counts(graph, counter, rows: np.ndarray) -> np.ndarray:
    """Tokens per expert over all `rows` in one forward (no micro batches), through the same counter."""
    counter.set_data(Tensor(np.zeros(counter.shape, np.float32)))
    RouterCounts(graph.model)(Tensor(rows[:, :-1]))
    counts = counter.asnumpy()
    counter.set_data(Tensor(np.zeros(counter.shape, np.float32)))
    return counts


def test_bias_moves_by_the_sign_of_the_global_batch_counts_over_micro_batches(balanced):
    """Three steps of two micro batches: after each, bias += rate x sign(mean - count) with the counts of the
    whole step's rows (one forward over all of them, here), as numpy computes it; the counters are zero
    between steps; the bias is a weight of the model, not optimizer state; the counters neither."""
    graph, bias, (counter,) = balanced
    state = {p.name for p in graph.optimizer_state()}
    assert not any("router_bias" in n or n.startswith(EXPERT_LOAD) for n in state)
    assert counter.name == f"{EXPERT_LOAD}.layers.0.feed_forward.routing.router_bias"
    assert counter.name not in {p.name for p in graph.model.get_parameters()}
    moved = 0
    for step in range(3):
        rows = tokens(step)
        counts = global_counts(graph, counter, rows)
        assert counts.sum() == 4 * 16 * K
        expected = bias.asnumpy() + np.float32(RATE) * np.sign(counts.mean() - counts).astype(np.float32)
        _, _, overflow, _ = graph.step(Tensor(rows))
        assert not overflow.asnumpy()
        np.testing.assert_array_equal(bias.asnumpy(), expected)
        np.testing.assert_array_equal(counter.asnumpy(), 0)
        moved += np.count_nonzero(counts != counts.mean())
    assert moved > 0


def test_a_skipped_step_leaves_the_bias(balanced):
    """The loss-spike guard skips the update (control.loss_limit below the loss): the bias stays, bit for bit,
    and the skipped step's counts are dropped, not carried into the next step."""
    graph, bias, (counter,) = balanced
    limit = next(p for p in graph.step.get_parameters() if p.name == "control.loss_limit")
    before = bias.asnumpy().copy()
    limit.set_data(Tensor(0.0, ms.float32))
    try:
        graph.step(Tensor(tokens(7)))
    finally:
        limit.set_data(Tensor(float("inf"), ms.float32))
    np.testing.assert_array_equal(bias.asnumpy(), before)
    np.testing.assert_array_equal(counter.asnumpy(), 0)


UNBALANCED = np.array([0.5, 0.5, 0, 0, 0, 0, 0, 0], np.float32)  # experts 0 and 1 take every token
# the busiest expert's tokens over the mean, over 8 held-out batches at once (1: even; 4: all tokens on two of 8
# experts)
BALANCED_BOUND = 3.0


def load_ratio(graph, counter, rows) -> float:
    counts = global_counts(graph, counter, rows)
    return float(counts.max() / counts.mean())


def held_out_load_ratio(graph, counter) -> float:
    """load_ratio over 8 batches the training never saw, in one forward (one compile)."""
    return load_ratio(graph, counter, np.concatenate([tokens(1000 + batch) for batch in range(8)]))


def train_from_unbalanced(graph, bias, counter, steps: int, frozen: bool = False) -> tuple[float, float]:
    """The load ratio before and after `steps` steps from UNBALANCED; `frozen`: the bias set back to UNBALANCED
    after every step, which is what rate 0 trains (the update follows the step's optimizer update, whose
    gradients saw the bias as it was), without compiling a second graph."""
    bias.set_data(Tensor(UNBALANCED))
    start = held_out_load_ratio(graph, counter)
    for step in range(steps):
        graph.step(Tensor(tokens(100 + step)))
        if frozen:
            bias.set_data(Tensor(UNBALANCED))
    return start, held_out_load_ratio(graph, counter)


def test_an_unbalanced_router_is_balanced_by_the_bias_and_stays_unbalanced_without(balanced):
    """The bias starts +0.5 on experts 0 and 1, so they take every token (max/mean load 4). 20 steps with rate
    0.05 bring the busiest expert under 3 x the mean on 512 held-out tokens (1.84; the biases are even after 5
    steps, then the router's own weights learn favourites, which the bias holds at 1.8-2.5 up to step 30); 20 more
    from the same start with the bias frozen (rate 0) leave it at 4: training the router's weights does not undo
    it."""
    graph, bias, (counter,) = balanced
    start, end = train_from_unbalanced(graph, bias, counter, 20)
    assert start == 4.0 and end < BALANCED_BOUND, (start, end)
    start, end = train_from_unbalanced(graph, bias, counter, 20, frozen=True)
    assert start == end == 4.0
    # and rate 0 builds no update at all
    frozen = load_config(DEEPSEEK_TINY, [*SMALL, "model.moe.bias_update_rate=0"])
    assert build_train_graph(frozen, Layout.of(frozen, "CPU", 1)).step.balance is None


def test_sequence_wise_loss_equals_numpy():
    """DeepSeek-V3 eq. 17-20 on 3 sequences of 8 tokens, the second one half masked, the third not trained at
    all: per sequence f_e = E/(k T) x its tokens choosing e, P_e their mean normalised score, sum_e f_e P_e, the
    mean over the sequences; computed in numpy from the layer's own routing."""
    h, b, s = 16, 3, 8
    layer = MoE(
        h, 32, E, K, True, None, 1, 1, 0, 0.1, 0.1, ms.float32, ms.float32, SigmoidRouting(E, K, 4, 2, True, 2.5)
    )
    x = np.random.default_rng(3).normal(size=(b * s, h)).astype(np.float32)
    mask = np.ones((b, s), np.float32)
    mask[1, 4:], mask[2] = 0, 0
    _, experts, probs = (t.asnumpy() for t in layer.route(Tensor(x)))
    chosen = np.zeros((b * s, E), np.float32)
    np.put_along_axis(chosen, experts, 1.0, -1)

    def reference(weights):
        losses = []
        for row in range(b):
            w = weights[row][:, None]
            t = max(w.sum(), 1.0)
            f = E / (K * t) * (chosen.reshape(b, s, E)[row] * w).sum(0)
            p = (probs.reshape(b, s, E)[row] * w).sum(0) / t
            losses.append((f * p).sum())
        return np.mean(losses)

    for given, weights in ((None, np.ones((b, s), np.float32)), (Tensor(mask), mask)):
        stats = layer(Tensor(x), given, s)[1].asnumpy()
        np.testing.assert_allclose(stats[2], reference(weights), rtol=1e-6)
