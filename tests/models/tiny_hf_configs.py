"""Tiny Hugging Face model configs that several model tests build."""

from transformers import DeepseekV3Config


def deepseek_v3_config(plain: bool = False, **dims) -> DeepseekV3Config:
    """A tiny DeepSeek-V3: 4 heads of 16 + 8 (rotary) with values of 12 (padded for the core), 8 experts of 32 in
    4 groups (2 kept), top-3, scaled by 2.5, 2 shared experts, the first layer dense. `plain`: a full query
    projection (q_lora_rank null), rotary weights not interleaved, one group, weights not renormalised, no
    dense layer."""
    dims = {"tie_word_embeddings": False, **dims, "num_key_value_heads": dims["num_attention_heads"]}
    shape = (
        dict(
            q_lora_rank=None,
            rope_interleave=False,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            first_k_dense_replace=0,
        )
        if plain
        else dict(
            q_lora_rank=32, rope_interleave=True, n_group=4, topk_group=2, norm_topk_prob=True, first_k_dense_replace=1
        )
    )
    return DeepseekV3Config(
        **dims,
        **shape,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
    )
