"""Qwen2 (Qwen Team 2024; Qwen2 and Qwen2.5): LLaMA with biases on the q/k/v projections only; tied
embeddings in the small sizes. Hugging Face `Qwen2ForCausalLM`: LLaMA's table plus those biases."""

from __future__ import annotations

from models.archs import llama
from models.spec import ArchSpec, HFAdapter, Rule

TABLE = (
    *llama.TABLE,
    *(
        Rule(f"layers.{{i}}.attention.{w}.bias", f"model.layers.{{i}}.self_attn.{hf}_proj.bias")
        for w, hf in (("wq", "q"), ("wk", "k"), ("wv", "v"))
    ),
)


def config_from_hf(c: dict) -> dict:
    return llama.decoder_from_hf(c, "qwen2")


def config_to_hf(m) -> dict:
    return llama.decoder_to_hf(m, "Qwen2ForCausalLM") | {"use_sliding_window": False, "max_window_layers": m.num_layers}


SPEC = ArchSpec(
    name="qwen2",
    summary="LLaMA with biases on the q/k/v projections; Qwen2 and Qwen2.5",
    rms_norm=True,
    gated_mlp=True,
    bias=False,
    qkv_bias=True,
    rotary=True,
    plan=llama.PLAN,  # the q/k/v biases split with q/k/v
    hf=HFAdapter("qwen2", TABLE, config_from_hf, config_to_hf),
    lora_targets=llama.LORA_TARGETS,
    config_dirs=("qwen2",),
)
