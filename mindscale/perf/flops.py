"""Parameter counts, FLOPs per token and MFU/HFU (defined in docs/mfu.md). Pure Python: no MindSpore.

The trainer's logged MFU/HFU (mindscale/train/loop/metrics.py), tools/mfu.py and the planner all call the
functions here, so a number printed by one can be reproduced by the others and by hand.

Definitions
-----------
Model FLOPs per token (PaLM, Chowdhery et al. 2022, App. B)::

    6·N + 12·L·H·Q·T

N = weights of all matmuls (attention q/k/v/o, MLP, and the output projection; not the input
embedding lookup, not learned positions), L layers, H query heads, Q head dim, T sequence length.
Full attention is counted (no causal halving), as in PaLM and Megatron's 2021-2022 papers.
A mixture of experts counts the weights a token computes with, N_active: the router (h x E), its
top_k routed experts and any shared expert, not the E - top_k experts it skips (6·N_active +
attention, as MoE papers and Megatron-Core count; the dispatch and combine are not counted).

Hardware FLOPs per token add what recompute runs again. The Megatron papers give them per
iteration for a GPT with multi-head attention and a 4h MLP (h = hidden, s = sequence, V = vocab,
B = global batch):

* no recompute (= model FLOPs):  72·B·L·s·h²·(1 + s/(6h)  + V/(12·h·L))
* selective recompute:           72·B·L·s·h²·(1 + s/(3h)  + V/(12·h·L))   Korthikanti et al. 2022, §6
* full recompute:                96·B·L·s·h²·(1 + s/(6h)  + V/(16·h·L))   Narayanan et al. 2021, eq. 3

Per token these are: layers' matmuls 6·N_layers (8·N_layers with full recompute: one more
forward), attention core 12·L·h·s (24 with selective — the term Korthikanti et al. use;
16 with full), output projection 6·V·h (never recomputed). With N_layers and the attention width
H·Q read from the model, the same decomposition covers GQA (smaller k/v matrices) and SwiGLU
(three MLP matrices), and with MHA + 4h MLP it is exactly the papers' formulas (tests pin that).
When only some layers recompute, the extra FLOPs scale with the number of recomputed layers, which
callers take from the Layout (mindscale/config/layout.py decides which layers recompute).
"""

from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")


# ----------------------------------------------------------------------------------------------
# Parameter counts (exact, analytic)


def attention_width(m) -> int:
    """H·Q: the width of the query (and attention output) projection."""
    return m.num_heads * m.head_size


def core_width(m) -> float:
    """The mean of the query/key and value widths of all heads, H·(Q_k + Q_v)/2: what QK^T and scores x V multiply
    over, on average (H·Q without multi-head latent attention, whose values are narrower than its keys)."""
    return m.num_heads * (m.head_size + m.value_head_size) / 2


def attention_params(m) -> int:
    """Matmul weights of one layer's attention: q, k, v, o; or multi-head latent attention's down- and
    up-projections of the query (or its one projection) and of the key/value latent, and o."""
    h = m.hidden_size
    if not m.spec.mla:
        return 2 * h * attention_width(m) + 2 * h * m.kv_heads * m.head_size
    mla, n = m.mla, m.num_heads
    q = h * mla.q_lora_rank + mla.q_lora_rank * n * mla.qk_head_dim if mla.q_lora_rank else h * n * mla.qk_head_dim
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * n * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + n * mla.v_head_dim * h


def layer_kinds(m) -> tuple[int, int]:
    """(layers with a dense MLP, layers with experts): a mixture of experts' first model.moe.dense_layers are
    dense (DeepSeek-V3's first_k_dense_replace)."""
    moe_layers = m.num_layers - m.moe.dense_layers if m.spec.moe else 0
    return m.num_layers - moe_layers, moe_layers


def mlp_params(m, active: bool, dense: bool = False) -> int:
    """The feed-forward's matmul weights in one layer: all of them, or (`active`) those one token computes
    with. A mixture of experts (model.moe) stores the router h x E, E routed SwiGLU experts and a shared one;
    a token computes with the router, its top_k experts and the shared one. Dense (a dense family, or `dense`:
    a mixture of experts' dense first layers): the same either way."""
    h = m.hidden_size
    if not m.spec.moe or dense:
        return (3 if m.spec.gated_mlp else 2) * h * m.ffn_hidden_size  # SwiGLU gate/up/down; GELU up/down
    moe = m.moe
    experts = moe.top_k if active else moe.num_experts
    return h * moe.num_experts + 3 * h * (
        experts * moe.expert_ffn(m.ffn_hidden_size) + moe.shared_expert_ffn_hidden_size
    )


def layer_matmul_params(m, active: bool = True, dense: bool = False) -> int:
    """Matmul weights of one transformer layer (no biases, no norms): those a token computes with (`active`,
    the FLOPs' N), or all that are stored (a mixture of experts' every expert); `dense`: of a mixture of experts'
    dense first layers."""
    return attention_params(m) + mlp_params(m, active, dense)


def layers_matmul_params(m, active: bool = True) -> int:
    """Matmul weights of all the layers (dense ones and ones with experts)."""
    dense, experts = layer_kinds(m)
    return dense * layer_matmul_params(m, active, dense=True) + experts * layer_matmul_params(m, active)


def output_params(m) -> int:
    """The output projection h x V (shared with the embedding when tied, counted once)."""
    return m.hidden_size * m.vocab_size


def mtp_matmul_params(m, active: bool = True) -> int:
    """Matmul weights of the multi-token-prediction modules (model.mtp_depth; models/mtp.py): each module's
    projection [h, 2h], its block (a layer with experts: of a mixture of experts the active ones) and, for the
    FLOPs (`active`), the shared output head it runs again (its weight is the model's, not counted twice)."""
    module = 2 * m.hidden_size**2 + layer_matmul_params(m, active, dense=not m.spec.moe)
    return m.mtp_depth * (module + (output_params(m) if active else 0))


def matmul_param_count(m) -> int:
    """N of PaLM's 6N: all layers' matmul weights plus the output projection, and what the multi-token-prediction
    modules compute with; of a mixture of experts the active ones (N_active: the router, top_k routed experts,
    the shared expert)."""
    return layers_matmul_params(m) + output_params(m) + mtp_matmul_params(m)


def layer_other_params(m) -> int:
    """Per-layer weights that are not matmuls: norms and biases (GPT: every linear layer's; Qwen2: q/k/v;
    Qwen3: the q and k head norms)."""
    h = m.hidden_size
    qkv_bias = attention_width(m) + 2 * m.kv_heads * m.head_size if m.spec.qkv_bias else 0
    qk_norm = 2 * m.head_size if m.spec.qk_norm else 0
    latent_norms = (m.mla.q_lora_rank or 0) + m.mla.kv_lora_rank if m.spec.mla else 0
    if m.spec.rms_norm:
        return qkv_bias + qk_norm + latent_norms + 2 * h  # two RMSNorm scales
    return qkv_bias + h + m.ffn_hidden_size + h + 2 * 2 * h  # biases; 2 LayerNorms (w, b)


def param_count(m) -> int:
    """Every trainable weight. LLaMA: untied embedding + output, RMSNorms, no biases, GQA, SwiGLU; Qwen2:
    the same plus q/k/v biases. GPT: biases, LayerNorms with bias, learned positions (seq_length x h), GELU MLP.
    DeepSeek-V3: not its routers' correction biases (E per MoE layer, stored but not trained; transformers keeps
    them as buffers, outside its parameter count too); its multi-token-prediction modules when built (each a
    layer, a projection and three norms; they share the embedding and head)."""
    h = m.hidden_size
    embedding = m.vocab_size * h
    output = 0 if m.tie_embeddings else output_params(m)
    final_norm = h if m.spec.rms_norm else 2 * h
    positions = 0 if m.spec.rotary else m.seq_length * h
    layers = layers_matmul_params(m, active=False) + m.num_layers * layer_other_params(m)
    mtp = mtp_matmul_params(m, active=False) + m.mtp_depth * (layer_other_params(m) + 3 * h)  # + enorm, hnorm, norm
    return embedding + positions + layers + final_norm + output + mtp


# ----------------------------------------------------------------------------------------------
# FLOPs per token


def palm_flops_per_token(n_matmul: int, layers: int, heads: int, head_dim: int, seq: int) -> float:
    """PaLM App. B: 6N + 12·L·H·Q·T."""
    return 6 * n_matmul + 12 * layers * heads * head_dim * seq


def model_flops_per_token(m) -> float:
    """Model FLOPs per token, 6N + 12·L·H·Q·T (PaLM App. B; H·Q the mean of the key and value widths); the
    multi-token-prediction modules' blocks count as layers (N: matmul_param_count)."""
    return palm_flops_per_token(
        matmul_param_count(m), m.num_layers + m.mtp_depth, m.num_heads, core_width(m) / m.num_heads, m.seq_length
    )


def recompute_flops_per_token(m, recompute: str, recomputed_layers: int) -> float:
    """FLOPs per token that recompute adds on top of the model FLOPs, for `recomputed_layers` layers
    recomputed in mode `recompute` ('none'|'selective'|'full'). Which layers those are is the Layout's
    decision (`len(Layout.of(cfg).recomputed)`, or `recomputed_in(stage)` for one stage).

    selective: the attention core once more, 12·H·Q·T per recomputed layer (Korthikanti et al. 2022:
    s/(3h) instead of s/(6h) in their per-iteration formula).
    full: one more forward of the layer, 2·N_layer + 4·H·Q·T per recomputed layer (Narayanan et al.
    2021, eq. 3: 96 = 72 + 24 and 16·L·h·s = 12 + 4 for the attention; the output layer is not
    recomputed: V/(16hL) x 96 = V/(12hL) x 72).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {recompute!r} is not one of {RECOMPUTE_MODES}")
    if not 0 <= recomputed_layers <= m.num_layers or (recompute == "none" and recomputed_layers):
        raise ValueError(
            f"{recomputed_layers} recomputed layers with recompute mode {recompute!r} and "
            f"{m.num_layers} layers: need 0 to {m.num_layers}, and 0 when the mode is none"
        )
    per_layer_core = 12 * core_width(m) * m.seq_length
    if recompute == "selective":
        return recomputed_layers * per_layer_core
    if recompute == "full":  # a layer's mean matmul weights: dense and expert layers differ (DeepSeek-V3)
        return recomputed_layers * (2 * layers_matmul_params(m) / m.num_layers + per_layer_core / 3)
    return 0.0


def hardware_flops_per_token(m, recompute: str, recomputed_layers: int) -> float:
    """Hardware FLOPs per token: model FLOPs plus recompute (see the module docstring and
    `recompute_flops_per_token` for the arguments)."""
    return model_flops_per_token(m) + recompute_flops_per_token(m, recompute, recomputed_layers)


def routing_flops_per_token(m, group_tokens: int) -> float:
    """FLOPs per token and layer that a mixture of experts runs beyond its model FLOPs (models/moe.py), for
    token groups of `group_tokens` (one rank's tokens of a micro batch): the experts' work on the padding slots
    of their capacity, E·C/T - top_k slots per token of 6·3·h·F (dropless, C = T: E - top_k). Hardware work,
    not in MFU; 0 for a dense model. (The dispatch and combine are gathers: no FLOPs.)"""
    if not m.spec.moe:
        return 0.0
    moe = m.moe
    slots = moe.num_experts * moe.capacity(group_tokens)
    return max(0.0, slots / group_tokens - moe.top_k) * 6 * 3 * m.hidden_size * moe.expert_ffn(m.ffn_hidden_size)


# ----------------------------------------------------------------------------------------------
# The Megatron papers' per-iteration forms (GPT, MHA, 4h MLP), kept to check the generalisation


def megatron_model_flops_per_iteration(batch: int, layers: int, seq: int, hidden: int, vocab: int) -> float:
    """72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)): model FLOPs (Korthikanti et al. 2022, §6)."""
    return 72 * batch * layers * seq * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * hidden * layers))


def korthikanti_selective_flops_per_iteration(batch: int, layers: int, seq: int, hidden: int, vocab: int) -> float:
    """72·B·L·s·h²·(1 + s/(3h) + V/(12·h·L)): hardware FLOPs with selective recompute."""
    return 72 * batch * layers * seq * hidden**2 * (1 + seq / (3 * hidden) + vocab / (12 * hidden * layers))


def narayanan_full_flops_per_iteration(batch: int, layers: int, seq: int, hidden: int, vocab: int) -> float:
    """96·B·L·s·h²·(1 + s/(6h) + V/(16·h·L)): hardware FLOPs with full recompute (Narayanan et al. 2021, eq. 3)."""
    return 96 * batch * layers * seq * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * hidden * layers))


# ----------------------------------------------------------------------------------------------
# Utilisation


def utilization(tokens_per_s: float, flops_per_token: float, devices: int, peak_tflops: float) -> float:
    """tokens/s x FLOPs per token / (devices x peak): a fraction."""
    if devices < 1 or peak_tflops <= 0:
        raise ValueError(f"devices={devices}, peak_tflops={peak_tflops}: need devices >= 1 and a peak > 0")
    return tokens_per_s * flops_per_token / (devices * peak_tflops * 1e12)


def mfu(tokens_per_s: float, devices: int, peak_tflops: float, m) -> float:
    """Model FLOPs utilisation (docs/mfu.md)."""
    return utilization(tokens_per_s, model_flops_per_token(m), devices, peak_tflops)


def hfu(tokens_per_s: float, devices: int, peak_tflops: float, m, recompute: str, recomputed_layers: int) -> float:
    """Hardware FLOPs utilisation: recompute counted (docs/mfu.md)."""
    return utilization(tokens_per_s, hardware_flops_per_token(m, recompute, recomputed_layers), devices, peak_tflops)


def formula_text() -> str:
    """One line stating the definitions, printed beside every MFU."""
    return (
        "MFU = tokens/s x (6N + 12·L·H·Q·T) / (devices x peak) [PaLM App. B, full attention, no causal "
        "halving]; HFU adds recompute [Korthikanti et al. 2022 selective, Narayanan et al. 2021 full]"
    )
