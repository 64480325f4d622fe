"""Packed SFT examples attend only within themselves (composite attention + segment_ids)."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import models
from mindscale.config import REPO_ROOT, load_config


@pytest.fixture(scope="module")
def network():
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = load_config(
        REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml",
        [
            "parallel.data_parallel=1",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.vocab_size=128",
            "model.seq_length=16",
            "model.ffn_hidden_size=128",
        ],
    )
    ms.set_seed(0)
    return models.build_train_network(cfg)


def loss(network, ids, labels, mask, segments=None):
    args = [Tensor(ids[None], ms.int32), Tensor(labels[None], ms.int32), Tensor(mask[None], ms.float32)]
    if segments is not None:
        args.append(Tensor(segments[None], ms.int32))
    return float(network.loss(*args).asnumpy())  # the model's loss of given inputs and labels


def test_each_packed_example_computes_as_if_alone(network):
    rng = np.random.default_rng(0)
    ids, labels = rng.integers(0, 128, 16), rng.integers(0, 128, 16)
    segments = np.array([1] * 6 + [2] * 10)
    first, second = np.array([1.0] * 6 + [0.0] * 10), np.array([0.0] * 6 + [1.0] * 10)
    # example 1 alone (padding after it cannot influence it: causal)
    assert loss(network, ids, labels, first, segments) == pytest.approx(loss(network, ids, labels, first), abs=1e-5)
    # example 2 alone, shifted to the start (rotary is relative, so only the mask matters)
    alone = loss(network, np.roll(ids, -6), np.roll(labels, -6), np.roll(second, -6))
    packed = loss(network, ids, labels, second, segments)
    assert packed == pytest.approx(alone, abs=1e-5)
    assert loss(network, ids, labels, second) != pytest.approx(alone, abs=1e-3)  # without the mask it leaks
