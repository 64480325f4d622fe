"""LLaMA (Touvron et al. 2023; LLaMA-2 and LLaMA-3): RMSNorm, rotary embeddings (LLaMA-3.1's frequency
scaling optional), SwiGLU, GQA, no biases, untied output (tied: LLaMA-3.2).

Hugging Face `LlamaForCausalLM` stores the same [out, in] matrices under other names; its q/k weights
are already in the rotate-half layout our RotaryEmbedding uses, so nothing is permuted.
"""

from __future__ import annotations

from models.spec import COLWISE, ROWWISE, SEQUENCE, VOCAB, ArchSpec, HFAdapter, HFUnsupported, Rule

PLAN = {
    "tok_embeddings": VOCAB,
    "layers.*": SEQUENCE,
    "layers.*.attention_norm": SEQUENCE,
    "layers.*.attention.wq": COLWISE,
    "layers.*.attention.wk": COLWISE,
    "layers.*.attention.wv": COLWISE,
    "layers.*.attention.rotary": COLWISE,
    "layers.*.attention.core": COLWISE,
    "layers.*.attention.wo": ROWWISE,
    "layers.*.ffn_norm": SEQUENCE,
    "layers.*.feed_forward": COLWISE,
    "layers.*.feed_forward.w1": COLWISE,
    "layers.*.feed_forward.w3": COLWISE,
    "layers.*.feed_forward.w2": ROWWISE,
    "norm": SEQUENCE,
    "output": VOCAB,
    "loss": VOCAB,
}

TABLE = (
    Rule("tok_embeddings.weight", "model.embed_tokens.weight"),
    Rule("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    Rule("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    Rule("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    Rule("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    Rule("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    Rule("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    Rule("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    Rule("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    Rule("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    Rule("norm.weight", "model.norm.weight"),
    Rule("output.weight", "lm_head.weight"),
)

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def rope_scaling_from_hf(c: dict) -> dict:
    """Our rope_* keys from config.json's rope_scaling: none, or LLaMA-3.1's rope_type llama3."""
    scaling = c.get("rope_scaling")
    if not scaling:
        return {"rope_scaling": "none"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3" or c.get("model_type") != "llama":
        raise HFUnsupported(
            f"rope_scaling={scaling} is not supported (LLaMA's rope_type llama3 only); "
            "use a checkpoint without that RoPE scaling"
        )
    return {
        "rope_scaling": "llama3",
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "rope_original_max_positions": int(scaling["original_max_position_embeddings"]),
    }


def decoder_from_hf(c: dict, arch: str) -> dict:
    """The keys every LLaMA-shaped config.json (LLaMA, Qwen2, Qwen3) has, after refusing what we do not
    build: biases beyond the family's, a sliding window, another activation."""
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise HFUnsupported(f"{arch} checkpoints with attention_bias/mlp_bias are not supported")
    if c.get("use_sliding_window"):
        raise HFUnsupported(
            "use_sliding_window=true is not supported (full causal attention only); "
            "use a checkpoint without a sliding window"
        )
    if c.get("hidden_act", "silu") != "silu":
        raise HFUnsupported(f"hidden_act={c['hidden_act']!r} is not supported (SwiGLU with silu only)")
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim")
    return {
        "arch": arch,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "num_layers": c["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": c.get("num_key_value_heads") or heads,
        "head_dim": None if head_dim in (None, c["hidden_size"] // heads) else head_dim,
        "ffn_hidden_size": c["intermediate_size"],
        "seq_length": c.get("max_position_embeddings", 4096),
        "rope_theta": float(c.get("rope_theta", 10000.0)),
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        **rope_scaling_from_hf(c),
    }


def config_from_hf(c: dict) -> dict:
    return decoder_from_hf(c, "llama")


def decoder_to_hf(m, architecture: str) -> dict:
    """The config.json keys LLaMA-shaped families share, for ModelConfig `m`."""
    config = {
        "architectures": [architecture],
        "model_type": m.arch,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_size,
        "intermediate_size": m.ffn_hidden_size,
        "max_position_embeddings": m.seq_length,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": "float32",
    }
    if m.rope_scaling_params:
        factor, low, high, original = m.rope_scaling_params
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    return config


def config_to_hf(m) -> dict:
    return decoder_to_hf(m, "LlamaForCausalLM") | {"attention_bias": False, "mlp_bias": False}


SPEC = ArchSpec(
    name="llama",
    summary="RMSNorm, RoPE, SwiGLU, no biases",
    rms_norm=True,
    gated_mlp=True,
    bias=False,
    qkv_bias=False,
    rotary=True,
    plan=PLAN,
    hf=HFAdapter("llama", TABLE, config_from_hf, config_to_hf),
    lora_targets=LORA_TARGETS,
    config_dirs=("llama2", "llama3", "llama3_1", "llama3_2"),
)
