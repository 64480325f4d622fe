"""GPT (Radford et al. 2019; Brown et al. 2020): LayerNorm, learned positions, GELU MLP of 4h, biases
everywhere, tied input/output embeddings optional.

Hugging Face `GPT2LMHeadModel`: GPT-2's Conv1D stores weights [in, out] (transposed), and c_attn is the
fused [q; k; v] projection, split here into wq/wk/wv (and joined back).
"""

from __future__ import annotations

from models.archs import llama
from models.spec import REPLICATE, ArchSpec, HFAdapter, HFUnsupported, Rule

# LLaMA's plan without rotary and the SwiGLU gate, plus learned positions added at the root
PLAN = {
    **{
        path: style
        for path, style in llama.PLAN.items()
        if path not in ("layers.*.attention.rotary", "layers.*.feed_forward.w3")
    },
    "": REPLICATE,
    "pos_embeddings": REPLICATE,
}

TABLE = (
    Rule("tok_embeddings.weight", "transformer.wte.weight"),
    Rule("pos_embeddings.weight", "transformer.wpe.weight"),
    Rule("layers.{i}.attention_norm.weight", "transformer.h.{i}.ln_1.weight"),
    Rule("layers.{i}.attention_norm.bias", "transformer.h.{i}.ln_1.bias"),
    *(
        Rule(f"layers.{{i}}.attention.{w}.weight", "transformer.h.{i}.attn.c_attn.weight", True, (n, 3))
        for n, w in enumerate(("wq", "wk", "wv"))
    ),
    *(
        Rule(f"layers.{{i}}.attention.{w}.bias", "transformer.h.{i}.attn.c_attn.bias", False, (n, 3))
        for n, w in enumerate(("wq", "wk", "wv"))
    ),
    Rule("layers.{i}.attention.wo.weight", "transformer.h.{i}.attn.c_proj.weight", True),
    Rule("layers.{i}.attention.wo.bias", "transformer.h.{i}.attn.c_proj.bias"),
    Rule("layers.{i}.ffn_norm.weight", "transformer.h.{i}.ln_2.weight"),
    Rule("layers.{i}.ffn_norm.bias", "transformer.h.{i}.ln_2.bias"),
    Rule("layers.{i}.feed_forward.w1.weight", "transformer.h.{i}.mlp.c_fc.weight", True),
    Rule("layers.{i}.feed_forward.w1.bias", "transformer.h.{i}.mlp.c_fc.bias"),
    Rule("layers.{i}.feed_forward.w2.weight", "transformer.h.{i}.mlp.c_proj.weight", True),
    Rule("layers.{i}.feed_forward.w2.bias", "transformer.h.{i}.mlp.c_proj.bias"),
    Rule("norm.weight", "transformer.ln_f.weight"),
    Rule("norm.bias", "transformer.ln_f.bias"),
    Rule("output.weight", "lm_head.weight"),
)


def config_from_hf(c: dict) -> dict:
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFUnsupported(
            f"activation_function={act!r}: MindScale's GPT uses the tanh GELU "
            "(gelu_new); convert a checkpoint trained with it"
        )
    if c.get("scale_attn_by_inverse_layer_idx") or c.get("scale_attn_weights") is False:
        raise HFUnsupported("GPT-2 attention-scaling variants are not supported (need 1/sqrt(d) scaling)")
    hidden = c["n_embd"]
    return {
        "arch": "gpt",
        "vocab_size": c["vocab_size"],
        "hidden_size": hidden,
        "num_layers": c["n_layer"],
        "num_heads": c["n_head"],
        "num_kv_heads": c["n_head"],
        "ffn_hidden_size": c.get("n_inner") or 4 * hidden,
        "seq_length": c["n_positions"],
        "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
        "tie_embeddings": bool(c.get("tie_word_embeddings", True)),
    }


def config_to_hf(m) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_heads,
        "n_inner": m.ffn_hidden_size,
        "n_positions": m.seq_length,
        "n_ctx": m.seq_length,
        "layer_norm_epsilon": m.norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": m.tie_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "torch_dtype": "float32",
    }


SPEC = ArchSpec(
    name="gpt",
    summary="LayerNorm, learned positions, GELU, biases",
    rms_norm=False,
    gated_mlp=False,
    bias=True,
    qkv_bias=True,
    rotary=False,
    grouped_query=False,
    free_head_dim=False,
    plan=PLAN,
    hf=HFAdapter("gpt2", TABLE, config_from_hf, config_to_hf, unprefixed="transformer."),
    lora_targets=("wq", "wk", "wv", "wo", "w1", "w2"),
    config_dirs=("gpt3",),
)
