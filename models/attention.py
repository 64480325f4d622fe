"""Causal self-attention with grouped-query heads, and its two interchangeable cores.

`Attention` projects x [tokens, hidden] to q [B, S, heads, d] and k, v [B, S, kv_heads, d] with
separate wq/wk/wv matmuls (no slicing of a fused output), applies rotary embeddings when the model
uses them, and hands q, k, v to a core that returns [tokens, heads * d]:

* `CompositeAttention`: BatchMatMul + fp32 softmax + additive causal mask. Runs everywhere.
* `FlashAttention`: the FlashAttentionScore kernel (Atlas A2 only, never executed on CPU here); on packed
  data its TND layout, each packed example a causal sequence of its own.
* models/cpu_kernels.py: the composite core with CPU-only fast paths (Layout.cpu_kernels).

GQA without copying k/v: the heads that share a kv head are laid side by side along the query
axis ([B, kv_heads, group * S, d]), so one BatchMatMul per kv head serves the whole group.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from models.layers import HeadRMSNorm, Linear, RotaryEmbedding

MASKED = -1.0e9  # additive mask value; finite so an fp32 softmax row never computes inf - inf
FLASH_MASK_SIZE = 2048  # sparse_mode 2 takes a compressed 2048 x 2048 causal mask


@lru_cache(maxsize=4)
def flash_causal_mask() -> Tensor:
    """The compressed uint8 mask of sparse_mode 2 (1 = masked out)."""
    return Tensor(np.triu(np.ones((FLASH_MASK_SIZE, FLASH_MASK_SIZE), np.uint8), 1))


class CompositeAttention(nn.Cell):
    """softmax(q k^T / sqrt(d) + causal) v with the scores and softmax in fp32."""

    # the S x S tensors: scores, their fp32 copy, the masked scores, the probabilities
    SELECTIVE_RECOMPUTE = ("bmm_qk", "scores_fp32", "mask_add", "softmax", "probs_cast", "bmm_pv")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, seq_length: int, compute_dtype):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.seq_length = seq_length
        self.compute_dtype = compute_dtype
        self.cast_scores = compute_dtype != ms.float32
        self.scale = Tensor(1.0 / math.sqrt(head_dim), compute_dtype)
        # The [S, S] mask is built in the graph from two index vectors (as fast as a constant, and a
        # model configured for a long context does not hold an S x S table per construction).
        self.rows = Tensor(np.arange(seq_length, dtype=np.int32).reshape(seq_length, 1))
        self.cols = Tensor(np.arange(seq_length, dtype=np.int32).reshape(1, seq_length))
        self.future = ops.Greater()
        self.mask_cast = ops.Cast()
        self.mask_scale = ops.Mul()
        self.scale_q = ops.Mul()
        self.transpose_q = ops.Transpose()
        self.transpose_k = ops.Transpose()
        self.transpose_v = ops.Transpose()
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.scores_fp32 = ops.Cast()
        self.mask_add = ops.Add()
        self.softmax = ops.Softmax(axis=-1)
        self.probs_cast = ops.Cast()
        self.bmm_pv = ops.BatchMatMul()
        self.transpose_out = ops.Transpose()
        # packed examples: an additive [B, 1, 1, S, S] mask of their own, added to the scores after the
        # causal one (its ops carry strategies with a batch dimension, the causal mask's have none)
        self.other_segment = ops.NotEqual()
        self.segment_cast = ops.Cast()
        self.segment_scale = ops.Mul()
        self.segment_add = ops.Add()

    def segment_mask(self, segment_ids):
        """[B, 1, 1, S, S] additive mask keeping attention within each packed example."""
        b, s = segment_ids.shape
        other = self.other_segment(segment_ids.reshape(b, 1, 1, s, 1), segment_ids.reshape(b, 1, 1, 1, s))
        return self.segment_scale(self.segment_cast(other, ms.float32), MASKED)

    def construct(self, q, k, v, segment_ids=None):
        b, s, n, d = q.shape
        q = self.transpose_q(self.scale_q(q, self.scale), (0, 2, 1, 3)).reshape(b, self.num_kv_heads, self.group, s, d)
        k = self.transpose_k(k, (0, 2, 1, 3))
        v = self.transpose_v(v, (0, 2, 1, 3))
        rows, cols = (self.rows, self.cols) if s == self.seq_length else (self.rows[:s], self.cols[:, :s])
        mask = self.mask_scale(self.mask_cast(self.future(cols, rows), ms.float32), MASKED)
        segments = None if segment_ids is None else self.segment_mask(segment_ids)  # causal AND within the example
        out = self.attend_causal(q, k, v, mask, segments)
        return self.transpose_out(out.reshape(b, n, s, d), (0, 2, 1, 3)).reshape(b * s, n * d)

    def attend_causal(self, q, k, v, mask, segments):
        """All queries [B, kv, group, S, d] against all keys: what models/cpu_kernels.py splits."""
        return self.attend(q, k, v, mask, segments)

    def attend(self, q, k, v, mask, segments=None):
        """q [B, kv, group, s, d] against k, v [B, kv, t, d] with the additive masks [s, t] and
        (packed data) [B, 1, 1, s, t]."""
        b, kv, g, s, d = q.shape
        t = k.shape[2]
        scores = self.bmm_qk(q.reshape(b, kv, g * s, d), k)
        if self.cast_scores:
            scores = self.scores_fp32(scores, ms.float32)
        scores = self.mask_add(scores.reshape(b, kv, g, s, t), mask)
        if segments is not None:
            scores = self.segment_add(scores, segments)
        probs = self.softmax(scores)
        if self.cast_scores:
            probs = self.probs_cast(probs, self.compute_dtype)
        return self.bmm_pv(probs.reshape(b, kv, g * s, t), v).reshape(b, kv, g, s, d)

    def shard_strategies(self, style: str, layout) -> dict:
        dp, tp = layout.dp, layout.tp
        bsnd = (dp, 1, tp, 1)  # [B, S, heads, d]
        heads = (dp, tp, 1, 1)  # [B, kv_heads, group * S, d] and [B, heads, S, d]
        grouped = (dp, tp, 1, 1, 1)  # [B, kv_heads, group, S, S]
        per_row = (dp, 1, 1, 1, 1)  # the packed-segment mask [B, 1, 1, S, S]
        return {
            "future": (((1, 1), (1, 1)), None),
            "mask_scale": (((1, 1), ()), None),
            "scale_q": ((bsnd, ()), None),
            "transpose_q": ((bsnd,), None),
            "transpose_k": ((bsnd,), None),
            "transpose_v": ((bsnd,), None),
            "bmm_qk": ((heads, heads), None),
            "mask_add": ((grouped, (1, 1)), None),
            "softmax": ((grouped,), None),
            "other_segment": ((per_row, per_row), None),
            "segment_cast": (((per_row,)), None),
            "segment_scale": ((per_row, ()), None),
            "segment_add": ((grouped, per_row), None),
            "bmm_pv": ((heads, heads), None),
            "transpose_out": ((heads,), None),
        }


class FlashAttention(nn.Cell):
    """FlashAttentionScore in the BSH layout with the compressed causal mask (sparse_mode 2).

    Kept as the primitive (not ops.flash_attention_score) so the sharding plan can `.shard()` it.
    Atlas A2 only: built and inspected by the CPU tests, executed only on Ascend 910B.

    Under context parallel (Layout.cp > 1) q, k and v arrive split along the sequence. colossalai_cp
    keeps the queries split and asks for whole K and V, which the compiler all-gathers over the cp ranks;
    MindSpore's parallel pass then turns the causal mask into each rank's band (layout.flash_causal_band).
    ulysses_cp (`ulysses=True`) trades the sequence split for a head split before the kernel and back
    after it: heads viewed as [tp, cp, rest], the cp factor moved in front of the tp one, and an identity
    Transpose whose strategy moves the cp split from the sequence to that factor, which the compiler
    lowers to an all-to-all (Jacobs et al. 2023, DeepSpeed-Ulysses; MindFormers' ulysses_cp builds it so
    too). Rank (c, t) then holds heads t*N/tp + c*N/(tp*cp) + r, the kv heads of its query heads among
    them, and attends over the whole sequence with the plain causal mask.

    Packed data (segment_ids) takes the TND layout instead (`packed`): each data-parallel rank's rows laid end to
    end as [T, heads, d], every packed example a causal sequence of its own, bounded by the cumulative ends
    `sequence_ends` computes from segment_ids in the graph (docs/models.md, "Packed data under flash attention").
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ulysses: tuple | None = None,
        packed_slots: int = 1,
        row_blocks: int = 1,
        recompute_view: bool = False,
    ):
        """ulysses: (tp, cp) for the all-to-all form of context parallel, else None. For packed data
        (`sequence_ends`): packed_slots, the ends a row gives the kernel (its examples' and its padding's), and
        Layout.row_blocks. recompute_view: Layout.recomputes_attention_view."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal_mask = flash_causal_mask()
        self.flash = FlashAttentionScore(
            head_num=num_heads, scale_value=1.0 / math.sqrt(head_dim), input_layout="BSH", sparse_mode=2
        )
        # Packed data: every row's tokens one after another ([T, heads, d]), each example a causal sequence of
        # its own, bounded by the cumulative ends actual_seq_qlen = actual_seq_kvlen. sparse_mode 3 (right-down
        # causal per sequence; with equal query and key lengths the same mask as 2) with next_tokens 0, as
        # MindSpore 2.9 asks of TND and MindFormers 1.9 builds it.
        self.flash_packed = FlashAttentionScore(
            head_num=num_heads, scale_value=1.0 / math.sqrt(head_dim), next_tokens=0, input_layout="TND", sparse_mode=3
        )
        self.recompute_view = recompute_view
        self.merge_rows = ops.Reshape()  # the kernel's output [B, S, heads * d] (or [T, heads, d]) as wo's [B*S, .]
        self.merge_rows.recompute()
        self.row_blocks = row_blocks
        self.slot_shift = ops.Add()
        self.slot_of = ops.FloorMod()
        self.slot_numbers = Tensor(np.arange(packed_slots, dtype=np.int32).reshape(1, 1, 1, packed_slots))
        self.in_slot = ops.LessEqual()
        self.in_slot_cast = ops.Cast()
        self.count_ends = ops.ReduceSum()
        self.row_length = ops.ReduceMax(keep_dims=True)
        self.row_start = ops.CumSum(exclusive=True)
        self.offset_ends = ops.Add()
        self.ends_cast = ops.Cast()
        self.ulysses = ulysses
        if ulysses is not None:
            self.swap_in = ops.Transpose()  # [B, S, tp, cp, r, d] -> [B, S, cp, tp, r, d]
            self.all_to_all_in = ops.Transpose()  # identity: the sequence split moves to the cp factor
            self.all_to_all_out = ops.Transpose()  # identity: back to the sequence split
            self.swap_out = ops.Transpose()  # [B, S, cp, tp, r, d] -> [B, S, tp, cp, r, d]

    def to_heads(self, x, heads: int):
        """[B, S, heads, d] split (dp, cp, tp, 1) -> [B, S, heads * d] split (dp, 1, cp * tp)."""
        b, s = x.shape[:2]
        tp, cp = self.ulysses
        x = self.swap_in(x.reshape(b, s, tp, cp, heads // (tp * cp), self.head_dim), (0, 1, 3, 2, 4, 5))
        return self.all_to_all_in(x, (0, 1, 2, 3, 4, 5)).reshape(b, s, heads * self.head_dim)

    def from_heads(self, x):
        """to_heads' inverse for the output [B, S, heads * d]: [B*S, heads * d] split (dp*cp, tp)."""
        b, s = x.shape[:2]
        tp, cp = self.ulysses
        x = self.all_to_all_out(x.reshape(b, s, cp, tp, self.num_heads // (tp * cp), self.head_dim), (0, 1, 2, 3, 4, 5))
        return self.swap_out(x, (0, 1, 3, 2, 4, 5)).reshape(b * s, self.num_heads * self.head_dim)

    def rows_of(self, out, shape: tuple):
        """The kernel's output as wo's [B*S, heads * d]: recomputed in the backward (Layout.recomputes_attention_view),
        else a Tensor-method reshape, which Cell.offload leaves unmarked (a primitive's output would move to host
        beside the output itself: 4,096 bytes more a layer in tests/dryrun/test_offload.py's twin)."""
        return self.merge_rows(out, shape) if self.recompute_view else out.reshape(shape)

    def sequence_ends(self, segment_ids):
        """segment_ids [B, S] (the packed examples 1, 2, ... in order, then padding 0) -> actual_seq_qlen [B * slots]
        int32: the cumulative end of every example as FlashAttentionScore's TND layout reads them, one list per
        data-parallel rank over its rows (row j of a rank's block offset by j * S, MindFormers' per-row offset).

        Per row, example j takes slot j - 1 and the padding the last slot; slot k ends where the tokens of slots
        <= k end. A row's slots past its examples end where its last example does (empty sequences), its last
        slot at S. Counted in float32 (exact to 2^24), cast to int32 once."""
        b, s = segment_ids.shape
        slots = self.slot_numbers.shape[-1]
        rows = segment_ids.reshape(self.row_blocks, b // self.row_blocks, s, 1)
        slot = self.slot_of(self.slot_shift(rows, slots - 1), slots)
        ends = self.count_ends(self.in_slot_cast(self.in_slot(slot, self.slot_numbers), ms.float32), 2)
        starts = self.row_start(self.row_length(ends, -1), 1)  # a row's last end is S: row j starts at j * S
        return self.ends_cast(self.offset_ends(ends, starts), ms.int32).reshape(-1)

    def packed(self, q, k, v, segment_ids):
        """q [B, S, heads, d], k, v [B, S, kv_heads, d] of packed rows -> [B*S, heads * d]: the TND kernel."""
        b, s, n, d = q.shape
        ends = self.sequence_ends(segment_ids)
        q = q.reshape(b * s, n, d)
        k = k.reshape(b * s, self.num_kv_heads, d)
        v = v.reshape(b * s, self.num_kv_heads, d)
        _, _, _, out = self.flash_packed(q, k, v, None, None, None, self.causal_mask, None, ends, ends)
        return self.rows_of(out, (b * s, n * d))

    def construct(self, q, k, v, segment_ids=None):
        """segment_ids [B, S] of packed data: each example attends within itself (`packed`)."""
        b, s, n, d = q.shape
        if segment_ids is not None:
            return self.packed(q, k, v, segment_ids)
        if self.ulysses is not None:
            q, k, v = self.to_heads(q, n), self.to_heads(k, self.num_kv_heads), self.to_heads(v, self.num_kv_heads)
            _, _, _, out = self.flash(q, k, v, None, None, None, self.causal_mask, None)
            return self.from_heads(out)
        q = q.reshape(b, s, n * d)
        k = k.reshape(b, s, self.num_kv_heads * d)
        v = v.reshape(b, s, self.num_kv_heads * d)
        _, _, _, out = self.flash(q, k, v, None, None, None, self.causal_mask, None)
        return self.rows_of(out, (b * s, n * d))

    def shard_strategies(self, style: str, layout) -> dict:
        dp, cp, tp = layout.dp, layout.cp, layout.tp
        if layout.ulysses:
            heads = (dp, 1, cp * tp)  # BSH, heads inside H split over cp x tp, the whole sequence
            by_sequence, by_heads = (dp, cp, 1, tp, 1, 1), (dp, 1, cp, tp, 1, 1)
            return {
                "flash": ((heads, heads, heads, (1, 1)), None),
                "swap_in": (((dp, cp, tp, 1, 1, 1),), None),
                "all_to_all_in": ((by_heads,), None),
                "all_to_all_out": ((by_sequence,), None),
                "swap_out": ((by_sequence,), None),
            }
        # queries split along the sequence over cp, K and V whole (all-gathered over cp when cp > 1)
        return {"flash": (((dp, cp, tp), (dp, 1, tp), (dp, 1, tp), (1, 1)), None), **self.packed_strategies(dp, tp)}

    @staticmethod
    def packed_strategies(dp: int, tp: int) -> dict:
        """Packed data (not under context parallel: validate.py): TND tokens [T, heads, d] split over dp (each
        rank its own rows' tokens), heads over tp; actual_seq_qlen/kvlen over dp, each rank its block of ends
        (MindSpore 2.9's flash_attention_score_info.cc splits them so, and rewrites their values only when
        the tokens are split along a sequence)."""
        tnd, rows = (dp, tp, 1), (dp, 1, 1, 1)  # rows: [blocks, rows, S, slots], one block per dp rank
        return {
            "flash_packed": ((tnd, tnd, tnd, (1, 1), (dp,), (dp,)), None),
            "slot_shift": ((rows, ()), None),
            "slot_of": ((rows, ()), None),
            "in_slot": ((rows, (1, 1, 1, 1)), None),
            "in_slot_cast": ((rows,), None),
            "count_ends": ((rows,), None),
            "row_length": (((dp, 1, 1),), None),
            "row_start": (((dp, 1, 1),), None),
            "offset_ends": (((dp, 1, 1), (dp, 1, 1)), None),
            "ends_cast": (((dp, 1, 1),), None),
        }


class Attention(nn.Cell):
    """Multi-head (GQA when kv_heads < heads) causal self-attention on [tokens, hidden]."""

    REGATHERED_INPUT = ("wq", "wk", "wv")  # the Linears reading the input, which sequence parallel all-gathers

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        seq_length: int,
        *,
        bias: bool,
        qkv_bias: bool,
        qk_norm_eps: float | None,
        rope: tuple | None,
        core: nn.Cell,
        std: float,
        out_std: float,
        param_dtype,
        compute_dtype,
    ):
        """bias: on wo too (GPT); qkv_bias: on wq/wk/wv; qk_norm_eps: RMSNorm of each q and k head (Qwen3)
        with that epsilon, or None; rope: (theta, scaling params) or None."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.wq = Linear(hidden, num_heads * head_dim, qkv_bias, std, param_dtype, compute_dtype)
        self.wk = Linear(hidden, num_kv_heads * head_dim, qkv_bias, std, param_dtype, compute_dtype)
        self.wv = Linear(hidden, num_kv_heads * head_dim, qkv_bias, std, param_dtype, compute_dtype)
        self.wo = Linear(num_heads * head_dim, hidden, bias, out_std, param_dtype, compute_dtype)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = HeadRMSNorm(head_dim, qk_norm_eps, param_dtype, compute_dtype)
            self.k_norm = HeadRMSNorm(head_dim, qk_norm_eps, param_dtype, compute_dtype)
        self.rotary = None if rope is None else RotaryEmbedding(seq_length, head_dim, *rope, compute_dtype)
        self.core = core

    def qkv(self, x, batch: int, seq: int):
        """q [B, S, heads, d] and k, v [B, S, kv_heads, d] before the rotary embedding (the KV-cache
        decoder of models/generation.py rotates them at its own positions)."""
        q = self.wq(x).reshape(batch, seq, self.num_heads, self.head_dim)
        k = self.wk(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.wv(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def construct(self, x, batch: int, seq: int, segment_ids=None):
        q, k, v = self.qkv(x, batch, seq)
        if self.rotary is not None:
            q = self.rotary(q)
            k = self.rotary(k)
        return self.output(self.core(q, k, v, segment_ids))

    def output(self, out):
        """The core's [tokens, heads x d] -> [tokens, hidden]."""
        return self.wo(out)
