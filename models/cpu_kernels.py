"""CPU-only fast paths, built where Layout.cpu_kernels is set: stand-alone and data-parallel CPU runs,
in which no op carries a sharding strategy. Ascend, GPU and every sharded layout use the plain ops
(under semi-auto parallel these would need strategies of their own); the numbers are the same
(tests/models/test_models.py compares both).
"""
from __future__ import annotations

import numpy as np
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
        return self.concat_halves((self.attend(q[:, :, :, :h], k[:, :, :h], v[:, :, :h], mask[..., :h, :h], low),
                                   self.attend(q[:, :, :, h:], k, v, mask[..., h:, :], high)))
