"""Learning-rate schedule and weight-decay grouping."""
import math

import pytest

from mindscale.config import TrainConfig
from mindscale.train.loop.schedule import decays, lr_at


def test_warmup_then_cosine_reaches_min_lr():
    t = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10, lr_schedule="cosine")
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, t) == pytest.approx(0.1)


def test_linear_and_constant():
    lin = TrainConfig(steps=10, lr=1.0, min_lr=0.0, warmup_steps=0, lr_schedule="linear")
    assert [round(lr_at(s, lin), 3) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    const = TrainConfig(steps=10, lr=0.5, min_lr=0.0, warmup_steps=2, lr_schedule="constant")
    assert [lr_at(s, const) for s in (0, 1, 2, 9)] == [0.25, 0.5, 0.5, 0.5]


def test_no_decay_on_norms_and_biases():
    assert decays("layers.0.attention.wq.weight", (8, 8))
    assert decays("tok_embeddings.weight", (100, 8))
    assert not decays("layers.0.attention_norm.weight", (8,))
    assert not decays("layers.0.ln_1.bias", (8,))
    assert not decays("norm.weight", (8,))
