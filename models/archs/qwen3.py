"""Qwen3 dense (Qwen Team 2025, "Qwen3 Technical Report"): Qwen2.5's decoder without the q/k/v biases,
with an RMSNorm over each query and key head before the rotary embedding ("qk-norm"), and a head width
that may differ from hidden/heads (32B: 64 heads of 128 on a width of 5120). Hugging Face
`Qwen3ForCausalLM`: LLaMA's table plus the two head norms.
"""

from __future__ import annotations

from models.archs import llama
from models.spec import COLWISE, ArchSpec, HFAdapter, Rule

PLAN = {**llama.PLAN, "layers.*.attention.q_norm": COLWISE, "layers.*.attention.k_norm": COLWISE}

TABLE = (
    *llama.TABLE,
    *(
        Rule(f"layers.{{i}}.attention.{n}.weight", f"model.layers.{{i}}.self_attn.{n}.weight")
        for n in ("q_norm", "k_norm")
    ),
)


def config_from_hf(c: dict) -> dict:
    return llama.decoder_from_hf(c, "qwen3")


def config_to_hf(m) -> dict:
    return llama.decoder_to_hf(m, "Qwen3ForCausalLM") | {
        "attention_bias": False,
        "use_sliding_window": False,
        "max_window_layers": m.num_layers,
    }


SPEC = ArchSpec(
    name="qwen3",
    summary="Qwen2.5 without q/k/v biases, with RMSNorm on each q and k head; Qwen3 dense",
    rms_norm=True,
    gated_mlp=True,
    bias=False,
    qkv_bias=False,
    rotary=True,
    qk_norm=True,
    plan=PLAN,
    hf=HFAdapter("qwen3", TABLE, config_from_hf, config_to_hf),
    lora_targets=llama.LORA_TARGETS,
    config_dirs=("qwen3",),
)
