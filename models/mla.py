"""Multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2 §2.1; DeepSeek-V3): the queries and the keys/values
pass through low-rank latents, and each head's query and key are a part without positions and a rotary part,
the rotary key computed once and shared by every head ("decoupled RoPE").

    q       wq (Hugging Face's q_a_proj, h -> q_lora_rank) -> q_a_norm (RMSNorm) -> wq_b (-> heads x (nope + rope));
            with model.mla.q_lora_rank null, wq is the one full projection (q_proj) and the other two are absent
    kv      wkv_a (kv_a_proj_with_mqa, h -> kv_lora_rank + rope) split into the latent and the shared rotary
            key; the latent -> kv_a_norm -> wkv_b (-> heads x (nope + v)) split into k_nope and v
    heads   q = [q_nope, rope(q_rope)], k = [k_nope, rope(k_rope) for every head]; softmax scale
            1/sqrt(nope + rope) (the core's, for its head width); out = wo(heads x v)

The core is the repository's (composite or flash) for heads of nope + rope; the values, narrower (v_head_dim),
are zero-padded to that width before it and the padding sliced off after it (both kernels take one head width
for q, k and v; Hugging Face pads so for FlashAttention-2 too). Computed as written here, training attends in
the full per-head form; the absorbed form that caches only the latent (inference) is not built.

rope_interleave (DeepSeek's checkpoints, Hugging Face's default): the rotary part's weights hold the pairs
interleaved; each rotary part is de-interleaved ([d/2, 2] -> [2, d/2]) before the rotate-half rotation, exactly
as Hugging Face's apply_rotary_pos_emb_interleave does, so the weights load unpermuted.

The latent norms use epsilon 1e-6 whatever model.norm_eps is, as Hugging Face's DeepseekV3RMSNorm(rank) does.
"""

from __future__ import annotations

from mindspore import Tensor, nn, ops
import numpy as np

from models.layers import Linear, RMSNorm, RotaryEmbedding, head_split

LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Cell):
    """construct(x [tokens, hidden], batch, seq, segment_ids) -> [tokens, hidden]: causal multi-head latent
    attention (the module docstring)."""

    REGATHERED_INPUT = ("wq", "wkv_a")  # the Linears reading the input, which sequence parallel all-gathers

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        mla,
        seq_length: int,
        rope_theta: float,
        *,
        core: nn.Cell,
        std: float,
        out_std: float,
        param_dtype,
        compute_dtype,
        sharded: bool = False,
    ):
        """mla: model.mla (mindscale.config.MlaConfig); sharded: the ops carry strategies (Layout.sharded)."""
        super().__init__()
        n, self.nope, self.rope, self.v_dim = num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.num_heads, self.head_dim, self.rank = n, mla.qk_head_dim, mla.kv_lora_rank
        self.interleaved = mla.rope_interleave
        linear = lambda i, o, s=std: Linear(i, o, False, s, param_dtype, compute_dtype)  # noqa: E731
        if mla.q_lora_rank:
            self.wq = linear(hidden, mla.q_lora_rank)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, param_dtype, compute_dtype)
            self.wq_b = linear(mla.q_lora_rank, n * self.head_dim)
        else:
            self.wq = linear(hidden, n * self.head_dim)
            self.q_a_norm = self.wq_b = None
        self.wkv_a = linear(hidden, self.rank + self.rope)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS, param_dtype, compute_dtype)
        self.wkv_b = linear(self.rank, n * (self.nope + self.v_dim))
        self.wo = linear(n * self.v_dim, hidden, out_std)
        self.q_rotary = RotaryEmbedding(seq_length, self.rope, rope_theta, None, compute_dtype)
        self.k_rotary = RotaryEmbedding(seq_length, self.rope, rope_theta, None, compute_dtype)  # the one shared head
        self.core = core
        self.q_nope, self.q_rope = ops.StridedSlice(), ops.StridedSlice()
        self.latent, self.k_rope = ops.StridedSlice(), ops.StridedSlice()
        self.k_nope, self.values = ops.StridedSlice(), ops.StridedSlice()
        self.q_pairs, self.k_pairs = ops.Transpose(), ops.Transpose()
        self.join_q, self.join_k = ops.Concat(-1), ops.Concat(-1)
        self.every_head = ops.Mul()  # the shared rotary key [B, S, 1, r] x ones [1, 1, heads, 1]
        self.head_ones = Tensor(np.ones((1, 1, n, 1), np.float32), compute_dtype)
        # Sharded: PadV3, not Pad: the parallel compiler has a PadV3Info that splits the unpadded dims as asked;
        # ops.Pad it left batch-parallel, and v went through two AlltoAlls a layer (the tp 2 twin's validate IR).
        # Unsharded: Pad, because MindSpore 2.9's CPU PadV3Grad is right on its first launch only (run twice in
        # one process, the same step's gradients differ), which trained every later step's key/value path wrong
        # on CPU and broke resuming (tests/integration/test_moe_training.py).
        padded = self.head_dim > self.v_dim
        pad_width = ((0, 0), (0, 0), (0, 0), (0, self.head_dim - self.v_dim))
        self.pad_v = (ops.PadV3() if sharded else ops.Pad(pad_width)) if padded else None
        self.v_padding, self.pad_value = (0, self.head_dim - self.v_dim), Tensor(0.0, compute_dtype)
        self.sharded = sharded
        self.unpad = ops.StridedSlice()

    def deinterleave(self, x, transpose):
        """[B, S, heads, r] with pairs interleaved -> the rotate-half layout (Hugging Face's view(d/2, 2).transpose)."""
        if not self.interleaved:
            return x
        b, s, n, r = x.shape
        return transpose(x.reshape(b, s, n, r // 2, 2), (0, 1, 2, 4, 3)).reshape(b, s, n, r)

    def parts(self, x, batch: int, seq: int):
        """(q_nope, q_rope [B, S, heads, .], k_nope [B, S, heads, nope], k_rope [B, S, 1, rope], v [B, S, heads, v])
        before the rotation, the rotary parts in the rotate-half layout."""
        b, s, n, d = batch, seq, self.num_heads, self.head_dim
        q = self.wq(x) if self.wq_b is None else self.wq_b(self.q_a_norm(self.wq(x)))
        q = q.reshape(b, s, n, d)
        q_nope = self.q_nope(q, (0, 0, 0, 0), (b, s, n, self.nope), (1, 1, 1, 1))
        q_rope = self.deinterleave(self.q_rope(q, (0, 0, 0, self.nope), (b, s, n, d), (1, 1, 1, 1)), self.q_pairs)
        compressed = self.wkv_a(x)  # [B*S, rank + rope]
        latent = self.latent(compressed, (0, 0), (b * s, self.rank), (1, 1))
        k_rope = self.k_rope(compressed, (0, self.rank), (b * s, self.rank + self.rope), (1, 1))
        k_rope = self.deinterleave(k_rope.reshape(b, s, 1, self.rope), self.k_pairs)
        kv = self.wkv_b(self.kv_a_norm(latent)).reshape(b, s, n, self.nope + self.v_dim)
        k_nope = self.k_nope(kv, (0, 0, 0, 0), (b, s, n, self.nope), (1, 1, 1, 1))
        v = self.values(kv, (0, 0, 0, self.nope), (b, s, n, self.nope + self.v_dim), (1, 1, 1, 1))
        return q_nope, q_rope, k_nope, k_rope, v

    def join(self, q_nope, q_rope, k_nope, k_rope, v):
        """q, k [B, S, heads, nope + rope] and v padded to that width: what the core takes."""
        q = self.join_q((q_nope, q_rope))
        k = self.join_k((k_nope, self.every_head(k_rope, self.head_ones)))
        return q, k, self.pad_values(v)

    def pad_values(self, v):
        """v zero-padded to the head width (the module docstring), as the layout asks (__init__)."""
        if self.pad_v is None:
            return v
        return self.pad_v(v, self.v_padding, self.pad_value) if self.sharded else self.pad_v(v)

    def qkv(self, x, batch: int, seq: int):
        """q, k, v [B, S, heads, nope + rope] before the rotation of their last `rope` features (the KV-cache
        decoder of models/generation.py rotates them at its own positions); v zero-padded."""
        return self.join(*self.parts(x, batch, seq))

    def output(self, out):
        """The core's [tokens, heads x (nope + rope)] -> wo of its value features [tokens, hidden]."""
        t, n = out.shape[0], self.num_heads
        if self.pad_v is not None:
            out = self.unpad(out.reshape(t, n, self.head_dim), (0, 0, 0), (t, n, self.v_dim), (1, 1, 1))
        return self.wo(out.reshape(t, n * self.v_dim))

    def construct(self, x, batch: int, seq: int, segment_ids=None):
        q_nope, q_rope, k_nope, k_rope, v = self.parts(x, batch, seq)
        q, k, v = self.join(q_nope, self.q_rotary(q_rope), k_nope, self.k_rotary(k_rope), v)
        return self.output(self.core(q, k, v, segment_ids))

    def shard_strategies(self, style: str, layout) -> dict:
        """The per-head ops split the heads over tp (as wq_b and wkv_b split them); the shared rotary key and the
        latent, one per token, split only the tokens."""
        heads, shared = head_split(layout), (layout.dp, layout.cp, 1, 1)
        pairs, rows = (*heads, 1), (layout.token_rows, 1)
        rules = {
            "q_nope": ((heads,), None),
            "q_rope": ((heads,), None),
            "latent": ((rows,), None),
            "k_rope": ((rows,), None),
            "k_nope": ((heads,), None),
            "values": ((heads,), None),
            "q_pairs": ((pairs,), None),
            "k_pairs": (((*shared, 1),), None),
            "join_q": ((heads, heads), None),
            "join_k": ((heads, heads), None),
            "every_head": ((shared, (1, 1, layout.tp, 1)), None),
            "unpad": (((layout.token_rows, layout.tp, 1),), None),
        }
        if self.pad_v is not None:
            rules["pad_v"] = ((heads, ()), None)
        else:
            del rules["unpad"]
        return rules
