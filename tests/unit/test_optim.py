"""Learning-rate schedule and weight-decay grouping."""

import math

import pytest

from mindscale.config import TrainConfig
from mindscale.train.loop.schedule import decays, lr_at, schedule_change


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


def test_raising_train_steps_on_resume_says_where_the_cosine_moved():
    """Issue 52's run: 60 steps saved, resumed with 80. Step 60 ran at 3.04e-4 near the end of the cosine; step 61
    runs at 9.75e-4 on the schedule recomputed over 80 steps, where the saved one stays at min_lr."""
    saved = {"steps": 60, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20, "lr_schedule": "cosine", "log_interval": 5}
    longer = TrainConfig(**{**saved, "steps": 80})
    assert lr_at(59, TrainConfig(**saved)) == pytest.approx(3.04e-4, rel=1e-3)
    assert schedule_change(saved, longer, 60) == (
        "learning rate: step 61 runs at 9.750e-04 on this config's schedule, 3.000e-04 on the checkpoint's "
        "(train.steps 60 -> 80); the schedule is recomputed from the config's train keys"
    )
    assert schedule_change(saved, TrainConfig(**saved), 60) is None
    assert schedule_change({**saved, "log_interval": 1}, TrainConfig(**saved), 30) is None  # not a schedule key
    constant = {**saved, "lr_schedule": "constant"}
    assert schedule_change(constant, TrainConfig(**{**constant, "steps": 80}), 60) is None  # the same rate
