"""The train step's numerics on CPU in graph mode: fp16 gradient norms, fp16 parameters, what decides overflow."""

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from mindscale.config import Layout, load_config
from mindscale.train.loop.step import (
    SATURATION_MODE,
    _dot_squared_norm,
    _grad_scale_squared_norm,
    build_train_graph,
    saturates_fp16,
)
from tests.modes import cpu_mode

TINY = "configs/tiny/llama_tiny.yaml"
SMALL = [
    "model.hidden_size=64",
    "model.ffn_hidden_size=96",
    "model.vocab_size=128",
    "model.seq_length=16",
    "parallel.data_parallel=1",
    "train.micro_batch_size=2",
]


graph_mode = cpu_mode("graph")


class SquaredNorms(nn.Cell):
    """The step's two forms of sum(g²) per gradient: the sharded one and the CPU MatMul one."""

    def __init__(self):
        super().__init__()
        self.hyper_map = ops.HyperMap()
        self.dot = ops.MatMul(transpose_b=True)

    def construct(self, grads):
        return (
            self.hyper_map(_grad_scale_squared_norm, grads),
            self.hyper_map(ops.partial(_dot_squared_norm, self.dot), grads),
        )


def test_fp16_gradients_are_squared_in_fp32():
    """Gradients of 300 in fp16: each square (90000) and their sum exceed fp16's 65504, so a norm squared
    in fp16 is inf and every step would be skipped as an overflow. Both norm forms square in fp32."""
    grads = (np.full((64, 64), 300, np.float16), np.linspace(-300, 300, 1000).astype(np.float16))
    sharded, cpu = SquaredNorms()(tuple(Tensor(g) for g in grads))
    for g, a, b in zip(grads, sharded, cpu):
        expected = float(np.sum(g.astype(np.float64) ** 2))
        assert a.dtype == b.dtype == ms.float32 and a.shape == b.shape == (1,)
        assert float(a.asnumpy()[0]) == pytest.approx(expected, rel=1e-6)
        assert float(b.asnumpy()[0]) == pytest.approx(expected, rel=1e-6)


def test_fp16_parameters_train_with_fp32_moments():
    """param_dtype float16: AdamW's moments stay fp32. In the parameter dtype, as MindSpore's AdamWeightDecay
    keeps them, 72% of the second moments flushed to zero in the first update (8% in fp32: rows no token
    used), which left NaN weights: the second step's loss was NaN."""
    ms.set_seed(0)
    cfg = load_config(TINY, [*SMALL, "model.param_dtype=float16", "model.compute_dtype=float16"])
    graph = build_train_graph(cfg, Layout.of(cfg, "CPU", 1))
    assert {p.dtype for p in graph.model.get_parameters()} == {ms.float16}
    moments = graph.optimizer.moments1 + graph.optimizer.moments2
    assert {m.dtype for m in moments} == {ms.float32}
    assert [m.name for m in moments] == [
        f"{prefix}.{p.name}" for prefix in ("adam_m", "adam_v") for p in graph.optimizer.parameters
    ]
    ids = np.random.default_rng(0).integers(0, 128, (2, 17)).astype(np.int32)
    losses = []
    for _ in range(3):
        loss, grad_norm, overflow, _ = graph.step(Tensor(ids))
        assert not overflow.asnumpy() and math.isfinite(float(grad_norm.asnumpy()))
        losses.append(float(loss.asnumpy()))
    assert all(map(math.isfinite, losses)) and losses[2] < losses[0], losses
    assert all(np.isfinite(p.asnumpy()).all() for p in graph.model.get_parameters())
    assert graph.step.float_status is None  # on CPU the norm test alone decides overflow


@pytest.mark.parametrize(
    "hardware, device, mode, reads",
    [
        ("ascend910a", "Ascend", None, True),  # the 910A saturates fp16: always
        ("ascend910b", "Ascend", None, False),  # inf/nan mode: the norm test sees overflow
        ("ascend910b", "Ascend", SATURATION_MODE, True),  # a 910B told to saturate
        ("ascend910b", "Ascend", "INFNAN_MODE", False),
        ("ascend910a", "CPU", SATURATION_MODE, False),  # no float status off Ascend
    ],
)
def test_the_float_status_is_read_where_fp16_saturates(hardware, device, mode, reads):
    cfg = load_config(TINY, [f"hardware={hardware}", "model.compute_dtype=float16"])
    environ = {} if mode is None else {"MS_ASCEND_CHECK_OVERFLOW_MODE": mode}
    assert saturates_fp16(cfg, Layout.of(cfg, device), environ) is reads
