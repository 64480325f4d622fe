"""CPU-only fast paths, built where Layout.cpu_kernels is set: stand-alone and data-parallel CPU runs,
in which no op carries a sharding strategy. SplitCausalAttention replaces the attention core, and
expand_broadcasts gives every Add/Sub/Mul equal-shape inputs (EqualShapes). Ascend, GPU and every sharded layout use the plain ops
(under semi-auto parallel these would need strategies of their own); the numbers are the same
(tests/models/test_models.py compares both).
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from models.attention import CompositeAttention

SPLIT_CAUSAL_MIN = 128  # shorter sequences: the extra slices cost more than the skipped quarter saves


class RowSumSoftmax(nn.Cell):
    """Softmax over the last axis whose backward sums rows with a MatMul against a ones column.

    MindSpore's CPU backend expands SoftmaxGrad into ReduceSum/Sub/Mul passes and its ReduceSum
    over the last axis is slow; this bprop, dx = y*(dy - rowsum(y*dy)), measured about 2x faster
    fwd+bwd at [4, 8, 512, 512]. CPU only: Ascend/GPU have a fused SoftmaxGrad, and the sharded
    (semi-auto) path keeps the plain primitive so it can carry a strategy.
    """

    def __init__(self, length: int):
        super().__init__()
        self.softmax = ops.Softmax(axis=-1)
        self.ones = Tensor(np.ones((length, 1), np.float32))
        self.row_sum = ops.MatMul()
        self.length = length

    @property
    def attrs(self) -> dict:
        """The softmax primitive's attributes, so this cell inspects like the primitive it replaces."""
        return self.softmax.attrs

    def recompute(self, **kwargs):
        """Selective recompute of this op is recompute of its primitive (Cell.recompute would exclude
        a one-primitive cell's output, i.e. everything)."""
        self.softmax.recompute()

    def construct(self, x):
        return self.softmax(x)

    def bprop(self, x, out, dout):
        n = x.shape[-1]
        ones = self.ones if n == self.length else self.ones[:n]
        row_sums = self.row_sum((dout * out).reshape(-1, n), ones).reshape(x.shape[:-1] + (1,))
        row_sums = ops.broadcast_to(row_sums, dout.shape)  # so the Sub takes the fp32 equal-shape path
        return (out * (dout - row_sums),)  # y*(dy - r): one pass over the [.., S, S] tensor fewer than y*dy - y*r


class SplitCausalAttention(CompositeAttention):
    """The composite core with the RowSumSoftmax backward, whose queries, from SPLIT_CAUSAL_MIN tokens on,
    are split in two halves: the first half's scores against the second half's keys, a quarter of the
    S x S scores and all masked, are never computed (-25% attention work; the slices and the concat
    are O(S d))."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, seq_length: int, compute_dtype):
        super().__init__(num_heads, num_kv_heads, head_dim, seq_length, compute_dtype)
        self.softmax = RowSumSoftmax(seq_length)
        self.split_causal = True
        self.concat_halves = ops.Concat(axis=3)

    def attend_causal(self, q, k, v, mask, segments):
        s = q.shape[3]
        if not self.split_causal or s < SPLIT_CAUSAL_MIN:
            return self.attend(q, k, v, mask, segments)
        h = s // 2
        low = None if segments is None else segments[..., :h, :h]
        high = None if segments is None else segments[..., h:, :]
        return self.concat_halves(
            (
                self.attend(q[:, :, :, :h], k[:, :, :h], v[:, :, :h], mask[..., :h, :h], low),
                self.attend(q[:, :, :, h:], k, v, mask[..., h:, :], high),
            )
        )


def broadcast_shape(x: tuple, y: tuple) -> tuple:
    """numpy's broadcast of two shapes (compile-time: graph mode evaluates it on the static shapes)."""
    n = max(len(x), len(y))
    x = (1,) * (n - len(x)) + x
    y = (1,) * (n - len(y)) + y
    return tuple([a if b == 1 else b for a, b in zip(x, y)])


class EqualShapes(nn.Cell):
    """A binary elementwise primitive whose fp32 tensor inputs are broadcast to the output's shape first.

    MindSpore's CPU Add/Sub/Mul kernels are vectorised only for fp32 inputs of equal shape or of one
    element. Any other broadcast builds two index vectors of 8 bytes per output element on its first
    launch, keeps them as long as the graph lives and gathers through them: 86 such kernels held 1.84
    GiB of the peer config's 3.63 GiB peak (bench/changes.md). BroadcastTo writes the smaller operand
    out once (4 bytes per element, freed after the op) and the op takes the vectorised path; in the
    backward pass the op's gradients are equal-shape too, and BroadcastTo's is the ReduceSum the
    broadcasting op's own gradient did anyway.
    """

    def __init__(self, op):
        super().__init__()
        self.op = op

    @property
    def attrs(self) -> dict:
        return self.op.attrs

    def recompute(self, **kwargs):
        """Recompute the broadcast with the op, so neither keeps a full-size input for the backward."""
        super().recompute(**kwargs)
        self.op.recompute()

    def construct(self, x, y):
        if isinstance(x, Tensor) and isinstance(y, Tensor) and x.dtype == ms.float32 and y.dtype == ms.float32:
            if x.shape != y.shape and x.size > 1 and y.size > 1:
                shape = broadcast_shape(x.shape, y.shape)
                if x.shape != shape:
                    x = ops.broadcast_to(x, shape)
                if y.shape != shape:
                    y = ops.broadcast_to(y, shape)
        return self.op(x, y)


BROADCASTING = (ops.Add, ops.Sub, ops.Mul)


def expand_broadcasts(network: nn.Cell) -> None:
    """Wrap every Add, Sub and Mul primitive held by a cell of `network` in EqualShapes."""
    found = [
        (cell, name, prim)
        for _, cell in network.cells_and_names()
        for name, prim in cell._primitives.items()
        if type(prim) in BROADCASTING
    ]
    for cell, name, prim in found:
        del cell._primitives[name]  # Cell.__setattr__ refuses a cell under a name that holds a primitive
        setattr(cell, name, EqualShapes(prim))
