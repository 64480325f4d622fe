"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): Mistral's LLaMA-shaped decoder whose feed-forward is a
sparse mixture of 8 SwiGLU experts, top-2 routed, the two chosen probabilities renormalised
(models/moe.py). Hugging Face `MixtralForCausalLM`: LLaMA's attention table, the router
`block_sparse_moe.gate` and per-expert w1 (gate), w3 (up), w2 (down), stacked here into [E, ...] weights.
"""

from __future__ import annotations

from models.archs import llama
from models.spec import EXPERT, REPLICATE, ArchSpec, HFAdapter, HFUnsupported, Rule

# LLaMA's attention plan; the feed-forward is the experts' (models/moe.py says how `expert` splits)
PLAN = {
    **{path: style for path, style in llama.PLAN.items() if not path.startswith("layers.*.feed_forward")},
    "layers.*.feed_forward": EXPERT,
    "layers.*.feed_forward.router": REPLICATE,
    "layers.*.feed_forward.experts": EXPERT,
}

ATTENTION_TABLE = tuple(rule for rule in llama.TABLE if ".feed_forward." not in rule.ours)


def expert_table(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """The router and stacked expert rules of a family storing them under model.layers.{i}.<block>."""
    prefix = f"model.layers.{{i}}.{block}"
    return (
        Rule("layers.{i}.feed_forward.router.weight", f"{prefix}.gate.weight"),
        Rule("layers.{i}.feed_forward.experts.w1", f"{prefix}.experts.{{e}}.{gate}.weight"),
        Rule("layers.{i}.feed_forward.experts.w3", f"{prefix}.experts.{{e}}.{up}.weight"),
        Rule("layers.{i}.feed_forward.experts.w2", f"{prefix}.experts.{{e}}.{down}.weight"),
    )


TABLE = (*ATTENTION_TABLE, *expert_table("block_sparse_moe", "w1", "w3", "w2"))

# LoRA adapts Linear layers; the experts are batched [E, F, h] weights, not Linears (validate.py says so)
LORA_TARGETS = ("wq", "wk", "wv", "wo")


def config_from_hf(c: dict) -> dict:
    if c.get("sliding_window") is not None:
        raise HFUnsupported(
            f"sliding_window={c['sliding_window']} is not supported (full causal attention only); "
            "use a checkpoint whose config.json has sliding_window null"
        )
    return llama.decoder_from_hf(c, "mixtral") | {
        "moe": {
            "num_experts": c["num_local_experts"],
            "top_k": c["num_experts_per_tok"],
            "norm_topk_prob": True,
            "aux_loss_coeff": float(c.get("router_aux_loss_coef", 0.02)),
        }
    }


def softmax_experts_only(m) -> None:
    """Refuse to export what a softmax-routed family's config.json cannot say: DeepSeek-V3's sigmoid router or
    dense first layers (models.spec.HFUnsupported, one line)."""
    if m.moe.router != "softmax" or m.moe.dense_layers:
        raise HFUnsupported(
            f"model.moe.router={m.moe.router}, dense_layers={m.moe.dense_layers}: {m.arch}'s Hugging "
            "Face config has a softmax router on every layer; export with router softmax and no dense "
            "layers, or use model.arch deepseek_v3"
        )


def config_to_hf(m) -> dict:
    softmax_experts_only(m)
    return llama.decoder_to_hf(m, "MixtralForCausalLM") | {
        "num_local_experts": m.moe.num_experts,
        "num_experts_per_tok": m.moe.top_k,
        "router_aux_loss_coef": m.moe.aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


SPEC = ArchSpec(
    name="mixtral",
    summary="LLaMA with a top-k mixture of SwiGLU experts (model.moe); Mixtral",
    rms_norm=True,
    gated_mlp=True,
    bias=False,
    qkv_bias=False,
    rotary=True,
    moe=True,
    plan=PLAN,
    hf=HFAdapter("mixtral", TABLE, config_from_hf, config_to_hf),
    lora_targets=LORA_TARGETS,
    config_dirs=("mixtral",),
)
