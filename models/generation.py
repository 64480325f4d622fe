"""Autoregressive generation with a key/value cache.

    decoder = KVCacheDecoder(model, cfg, max_length)      # shares the model's cells and weights
    ids = generate(decoder, prompt_ids, max_new_tokens, Sampler(greedy=True), stop_ids={eos_id})

The prompt is run once (prefill), then one token per call, each layer attending to its cached keys
and values. The caches are fixed-size buffers [layers, batch, kv_heads, max_length, head_dim]
passed in and returned, and the positions are a tensor, so in graph mode the decoder compiles
twice (prefill length, then length 1) however many tokens are generated. A step writes its
new k/v into the buffer with a one-hot [max_length, s] matmul (the unwritten rows are zero), and
a query at position p sees cache rows 0..p: shapes never change, no dynamic slicing.

The layer math is the model's: the same Linear/norm/MLP cells (LoRA-wrapped ones too) and the
same rotate-half rotary formula, evaluated at absolute positions; sampling runs on the host.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from models.attention import MASKED
from models.layers import DTYPES, rotary_tables
from models.transformer import CausalLM
from mindscale.config import Config


class KVCacheDecoder(nn.Cell):
    """construct(ids [B, s], positions [s], k_cache, v_cache) -> (last-token logits [B, V] fp32, k, v)."""

    def __init__(self, model: CausalLM, cfg: Config, max_length: int):
        super().__init__(auto_prefix=False)
        model_config = cfg.model
        if model.pos_embeddings is not None and max_length > model_config.seq_length:
            raise ValueError(
                f"prompt + new tokens = {max_length} exceeds model.seq_length={model_config.seq_length}, the "
                "learned positions of this GPT; shorten the prompt or --max_new_tokens"
            )
        self.model = model
        self.max_length = max_length
        self.num_heads, self.num_kv_heads, self.head_dim = (
            model_config.num_heads,
            model_config.kv_heads,
            model_config.head_size,
        )
        self.group = model_config.num_heads // model_config.kv_heads
        self.rotary = model_config.spec.rotary
        dtype = DTYPES[model_config.compute_dtype]
        self.compute_dtype = dtype
        # the rotary part: the whole head, or multi-head latent attention's last rope_head_size features
        self.rope_dim = model_config.rope_head_size
        self.cos, self.sin = rotary_tables(
            max_length, self.rope_dim, model_config.rope_theta, model_config.rope_scaling_params, dtype
        )
        self.half = self.rope_dim // 2
        self.scale = 1.0 / math.sqrt(model_config.head_size)
        self.slots = Tensor(np.arange(max_length, dtype=np.int32).reshape(1, max_length))

    def cache_shape(self, batch: int) -> tuple:
        return (len(self.model.layers), batch, self.num_kv_heads, self.max_length, self.head_dim)

    def empty_cache(self, batch: int) -> tuple[Tensor, Tensor]:
        shape = self.cache_shape(batch)
        return ops.zeros(shape, self.compute_dtype), ops.zeros(shape, self.compute_dtype)

    def _rope(self, x, cos, sin):
        """Rotate-half rotary embedding of the last rope_dim features of x [B, s, heads, d] (all of them but
        under multi-head latent attention) at the gathered positions' cos/sin [s, 1, rope_dim]."""
        kept, x = x[..., : self.head_dim - self.rope_dim], x[..., self.head_dim - self.rope_dim :]
        low, high = x[..., : self.half], x[..., self.half :]
        rotated = x * cos + ops.concat((high, low), -1) * sin
        return rotated if self.rope_dim == self.head_dim else ops.concat((kept, rotated), -1)

    def construct(self, ids, positions, k_cache, v_cache):
        model = self.model
        b, s = ids.shape
        n, kv, g, d = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        x = model.tok_embeddings(ids)
        if model.pos_embeddings is not None:
            x = x + model.pos_embeddings(positions)
        x = x.reshape(b * s, -1)
        write = ops.cast(ops.transpose(ops.equal(positions.reshape(s, 1), self.slots), (1, 0)), self.compute_dtype)
        mask = ops.cast(ops.greater(self.slots, positions.reshape(s, 1)), ms.float32) * MASKED  # [s, T]
        cos, sin = ops.gather(self.cos, positions, 0), ops.gather(self.sin, positions, 0)
        new_k, new_v = [], []
        for i, layer in enumerate(model.layers):
            att = layer.attention
            h = layer.attention_norm(x)
            q, k, v = att.qkv(h, b, s)
            if self.rotary:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            keys = k_cache[i] + ops.matmul(write, ops.transpose(k, (0, 2, 1, 3)))  # [B, kv, T, d]
            values = v_cache[i] + ops.matmul(write, ops.transpose(v, (0, 2, 1, 3)))
            new_k.append(keys)
            new_v.append(values)
            q = ops.transpose(q * self.scale, (0, 2, 1, 3)).reshape(b, kv, g * s, d)
            scores = ops.cast(ops.matmul(q, ops.transpose(keys, (0, 1, 3, 2))), ms.float32)
            probs = ops.softmax(scores.reshape(b, kv, g, s, self.max_length) + mask, -1)
            out = ops.matmul(ops.cast(probs, self.compute_dtype).reshape(b, kv, g * s, self.max_length), values)
            out = ops.transpose(out.reshape(b, n, s, d), (0, 2, 1, 3)).reshape(b * s, n * d)
            x = x + ops.cast(att.output(out), layer.residual_dtype)
            h = layer.ffn_norm(x)
            # a mixture of experts routes dropless, as transformers does (models/moe.py)
            f = layer.feed_forward.forward(h, None)[0] if layer.moe else layer.feed_forward(h)
            x = x + ops.cast(f, layer.residual_dtype)
        last = model.norm(x).reshape(b, s, -1)[:, s - 1]
        return model.logits(last), ops.stack(new_k), ops.stack(new_v)


@dataclass(frozen=True)
class Sampler:
    """Next-token choice from logits: greedy (argmax), or temperature then top-k then top-p (nucleus)
    sampling from a numpy generator seeded once, so a seed reproduces a generation."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"--temperature={self.temperature}: must be > 0 (use --greedy for argmax)")
        if self.top_k < 0:
            raise ValueError(f"--top-k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p={self.top_p}: must be in (0, 1]")

    def chooser(self):
        """A function logits [V] -> token id, with its own random stream."""
        rng = np.random.default_rng(self.seed)

        def choose(logits: np.ndarray) -> int:
            logits = logits.astype(np.float64)
            if self.greedy:
                return int(np.argmax(logits))
            logits = logits / self.temperature
            if 0 < self.top_k < logits.size:
                kth = np.partition(logits, -self.top_k)[-self.top_k]
                logits = np.where(logits < kth, -np.inf, logits)
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            if self.top_p < 1:
                order = np.argsort(-probs, kind="stable")
                before = np.cumsum(probs[order]) - probs[order]  # mass of strictly more likely tokens
                drop = order[before >= self.top_p]  # keep the smallest prefix reaching top_p (never empty)
                probs[drop] = 0.0
                probs /= probs.sum()
            return int(rng.choice(probs.size, p=probs))

        return choose


def generate(
    decoder: KVCacheDecoder,
    prompt: list[int],
    max_new_tokens: int,
    sampler: Sampler,
    stop_ids: Collection[int] = (),
    vocab: int | None = None,
) -> list[int]:
    """New token ids after `prompt` (not including it); stops after any of `stop_ids` (kept) or
    max_new_tokens. With `vocab`, only ids below it are chosen: a model's vocabulary is often padded past
    its tokenizer's, and the padding rows' ids decode to nothing (SentencePiece refuses them)."""
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt) + max_new_tokens > decoder.max_length:
        raise ValueError(
            f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) > the decoder's "
            f"max_length {decoder.max_length}"
        )
    choose = sampler.chooser()
    k_cache, v_cache = decoder.empty_cache(1)
    ids = Tensor(np.array([prompt], np.int32))
    positions = Tensor(np.arange(len(prompt), dtype=np.int32))
    out: list[int] = []
    for step in range(max_new_tokens):
        logits, k_cache, v_cache = decoder(ids, positions, k_cache, v_cache)
        token = choose(logits.asnumpy()[0][:vocab])
        out.append(token)
        if token in stop_ids:
            break
        ids = Tensor(np.array([[token]], np.int32))
        positions = Tensor(np.array([len(prompt) + step], np.int32))
    return out
