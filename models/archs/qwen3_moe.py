"""Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical Report"): Qwen3's decoder (qk-norm, free head width) with a
mixture of 128 fine-grained SwiGLU experts, top-8 routed (models/moe.py), no shared expert. Hugging Face
`Qwen3MoeForCausalLM`: Qwen3's attention table, the router `mlp.gate` and per-expert gate/up/down projections,
stacked here. Checkpoints with dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step > 1)
are refused; the released ones have none.
"""

from __future__ import annotations

from models.archs import llama, mixtral, qwen3
from models.spec import ArchSpec, HFAdapter, HFUnsupported

PLAN = {
    **mixtral.PLAN,
    "layers.*.attention.q_norm": qwen3.PLAN["layers.*.attention.q_norm"],
    "layers.*.attention.k_norm": qwen3.PLAN["layers.*.attention.k_norm"],
}

TABLE = (
    *(rule for rule in qwen3.TABLE if ".feed_forward." not in rule.ours),
    *mixtral.expert_table("mlp", "gate_proj", "up_proj", "down_proj"),
)


def config_from_hf(c: dict) -> dict:
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise HFUnsupported(
            f"mlp_only_layers={c.get('mlp_only_layers')}, decoder_sparse_step="
            f"{c.get('decoder_sparse_step')}: dense layers among the experts are not supported "
            "(every layer a mixture of experts); use a checkpoint without them"
        )
    return llama.decoder_from_hf(c, "qwen3_moe") | {
        "moe": {
            "num_experts": c["num_experts"],
            "top_k": c["num_experts_per_tok"],
            "ffn_hidden_size": c["moe_intermediate_size"],
            "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
            "aux_loss_coeff": float(c.get("router_aux_loss_coef", 0.001)),
        }
    }


def config_to_hf(m) -> dict:
    mixtral.softmax_experts_only(m)
    return qwen3.config_to_hf(m) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": m.moe.num_experts,
        "num_experts_per_tok": m.moe.top_k,
        "moe_intermediate_size": m.moe.expert_ffn(m.ffn_hidden_size),
        "norm_topk_prob": m.moe.norm_topk_prob,
        "router_aux_loss_coef": m.moe.aux_loss_coeff,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


SPEC = ArchSpec(
    name="qwen3_moe",
    summary="Qwen3 with a top-k mixture of fine-grained SwiGLU experts (model.moe); Qwen3-MoE",
    rms_norm=True,
    gated_mlp=True,
    bias=False,
    qkv_bias=False,
    rotary=True,
    qk_norm=True,
    moe=True,
    plan=PLAN,
    hf=HFAdapter("qwen3_moe", TABLE, config_from_hf, config_to_hf),
    lora_targets=mixtral.LORA_TARGETS,
    config_dirs=("qwen3_moe",),
)
