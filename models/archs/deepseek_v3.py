"""DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"): multi-head latent attention (models/mla.py,
model.mla), the first model.moe.dense_layers layers with a dense SwiGLU, the rest a mixture of 256 fine-grained
SwiGLU experts with one shared expert, routed by sigmoid scores with a correction bias, group-limited
(models/router.py, model.moe.router sigmoid).

Hugging Face `DeepseekV3ForCausalLM`: LLaMA's norms and embeddings, the MLA projections (q_a_proj/q_a_layernorm/
q_b_proj or q_proj, kv_a_proj_with_mqa/kv_a_layernorm/kv_b_proj, o_proj), the dense layers' mlp.{gate,up,down}_proj,
and the MoE layers' router mlp.gate (weight, e_score_correction_bias), stacked experts and mlp.shared_experts.

Not mapped, each refused in one line: rope_scaling (YaRN: the released model's 128K extension; the
4K pretraining shape has none), any router but sigmoid/noaux_tc, MoE layers interleaved with dense ones
(moe_layer_freq > 1), fewer key/value heads than heads. The multi-token-prediction modules (num_nextn_predict_layers
= model.mtp_depth, models/mtp.py) are stored as model.layers.{L + k}.* after the L decoder layers: enorm, hnorm,
eh_proj, the decoder block's tensors, shared_head.norm, and copies of the shared embedding (embed_tokens) and
head (shared_head.head). transformers' modeling does not load them.
"""

from __future__ import annotations

from models.archs import llama, mixtral
from models.spec import COLWISE, EXPERT, REPLICATE, ROWWISE, ArchSpec, HFAdapter, HFUnsupported, Rule

_ATTENTION = "layers.*.attention"
PLAN = {
    **{path: style for path, style in llama.PLAN.items() if not path.startswith(_ATTENTION + ".")},
    _ATTENTION: COLWISE,  # the per-head slices, joins and the value padding
    f"{_ATTENTION}.wq": REPLICATE,  # the low-rank down-projections and their norms: one per token
    f"{_ATTENTION}.q_a_norm": REPLICATE,
    f"{_ATTENTION}.wkv_a": REPLICATE,
    f"{_ATTENTION}.kv_a_norm": REPLICATE,
    f"{_ATTENTION}.wq_b": COLWISE,  # the up-projections split the heads
    f"{_ATTENTION}.wkv_b": COLWISE,
    f"{_ATTENTION}.q_rotary": COLWISE,
    f"{_ATTENTION}.k_rotary": REPLICATE,  # the one rotary key every head shares
    f"{_ATTENTION}.core": COLWISE,
    f"{_ATTENTION}.wo": ROWWISE,
    # dense layers: llama's feed_forward rows (kept above); MoE layers: mixtral's, the router's bias and the
    # shared expert split as a dense MLP
    "layers.*.feed_forward": EXPERT,
    "layers.*.feed_forward.router": REPLICATE,
    "layers.*.feed_forward.routing": REPLICATE,
    "layers.*.feed_forward.experts": EXPERT,
    "layers.*.feed_forward.shared_expert": COLWISE,
    "layers.*.feed_forward.shared_expert.w1": COLWISE,
    "layers.*.feed_forward.shared_expert.w3": COLWISE,
    "layers.*.feed_forward.shared_expert.w2": ROWWISE,
}
# what a model of the family may lack: the query's down-projection (q_lora_rank null), the dense layers
# (dense_layers 0), the experts (a model cut to its dense layers: the planner's one-layer models)
OPTIONAL_PLAN = (
    f"{_ATTENTION}.q_a_norm",
    f"{_ATTENTION}.wq_b",
    "layers.*.feed_forward.w1",
    "layers.*.feed_forward.w3",
    "layers.*.feed_forward.w2",
    "layers.*.feed_forward.router",
    "layers.*.feed_forward.routing",
    "layers.*.feed_forward.experts",
    "layers.*.feed_forward.shared_expert",
    "layers.*.feed_forward.shared_expert.w1",
    "layers.*.feed_forward.shared_expert.w3",
    "layers.*.feed_forward.shared_expert.w2",
)

_HF_ATTENTION = "model.layers.{i}.self_attn"
_Q_FULL = f"{_HF_ATTENTION}.q_proj.weight"
_Q_LOW_RANK = tuple(f"{_HF_ATTENTION}.{name}.weight" for name in ("q_a_proj", "q_a_layernorm", "q_b_proj"))
TABLE = (
    *(rule for rule in llama.TABLE if ".attention." not in rule.ours),  # embeddings, norms, dense MLP, head
    Rule("layers.{i}.attention.wq.weight", _Q_LOW_RANK[0]),
    Rule("layers.{i}.attention.q_a_norm.weight", _Q_LOW_RANK[1]),
    Rule("layers.{i}.attention.wq_b.weight", _Q_LOW_RANK[2]),
    Rule("layers.{i}.attention.wq.weight", _Q_FULL),
    Rule("layers.{i}.attention.wkv_a.weight", f"{_HF_ATTENTION}.kv_a_proj_with_mqa.weight"),
    Rule("layers.{i}.attention.kv_a_norm.weight", f"{_HF_ATTENTION}.kv_a_layernorm.weight"),
    Rule("layers.{i}.attention.wkv_b.weight", f"{_HF_ATTENTION}.kv_b_proj.weight"),
    Rule("layers.{i}.attention.wo.weight", f"{_HF_ATTENTION}.o_proj.weight"),
    *mixtral.expert_table("mlp", "gate_proj", "up_proj", "down_proj"),
    Rule("layers.{i}.feed_forward.routing.router_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    *(
        Rule(
            f"layers.{{i}}.feed_forward.shared_expert.{ours}.weight",
            f"model.layers.{{i}}.mlp.shared_experts.{hf}.weight",
        )
        for ours, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    ),
)
_MTP = "model.layers.{i}"
MTP_TABLE = (
    Rule("mtp.{k}.enorm.weight", f"{_MTP}.enorm.weight"),
    Rule("mtp.{k}.hnorm.weight", f"{_MTP}.hnorm.weight"),
    Rule("mtp.{k}.eh_proj.weight", f"{_MTP}.eh_proj.weight"),
    Rule("mtp.{k}.norm.weight", f"{_MTP}.shared_head.norm.weight"),
)
MTP_SHARED = (
    Rule("tok_embeddings.weight", f"{_MTP}.embed_tokens.weight"),
    Rule("output.weight", f"{_MTP}.shared_head.head.weight"),
)
_DENSE_MLP = {f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}


def applies(model: dict, rule: Rule, layer: int | None) -> bool:
    """The query rules of the model's q_lora_rank; in layer `layer`, the dense MLP's rules or the experts'."""
    if rule.theirs == _Q_FULL:
        return not model["mla"]["q_lora_rank"]
    if rule.theirs in _Q_LOW_RANK:
        return bool(model["mla"]["q_lora_rank"])
    if layer is None or ".feed_forward." not in rule.ours:
        return True
    dense = layer < model["moe"]["dense_layers"]
    return dense == (rule.ours.split(".", 2)[2] in _DENSE_MLP)


def config_from_hf(c: dict) -> dict:
    if c.get("rope_scaling"):
        raise HFUnsupported(
            f"rope_scaling={c['rope_scaling']}: DeepSeek-V3's YaRN context extension is not built; "
            "convert a checkpoint whose config.json has rope_scaling null (the 4K-context shape)"
        )
    if c.get("scoring_func", "sigmoid") != "sigmoid" or c.get("topk_method", "noaux_tc") != "noaux_tc":
        raise HFUnsupported(
            f"scoring_func={c.get('scoring_func')!r}, topk_method={c.get('topk_method')!r}: only "
            "DeepSeek-V3's sigmoid router with the correction bias (noaux_tc) is built"
        )
    if c.get("moe_layer_freq", 1) != 1:
        raise HFUnsupported(
            f"moe_layer_freq={c['moe_layer_freq']}: dense layers among the MoE ones are not built "
            "(only the first first_k_dense_replace layers dense)"
        )
    heads = c["num_attention_heads"]
    if (c.get("num_key_value_heads") or heads) != heads:
        raise HFUnsupported(
            f"num_key_value_heads={c['num_key_value_heads']} < num_attention_heads={heads}: "
            "multi-head latent attention has a key and value per head"
        )
    model = {key: value for key, value in llama.decoder_from_hf(c, "deepseek_v3").items() if key != "head_dim"}
    experts_ffn = c["moe_intermediate_size"]
    return model | {
        "mla": {
            "q_lora_rank": c.get("q_lora_rank"),
            "kv_lora_rank": c["kv_lora_rank"],
            "qk_nope_head_dim": c["qk_nope_head_dim"],
            "qk_rope_head_dim": c["qk_rope_head_dim"],
            "v_head_dim": c["v_head_dim"],
            "rope_interleave": bool(c.get("rope_interleave", True)),
        },
        "moe": {
            "num_experts": c["n_routed_experts"],
            "top_k": c["num_experts_per_tok"],
            "ffn_hidden_size": experts_ffn,
            "shared_expert_ffn_hidden_size": (c.get("n_shared_experts") or 0) * experts_ffn,
            "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
            "router": "sigmoid",
            "num_groups": c.get("n_group") or 1,
            "topk_groups": c.get("topk_group") or 1,
            "routed_scaling_factor": float(c.get("routed_scaling_factor", 1.0)),
            "dense_layers": c.get("first_k_dense_replace", 0),
        },
        "mtp_depth": c.get("num_nextn_predict_layers") or 0,
    }


def config_to_hf(m) -> dict:
    mla, moe = m.mla, m.moe
    experts_ffn = moe.expert_ffn(m.ffn_hidden_size)
    shared, rest = divmod(moe.shared_expert_ffn_hidden_size, experts_ffn)
    if rest:
        raise HFUnsupported(
            f"model.moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size} is not a "
            f"multiple of the experts' width {experts_ffn}: DeepSeek-V3 stores n_shared_experts"
        )
    config = {key: value for key, value in llama.decoder_to_hf(m, "DeepseekV3ForCausalLM").items() if key != "head_dim"}
    return config | {
        "attention_bias": False,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
        "rope_scaling": None,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": experts_ffn,
        "n_shared_experts": shared,
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "first_k_dense_replace": moe.dense_layers,
        "num_nextn_predict_layers": m.mtp_depth,
    }


SPEC = ArchSpec(
    name="deepseek_v3",
    summary="multi-head latent attention (model.mla), dense first layers, then a sigmoid-routed "
    "mixture of experts with a shared expert (model.moe); DeepSeek-V3",
    rms_norm=True,
    gated_mlp=True,
    bias=False,
    qkv_bias=False,
    rotary=True,
    grouped_query=False,
    free_head_dim=True,  # the widths are model.mla's (validate.py refuses model.head_dim for it)
    moe=True,
    mla=True,
    plan=PLAN,
    optional_plan=OPTIONAL_PLAN,
    hf=HFAdapter(
        "deepseek_v3", TABLE, config_from_hf, config_to_hf, applies=applies, mtp_table=MTP_TABLE, mtp_shared=MTP_SHARED
    ),
    lora_targets=("wq", "wq_b", "wkv_a", "wkv_b", "wo"),
    config_dirs=("deepseek_v3",),
)
