"""Hugging Face <-> MindScale weights: one name/shape table per architecture.

LLaMA  <-> transformers `LlamaForCausalLM`: same [out, in] matrices, renamed. HF's q/k weights are
           already in the rotate-half layout our RotaryEmbedding uses, so nothing is permuted.
Qwen2  <-> transformers `Qwen2ForCausalLM`: LLaMA's table plus the q/k/v biases.
GPT    <-> transformers `GPT2LMHeadModel`: GPT-2's Conv1D stores weights [in, out] (transposed), and
           c_attn is the fused [q; k; v] projection, split here into wq/wk/wv (and joined back).

Every conversion is a pure re-arrangement (rename, transpose, split, concatenate) so a round trip
reproduces the original tensors bit for bit.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from mindscale.io import CheckpointError, publish_folder
from models.tensor_file import full_index, open_tensors


class HFConversionError(CheckpointError):
    """The Hugging Face checkpoint cannot be converted. One line; the CLIs exit 2."""


@dataclass(frozen=True)
class Rule:
    """MindScale tensor `ours` is (part `part[0]` of `part[1]` equal row blocks of) HF tensor `theirs`,
    transposed first when HF stores it [in, out]."""
    ours: str
    theirs: str
    transpose: bool = False
    part: tuple[int, int] | None = None


LLAMA_TABLE = [
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
]

QWEN2_TABLE = [*LLAMA_TABLE, *[Rule(f"layers.{{i}}.attention.{w}.bias", f"model.layers.{{i}}.self_attn.{hf}_proj.bias")
                              for w, hf in (("wq", "q"), ("wk", "k"), ("wv", "v"))]]

GPT_TABLE = [
    Rule("tok_embeddings.weight", "transformer.wte.weight"),
    Rule("pos_embeddings.weight", "transformer.wpe.weight"),
    Rule("layers.{i}.attention_norm.weight", "transformer.h.{i}.ln_1.weight"),
    Rule("layers.{i}.attention_norm.bias", "transformer.h.{i}.ln_1.bias"),
    *[Rule(f"layers.{{i}}.attention.{w}.weight", "transformer.h.{i}.attn.c_attn.weight", True, (n, 3))
      for n, w in enumerate(("wq", "wk", "wv"))],
    *[Rule(f"layers.{{i}}.attention.{w}.bias", "transformer.h.{i}.attn.c_attn.bias", False, (n, 3))
      for n, w in enumerate(("wq", "wk", "wv"))],
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
]

TABLES = {"llama": LLAMA_TABLE, "qwen2": QWEN2_TABLE, "gpt": GPT_TABLE}

# HF tensors that are buffers, not weights (older checkpoints store them).
IGNORED_HF = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


# ---------------------------------------------------------------------------------------------
# Configs


def _rope_scaling_from_hf(c: dict) -> dict:
    """Our rope_* keys from config.json's rope_scaling: none, or LLaMA-3.1's rope_type llama3."""
    scaling = c.get("rope_scaling")
    if not scaling:
        return {"rope_scaling": "none"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3" or c.get("model_type") != "llama":
        raise HFConversionError(f"rope_scaling={scaling} is not supported (LLaMA's rope_type llama3 only); "
                                "use a checkpoint without that RoPE scaling")
    return {"rope_scaling": "llama3", "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_positions": int(scaling["original_max_position_embeddings"])}


def _model_from_llama(c: dict, arch: str = "llama") -> dict:
    """LLaMA and Qwen2 (which adds fixed q/k/v biases and may use a sliding window, not supported)."""
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise HFConversionError("LLaMA checkpoints with attention_bias/mlp_bias are not supported")
    if c.get("use_sliding_window"):
        raise HFConversionError("use_sliding_window=true is not supported (full causal attention only); "
                                "use a checkpoint without a sliding window")
    if c.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act={c['hidden_act']!r} is not supported (SwiGLU with silu only)")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise HFConversionError(f"head_dim={c['head_dim']} != hidden_size/num_attention_heads; not supported")
    return {"arch": arch, "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
            "num_layers": c["num_hidden_layers"], "num_heads": heads,
            "num_kv_heads": c.get("num_key_value_heads") or heads,
            "ffn_hidden_size": c["intermediate_size"], "seq_length": c.get("max_position_embeddings", 4096),
            "rope_theta": float(c.get("rope_theta", 10000.0)), "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)), **_rope_scaling_from_hf(c)}


def _model_from_gpt2(c: dict) -> dict:
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFConversionError(f"activation_function={act!r}: MindScale's GPT uses the tanh GELU "
                                "(gelu_new); convert a checkpoint trained with it")
    if c.get("scale_attn_by_inverse_layer_idx") or c.get("scale_attn_weights") is False:
        raise HFConversionError("GPT-2 attention-scaling variants are not supported (need 1/sqrt(d) scaling)")
    hidden = c["n_embd"]
    return {"arch": "gpt", "vocab_size": c["vocab_size"], "hidden_size": hidden, "num_layers": c["n_layer"],
            "num_heads": c["n_head"], "num_kv_heads": c["n_head"], "ffn_hidden_size": c.get("n_inner") or 4 * hidden,
            "seq_length": c["n_positions"], "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
            "tie_embeddings": bool(c.get("tie_word_embeddings", True))}


def model_config_from_hf(hf_config: dict) -> dict:
    """MindScale `model:` keys from a Hugging Face config.json."""
    kind = hf_config.get("model_type")
    try:
        if kind == "llama":
            return _model_from_llama(hf_config)
        if kind == "qwen2":
            return _model_from_llama(hf_config, "qwen2")
        if kind == "gpt2":
            return _model_from_gpt2(hf_config)
    except KeyError as exc:
        raise HFConversionError(f"config.json lacks {exc.args[0]!r}; it is not a complete {kind} config")
    raise HFConversionError(f"model_type={kind!r} is not supported; convert a llama, qwen2 or gpt2 checkpoint")


def model_config_differences(hf_model: dict, m) -> list[str]:
    """Keys where the HF model (model_config_from_hf) and ModelConfig `m` disagree, as `key=theirs (ours)`.
    LLaMA's and Qwen2's max_position_embeddings is a limit, not the training length, so seq_length is not
    compared."""
    ours = {key: getattr(m, key) for key in hf_model}
    ours["num_kv_heads"] = m.kv_heads
    skip = {"seq_length"} if hf_model["arch"] != "gpt" else set()
    return [f"model.{key}={hf_model[key]!r} (config has {ours[key]!r})"
            for key in hf_model if key not in skip and hf_model[key] != ours[key]]


def hf_config_from_model(m) -> dict:
    """A transformers config.json for MindScale model config `m` (mindscale.config.ModelConfig)."""
    if m.arch == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
                "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_heads,
                "n_inner": m.ffn_hidden_size, "n_positions": m.seq_length, "n_ctx": m.seq_length,
                "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new",
                "tie_word_embeddings": m.tie_embeddings, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "torch_dtype": "float32"}
    config = {"architectures": ["LlamaForCausalLM" if m.arch == "llama" else "Qwen2ForCausalLM"],
              "model_type": m.arch, "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
              "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
              "num_key_value_heads": m.kv_heads, "intermediate_size": m.ffn_hidden_size,
              "max_position_embeddings": m.seq_length, "rope_theta": m.rope_theta, "rms_norm_eps": m.norm_eps,
              "hidden_act": "silu", "tie_word_embeddings": m.tie_embeddings, "torch_dtype": "float32"}
    if m.arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    else:
        config |= {"use_sliding_window": False, "max_window_layers": m.num_layers}
    if m.rope_scaling_params:
        factor, low, high, original = m.rope_scaling_params
        config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                  "high_freq_factor": high, "original_max_position_embeddings": original}
    return config


# ---------------------------------------------------------------------------------------------
# Weights


def _expand(table: list[Rule], num_layers: int, tied: bool) -> list[Rule]:
    rules = []
    for rule in table:
        if tied and rule.ours == "output.weight":
            continue
        layers = range(num_layers) if "{i}" in rule.ours else [None]
        rules += [Rule(rule.ours.format(i=i), rule.theirs.format(i=i), rule.transpose, rule.part) for i in layers]
    return rules


def _strip_prefix(hf_state: dict, arch: str) -> dict:
    """GPT-2 checkpoints exist with and without the `transformer.` prefix; use the prefixed names."""
    if arch != "gpt" or any(k.startswith("transformer.") for k in hf_state):
        return hf_state
    return {(k if k.startswith("lm_head.") else f"transformer.{k}"): v for k, v in hf_state.items()}


class RuleView:
    """MindScale tensor `rule.ours` as a view of HF tensor `theirs` (an array or a lazy StoredTensor):
    its `shape`, and `[index]` reads that part alone, the index mapped through the row split and the
    transpose. A sharded rank reads its slice of a fused or transposed HF tensor without the rest."""

    def __init__(self, rule: Rule, theirs):
        self.rule, self.theirs = rule, theirs
        shape = tuple(theirs.shape)[::-1] if rule.transpose else tuple(theirs.shape)
        self.shape = (shape[0] // rule.part[1], *shape[1:]) if rule.part else shape

    def __getitem__(self, index) -> np.ndarray:
        index = list(full_index(index, self.shape))
        if self.rule.part:  # row block part[0] of the (transposed) HF tensor
            offset = self.rule.part[0] * self.shape[0]
            index[0] = slice(index[0].start + offset, index[0].stop + offset)
        if self.rule.transpose:
            return np.ascontiguousarray(np.asarray(self.theirs[tuple(index[::-1])]).T)
        return np.ascontiguousarray(self.theirs[tuple(index)])


def hf_views(hf_state: dict, hf_config: dict) -> tuple[dict, dict[str, RuleView]]:
    """(MindScale model-config dict, MindScale weights as RuleViews: nothing read yet) from HF tensors
    (arrays or StoredTensors) and config.json contents."""
    model = model_config_from_hf(hf_config)
    arch = model["arch"]
    state = {k: v for k, v in _strip_prefix(hf_state, arch).items() if not IGNORED_HF.search(k)}
    rules = _expand(TABLES[arch], model["num_layers"], model["tie_embeddings"])
    needed = {r.theirs for r in rules}
    missing = sorted(needed - set(state))
    unused = sorted(set(state) - needed - ({"lm_head.weight"} if model["tie_embeddings"] else set()))
    if missing or unused:
        parts = ([f"missing {len(missing)}: {', '.join(missing[:3])}"] if missing else []) + \
                ([f"unexpected {len(unused)}: {', '.join(unused[:3])}"] if unused else [])
        raise HFConversionError(f"Hugging Face tensors do not match config.json ({'; '.join(parts)})")
    return model, {r.ours: RuleView(r, state[r.theirs]) for r in rules}


def hf_to_mindscale(hf_state: dict, hf_config: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """(MindScale model-config dict, MindScale weights) from HF tensors and config.json contents."""
    model, views = hf_views(hf_state, hf_config)
    return model, {name: view[...] for name, view in views.items()}


def mindscale_to_hf(weights: dict[str, np.ndarray], m) -> tuple[dict[str, np.ndarray], dict]:
    """(HF tensors, config.json contents) from MindScale weights and model config `m`."""
    rules = _expand(TABLES[m.arch], m.num_layers, m.tie_embeddings)
    missing = [r.ours for r in rules if r.ours not in weights]
    if missing:
        raise HFConversionError(f"MindScale weights lack {len(missing)} tensors (first: {', '.join(missing[:3])}); "
                                "the checkpoint does not match the config")
    grouped: dict[str, list[Rule]] = {}
    for r in rules:
        grouped.setdefault(r.theirs, []).append(r)
    state = {}
    for theirs, group in grouped.items():
        group = sorted(group, key=lambda r: r.part[0] if r.part else 0)
        value = np.concatenate([weights[r.ours] for r in group], axis=0) if len(group) > 1 else weights[group[0].ours]
        state[theirs] = np.ascontiguousarray(value.T if group[0].transpose else value)
    return state, hf_config_from_model(m)


# ---------------------------------------------------------------------------------------------
# Files


def is_hf_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_folder(path: str | Path, lazy: bool = False) -> tuple[dict, dict]:
    """(tensors, config) of a Hugging Face model folder: config.json + model.safetensors, or the
    shards listed in model.safetensors.index.json. BF16 widens to fp32. `lazy`: the tensors are
    StoredTensors (models/tensor_file.py), read only where indexed."""
    path = Path(path)
    if not is_hf_folder(path):
        raise HFConversionError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise HFConversionError(f"{path / 'config.json'} is not valid JSON ({exc.msg})")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFConversionError(f"{path} has no model.safetensors or model.safetensors.index.json "
                                "(PyTorch .bin checkpoints are not read; re-save with safetensors)")
    tensors = {}
    for name in files:
        if not (path / name).is_file():
            raise HFConversionError(f"{path / name} listed in the index is missing")
        tensors.update(open_tensors(path / name))
    return (tensors if lazy else {name: t[...] for name, t in tensors.items()}), config


def write_hf_folder(path: str | Path, hf_state: dict[str, np.ndarray], hf_config: dict) -> Path:
    """config.json + model.safetensors that transformers' from_pretrained loads, written in a sibling
    folder and swapped in whole (no half-written folder, no stale shards of an earlier export)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in hf_state.items()}, str(partial / "model.safetensors"),
                  metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        publish_folder(partial, path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return path
