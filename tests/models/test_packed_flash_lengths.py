"""Packed SFT data under flash attention: segment_ids -> the TND layout's cumulative sequence ends, executed on CPU.

FlashAttentionScore itself runs only on Atlas A2, so what is executed here is the part that decides its mask:
`FlashAttention.sequence_ends`, the very ops the compiled graph holds (tests/dryrun/test_packed_flash.py reads
them there), on packed rows written by the preprocessing code (`sft_samples`). The ends are then read as
MindSpore 2.9 documents the TND layout: one list per data-parallel rank over its rows' tokens laid end to end,
each interval a sequence of its own, causal within it (sparse_mode 3; with equal query and key lengths per
sequence the right-down and the left-up triangle are the same). That mask, and an attention computed under it,
must equal what the composite core computes with the same segment_ids: `CompositeAttention.segment_mask` and
its causal mask, row by row.
"""

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindscale.io import DataError
from mindscale.train.data.dataset import make_batch, step_rows
from mindscale.train.data.preprocess import sft_samples
from models.attention import MASKED, CompositeAttention, FlashAttention
from tests.modes import cpu_mode

pynative_mode = cpu_mode("pynative")

S, HEADS, KV_HEADS, D = 64, 4, 2, 8
MAX_EXAMPLES = 15


def packed_rows(lengths: list[int]) -> np.ndarray:
    """segment_ids [rows, S] as a model step sees them: examples of these lengths packed by the preprocessing
    (next-fit, padded; every token trained), then batched (make_batch drops the stored extra token)."""
    stats = dict.fromkeys(("examples", "truncated_examples", "dropped_examples", "num_tokens", "loss_tokens"), 0)
    examples = [([7] * n, [1] * n) for n in lengths]
    samples = list(sft_samples(examples, S + 1, 0, True, stats))
    return make_batch(samples)["segment_ids"]


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    """Four rows: many short examples (MAX_EXAMPLES in one row), examples with padding, one example filling
    its row (no padding), and a row of one example and much padding."""
    many = [S // MAX_EXAMPLES] * MAX_EXAMPLES
    ids = np.concatenate([packed_rows(many), packed_rows([20, 9, 30]), packed_rows([S + 1]), packed_rows([5])])
    assert ids.shape == (4, S)
    assert [int(r.max()) for r in ids] == [MAX_EXAMPLES, 3, 1, 1] and (ids[2] > 0).all() and (ids[3] == 0).any()
    return ids


def sequence_ends(segment_ids: np.ndarray, row_blocks: int) -> np.ndarray:
    core = FlashAttention(HEADS, KV_HEADS, D, packed_slots=MAX_EXAMPLES + 1, row_blocks=row_blocks)
    return core.sequence_ends(Tensor(segment_ids)).asnumpy()


def tnd_allowed(ends: np.ndarray) -> np.ndarray:
    """[T, T] keys each query sees under FlashAttentionScore's TND layout, sparse_mode 3: the cumulative ends
    bound sequences [previous end, end) of the T = ends[-1] tokens (empty ones allowed), each causal."""
    starts = np.concatenate([[0], ends[:-1]])
    sequence = np.repeat(np.arange(len(ends)), ends - starts)  # the sequence of every token
    position = np.arange(ends[-1])
    return (sequence[:, None] == sequence[None, :]) & (position[None, :] <= position[:, None])


def composite_allowed(segment_ids: np.ndarray) -> np.ndarray:
    """[B, S, S] keys each query sees in the composite core: its causal mask and its packed-segment mask."""
    b, s = segment_ids.shape
    other = CompositeAttention(HEADS, KV_HEADS, D, s, ms.float32).segment_mask(Tensor(segment_ids)).asnumpy()
    causal = np.tril(np.ones((s, s), bool))
    return (other.reshape(b, s, s) == 0) & causal


def block_diagonal(blocks: np.ndarray) -> np.ndarray:
    """[n, s, s] -> [n*s, n*s]: one row's mask after the other, nothing across rows."""
    n, s, _ = blocks.shape
    whole = np.zeros((n * s, n * s), bool)
    for i in range(n):
        whole[i * s : (i + 1) * s, i * s : (i + 1) * s] = blocks[i]
    return whole


@pytest.mark.parametrize("row_blocks", [1, 2, 4])
def test_each_ranks_ends_mask_what_the_composite_segment_mask_masks(rows, row_blocks):
    """row_blocks: the data-parallel ranks a sharded graph's batch is split over (Layout.row_blocks); each
    rank's block of the ends must describe its own rows' tokens, as the kernel on that rank reads them."""
    ends = sequence_ends(rows, row_blocks)
    per_rank = len(rows) // row_blocks
    slots = MAX_EXAMPLES + 1
    assert ends.dtype == np.int32 and ends.shape == (len(rows) * slots,)
    for rank, block in enumerate(np.split(ends, row_blocks)):
        assert (np.diff(block) >= 0).all() and block[-1] == per_rank * S  # non-decreasing, ending at T
        assert (block.reshape(per_rank, slots)[:, -1] == S * np.arange(1, per_rank + 1)).all()  # row j ends at (j+1)S
        own = rows[rank * per_rank : (rank + 1) * per_rank]
        np.testing.assert_array_equal(tnd_allowed(block), block_diagonal(composite_allowed(own)))


def test_the_ends_are_each_examples_end_then_the_padding(rows):
    ends = sequence_ends(rows, 1).reshape(len(rows), MAX_EXAMPLES + 1)
    np.testing.assert_array_equal(ends[0], [4 * (k + 1) for k in range(MAX_EXAMPLES)] + [S])  # 15 x 4 tokens, 4 pad
    np.testing.assert_array_equal(ends[1], S + np.array([20, 29, 59] + [59] * (MAX_EXAMPLES - 3) + [S]))
    np.testing.assert_array_equal(ends[2], 2 * S + np.full(MAX_EXAMPLES + 1, S))  # one example, its last token cut
    np.testing.assert_array_equal(ends[3], 3 * S + np.array([5] * MAX_EXAMPLES + [S]))


def test_attention_under_the_ends_equals_the_composite_core_with_segment_ids(rows):
    """Attention of one rank's tokens laid end to end ([1, T]) under the ends' mask, against the composite
    core on the rows with their segment_ids: the same numbers for every token, padding included."""
    rng = np.random.default_rng(0)
    b = len(rows)
    q, k, v = (rng.standard_normal((b, S, n, D)).astype(np.float32) for n in (HEADS, KV_HEADS, KV_HEADS))
    composite = CompositeAttention(HEADS, KV_HEADS, D, S, ms.float32)
    expected = composite(Tensor(q), Tensor(k), Tensor(v), Tensor(rows)).asnumpy().reshape(b * S, HEADS * D)
    t = b * S
    mask = np.where(tnd_allowed(sequence_ends(rows, 1)), 0.0, MASKED).astype(np.float32)
    core = CompositeAttention(HEADS, KV_HEADS, D, t, ms.float32)
    grouped = (q.reshape(1, t, HEADS, D) / math.sqrt(D)).transpose(0, 2, 1, 3).reshape(1, KV_HEADS, -1, t, D)
    out = core.attend(
        Tensor(grouped),
        Tensor(k.reshape(1, t, KV_HEADS, D).transpose(0, 2, 1, 3)),
        Tensor(v.reshape(1, t, KV_HEADS, D).transpose(0, 2, 1, 3)),
        Tensor(mask),
    ).asnumpy()
    np.testing.assert_allclose(
        out.reshape(HEADS, t, D).transpose(1, 0, 2).reshape(t, HEADS * D), expected, rtol=1e-5, atol=1e-6
    )


def test_a_row_with_more_examples_than_the_kernel_takes_is_refused(rows):
    micro = [{"tokens": rows, "loss_mask": np.ones(rows.shape, np.float32), "segment_ids": rows}]
    assert len(step_rows(micro, MAX_EXAMPLES)) == 3
    assert len(step_rows(micro, None)) == 3  # composite attention: any number
    with pytest.raises(DataError, match=f"holds {MAX_EXAMPLES} examples, more than data.max_packed_examples=14"):
        step_rows(micro, MAX_EXAMPLES - 1)
