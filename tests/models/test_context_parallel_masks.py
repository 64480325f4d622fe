"""Context parallel's per-rank arithmetic, executed on CPU against full attention on the same tokens.

A sharded graph cannot run here (semi-auto parallel is refused on CPU), so what each context-parallel rank
computes is rebuilt from the pieces it is made of, with MindScale's own attention core and rotary cell:

* colossalai_cp: rank c holds the queries at `context_positions(S, cp, c)`, rotated by those positions
  (the compiler slices the RoPE tables so), and attends to all keys, gathered from every rank, under the band
  `flash_causal_band(S, cp, c)` that MindSpore's parallel pass writes into FlashAttentionScore
  (tests/dryrun/test_context_parallel.py checks the compiled op carries it).
* colossalai_cp with parallel.context_parallel_load_balance: MindSpore's flash attention load balance has rank c
  attend query chunks `load_balanced_chunks(cp, c)` of 2·cp (its own first half, its partner's second half), each
  under `flash_causal_band(S, 2·cp, chunk)` (tests/dryrun/test_context_parallel.py checks the compiled pair);
  every rank then attends the same number of (query, key) pairs, where contiguous chunks leave the last rank
  Layout.attention_imbalance of the mean.
* ulysses_cp: FlashAttention.to_heads / from_heads, the same reshapes and transposes the compiled graph
  holds, with the cp x tp head chunks the all-to-all leaves each rank attended separately.

Either way the outputs, put back together, must equal full causal attention of the whole sequence.
"""

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.config.layout import context_positions, flash_causal_band, load_balanced_chunks
from models.attention import MASKED, CompositeAttention, FlashAttention
from models.layers import RotaryEmbedding
from tests.modes import cpu_mode

pynative_mode = cpu_mode("pynative")

B, S, HEADS, KV_HEADS, D = 2, 32, 8, 4, 16
TINY = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"
THETA = 10000.0


@pytest.fixture(scope="module")
def tokens():
    """q [B, S, heads, d], k and v [B, S, kv_heads, d] before the rotary embedding, and full causal attention
    of them (the composite core of a model that is not sharded, its own causal mask) as [B, S, heads * d]."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, n, D)).astype(np.float32) for n in (HEADS, KV_HEADS, KV_HEADS))
    rotary = RotaryEmbedding(S, D, THETA)
    core = CompositeAttention(HEADS, KV_HEADS, D, S, ms.float32)
    full = core(rotary(Tensor(q)), rotary(Tensor(k)), Tensor(v)).asnumpy().reshape(B, S, HEADS * D)
    return q, k, v, full


def band_allowed(s1: int, s2: int, pre_tokens: int, next_tokens: int) -> np.ndarray:
    """[s1, s2] keys a query may see under FlashAttentionScore's band (sparse_mode 4), aligned at the right-down
    corner as MindSpore's parallel pass treats it (flash_attention_score_info.cc maps the band to
    right-down): query row i stands at key i + s2 - s1 and sees from pre_tokens before it to next_tokens after."""
    at = np.arange(s1)[:, None] + (s2 - s1)
    key = np.arange(s2)[None, :]
    return (key - at <= next_tokens) & (at - key <= pre_tokens)


def attend(q, k, v, allowed):
    """Causal-core attention of q [B, s, n, d] over k, v [B, t, kv, d] with the keys `allowed` [s, t]:
    MindScale's composite core (CompositeAttention.attend) given that mask; returns [B, s, n * d]."""
    b, s, n, d = q.shape
    kv = k.shape[2]
    core = CompositeAttention(n, kv, d, s, ms.float32)
    grouped = (q / math.sqrt(d)).transpose(0, 2, 1, 3).reshape(b, kv, n // kv, s, d)
    mask = np.where(allowed, 0.0, MASKED).astype(np.float32)
    out = core.attend(
        Tensor(grouped), Tensor(k.transpose(0, 2, 1, 3)), Tensor(v.transpose(0, 2, 1, 3)), Tensor(mask)
    ).asnumpy()
    return out.reshape(b, n, s, d).transpose(0, 2, 1, 3).reshape(b, s, n * d)


def rotate_at(x, positions: range):
    """x [B, s, n, d] rotated by the given positions: the rotary cell with its tables cut to those rows, as the
    compiler cuts them for a rank whose sequence chunk they are (strategy (cp, 1, 1) on [S, 1, d])."""
    rotary = RotaryEmbedding(S, D, THETA)
    rows = np.asarray(positions)
    rotary.cos, rotary.sin = Tensor(rotary.cos.asnumpy()[rows]), Tensor(rotary.sin.asnumpy()[rows])
    rotary.seq_length = len(rows)
    return rotary(Tensor(x)).asnumpy()


@pytest.mark.parametrize("cp", [2, 4])
def test_colossalai_ranks_band_and_positions_give_full_causal_attention(tokens, cp):
    q, k, v, full = tokens
    chunks = [context_positions(S, cp, c) for c in range(cp)]
    assert [i for chunk in chunks for i in chunk] == list(range(S))  # every position once, in order
    # each rank rotates its own keys, then they are all-gathered over cp
    keys = np.concatenate([rotate_at(k[:, chunk.start : chunk.stop], chunk) for chunk in chunks], axis=1)
    outs = []
    for c, chunk in enumerate(chunks):
        sparse_mode, pre_tokens, next_tokens = flash_causal_band(S, cp, c)
        allowed = band_allowed(len(chunk), S, pre_tokens, next_tokens)
        assert sparse_mode == 4
        np.testing.assert_array_equal(allowed, np.tril(np.ones((S, S), bool))[chunk.start : chunk.stop])
        outs.append(attend(rotate_at(q[:, chunk.start : chunk.stop], chunk), keys, v, allowed))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)


def banded_pairs(seq: int, parts: int, chunk: int) -> np.ndarray:
    """[seq/parts, seq] keys each query of chunk `chunk` (of `parts`) sees under its flash_causal_band."""
    sparse_mode, pre_tokens, next_tokens = flash_causal_band(seq, parts, chunk)
    assert sparse_mode == 4
    return band_allowed(seq // parts, seq, pre_tokens, next_tokens)


@pytest.mark.parametrize("cp", [2, 4])
def test_load_balanced_halves_give_full_causal_attention_and_equal_work(tokens, cp):
    """Each rank's two half chunks, rotated at their own positions and attending all keys under their own bands,
    put back in sequence order equal full causal attention; every rank attends the same number of pairs."""
    q, k, v, full = tokens
    keys = rotate_at(k, range(S))
    ranks = [load_balanced_chunks(cp, c) for c in range(cp)]
    assert sorted(j for pair in ranks for j in pair) == list(range(2 * cp))  # every half chunk exactly once
    outs, pairs = {}, []
    for pair in ranks:
        pairs.append(0)
        for j in pair:
            chunk = context_positions(S, 2 * cp, j)
            allowed = banded_pairs(S, 2 * cp, j)
            np.testing.assert_array_equal(allowed, np.tril(np.ones((S, S), bool))[chunk.start : chunk.stop])
            outs[j] = attend(rotate_at(q[:, chunk.start : chunk.stop], chunk), keys, v, allowed)
            pairs[-1] += int(allowed.sum())
    np.testing.assert_allclose(np.concatenate([outs[j] for j in range(2 * cp)], axis=1), full, rtol=1e-5, atol=1e-5)
    assert len(set(pairs)) == 1 and sum(pairs) == S * (S + 1) // 2


@pytest.mark.parametrize("cp", [2, 4])
def test_the_planner_times_the_busiest_rank_s_causal_pairs(cp):
    """The attended (query, key) pairs of each rank, counted from the bands at 128K-like proportions (S = 4096):
    contiguous chunks give the last rank Layout.attention_imbalance = (2c-1)/c of the mean (to 1/S), the balanced
    halves give every rank the mean."""
    seq = 4096
    contiguous = [int(banded_pairs(seq, cp, c).sum()) for c in range(cp)]
    balanced = [sum(int(banded_pairs(seq, 2 * cp, j).sum()) for j in load_balanced_chunks(cp, c)) for c in range(cp)]
    mean = seq * (seq + 1) / 2 / cp
    assert sum(contiguous) == sum(balanced) == mean * cp and set(balanced) == {mean}
    sets = ["hardware=ascend910b", "model.compute_dtype=bfloat16", "train.micro_batch_size=1"]
    sets += [f"model.seq_length={seq}", f"parallel.context_parallel={cp}"]
    layouts = [
        Layout.of(load_config(TINY, sets + [f"parallel.context_parallel_load_balance={on}"]))
        for on in ("false", "true")
    ]
    assert max(contiguous) == contiguous[-1]
    assert max(contiguous) / mean == pytest.approx(layouts[0].attention_imbalance, abs=1 / seq)
    assert layouts[1].attention_imbalance == 1.0


def test_a_contiguous_chunk_without_its_band_is_not_causal(tokens):
    """The band is what makes a shard causal: the uncorrected left-up causal mask (sparse_mode 2 applied to the
    chunk as if its first query were position 0) hides keys the last chunk's queries must see."""
    q, k, v, full = tokens
    chunk = context_positions(S, 2, 1)
    left_up = band_allowed(len(chunk), S, S, 0 - (S - len(chunk)))  # diagonal through the top-left corner
    keys = rotate_at(k, range(S))
    wrong = attend(rotate_at(q[:, chunk.start :], chunk), keys, v, left_up)
    assert np.abs(wrong - full[:, chunk.start :]).max() > 1e-2


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2), (1, 4)])
def test_ulysses_head_chunks_give_full_causal_attention(tokens, tp, cp):
    """to_heads lays the heads out [cp, tp, rest] inside H, the compiled all-to-all leaves rank (c, t) chunk
    c * tp + t of it, with the kv heads of its query heads; each attends over the whole sequence with the
    plain causal mask, and from_heads restores the heads' order for wo."""
    q, k, v, full = tokens
    flash = FlashAttention(HEADS, KV_HEADS, D, ulysses=(tp, cp))
    rotated_q, rotated_k = rotate_at(q, range(S)), rotate_at(k, range(S))
    laid_out = [
        flash.to_heads(Tensor(x), n).asnumpy() for x, n in ((rotated_q, HEADS), (rotated_k, KV_HEADS), (v, KV_HEADS))
    ]
    parts = cp * tp
    causal = np.tril(np.ones((S, S), bool))
    outs = []
    for rank_chunk in range(parts):
        local = [np.split(x, parts, axis=-1)[rank_chunk].reshape(B, S, -1, D) for x in laid_out]
        outs.append(attend(*local, causal))
    restored = flash.from_heads(Tensor(np.concatenate(outs, axis=-1))).asnumpy()
    np.testing.assert_allclose(restored.reshape(B, S, HEADS * D), full, rtol=1e-5, atol=1e-5)
