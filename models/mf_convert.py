"""MindFormers 1.x LLaMA checkpoints -> MindScale weights.

MindFormers' `LlamaForCausalLM` (1.9) names its tensors as ours under a `model.` prefix, except:

    model.tok_embeddings.embedding_weight   -> tok_embeddings.weight
    model.norm_out.weight                   -> norm.weight
    lm_head.weight                          -> output.weight

With `qkv_concat: True` it stores two fused matrices, laid out as its forward splits them:
    attention.w_qkv.weight          [(heads + 2 kv) d, h]: per kv head g, its heads/kv query heads,
                                    then its key head, then its value head (rows of d each)
    feed_forward.w_gate_hidden      [2 ffn, h]: gate (w1) and up (w3) rows interleaved
Its rotary embedding is the rotate-half form of Hugging Face and ours, so nothing is permuted (the
test checks logits against MindFormers' own forward). A .ckpt also holds optimizer state and
counters (adam_m., global_step, ...): only the model's tensors are read.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import yaml

from mindscale.io import CheckpointError
from models.tensor_file import open_tensors

EMBEDDING = "model.tok_embeddings.embedding_weight"
RENAMES = {EMBEDDING: "tok_embeddings.weight", "model.norm_out.weight": "norm.weight", "lm_head.weight": "output.weight"}
FUSED = re.compile(r"^layers\.(\d+)\.(attention\.w_qkv|feed_forward\.w_gate_hidden)\.weight$")


class MindFormersError(CheckpointError):
    """The MindFormers checkpoint or its YAML cannot be converted. One line; the CLIs exit 2."""


def is_mindformers_checkpoint(path: str | Path) -> bool:
    """A MindSpore .ckpt file, or a .safetensors file with MindFormers' embedding name."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix == ".ckpt":
        return True
    return path.suffix == ".safetensors" and EMBEDDING in open_tensors(path)


def read_mindformers(path: str | Path) -> dict[str, np.ndarray]:
    """The model tensors (named `model.*` or `lm_head.*`) of a MindFormers .ckpt or .safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise MindFormersError(f"{path} does not exist; give a MindFormers .ckpt or .safetensors file")
    if path.suffix == ".ckpt":
        import mindspore as ms
        try:
            params = ms.load_checkpoint(str(path))
        except (ValueError, RuntimeError, OSError) as exc:
            raise MindFormersError(f"{path} cannot be read as a MindSpore checkpoint "
                                   f"({str(exc).splitlines()[0][:160]}); it is truncated or not a .ckpt")
        tensors = {name: (p.astype(ms.float32) if p.dtype == ms.bfloat16 else p).asnumpy()
                   for name, p in params.items() if name.startswith(("model.", "lm_head."))}
    else:
        tensors = {name: t[...] for name, t in open_tensors(path).items() if name.startswith(("model.", "lm_head."))}
    if EMBEDDING not in tensors:
        raise MindFormersError(f"{path} has no {EMBEDDING}; it is not a MindFormers LLaMA checkpoint")
    return tensors


def _split_qkv(w_qkv: np.ndarray, heads: int, kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    per_group = heads // kv_heads + 2
    d = w_qkv.shape[0] // (kv_heads * per_group)
    groups = w_qkv.reshape(kv_heads, per_group, d, -1)
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return (np.ascontiguousarray(q.reshape(heads * d, -1)), np.ascontiguousarray(k.reshape(kv_heads * d, -1)),
            np.ascontiguousarray(v.reshape(kv_heads * d, -1)))


def mf_to_mindscale(mf_state: dict[str, np.ndarray], num_heads: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    """MindScale LLaMA weights from MindFormers tensors (read_mindformers); the head counts split w_qkv."""
    weights = {}
    for name, value in mf_state.items():
        ours = RENAMES.get(name) or name.removeprefix("model.")
        fused = FUSED.match(ours)
        if fused is None:
            weights[ours] = value
            continue
        layer, kind = fused.groups()
        if kind == "attention.w_qkv":
            if value.shape[0] % (num_heads + 2 * num_kv_heads):
                raise MindFormersError(f"{name} has {value.shape[0]} rows, not a multiple of heads + 2 kv heads = "
                                       f"{num_heads + 2 * num_kv_heads}; give the checkpoint's head counts")
            parts = zip(("wq", "wk", "wv"), _split_qkv(value, num_heads, num_kv_heads))
            weights.update({f"layers.{layer}.attention.{w}.weight": part for w, part in parts})
        else:
            weights[f"layers.{layer}.feed_forward.w1.weight"] = np.ascontiguousarray(value[0::2])
            weights[f"layers.{layer}.feed_forward.w3.weight"] = np.ascontiguousarray(value[1::2])
    return weights


def model_config_from_mf(mf_state: dict[str, np.ndarray], mf_yaml: str | Path | None) -> dict:
    """MindScale `model:` keys: widths and depth from the MindFormers tensors, head counts, RoPE base,
    norm epsilon and sequence length from a MindFormers YAML's model.model_config (when given)."""
    vocab, hidden = mf_state[EMBEDDING].shape
    layers = {int(n.split(".")[2]) for n in mf_state if n.startswith("model.layers.")}
    w1 = mf_state.get("model.layers.0.feed_forward.w1.weight")
    ffn = w1.shape[0] if w1 is not None else mf_state["model.layers.0.feed_forward.w_gate_hidden.weight"].shape[0] // 2
    model = {"arch": "llama", "vocab_size": int(vocab), "hidden_size": int(hidden), "num_layers": len(layers),
             "ffn_hidden_size": int(ffn), "tie_embeddings": "lm_head.weight" not in mf_state}
    if mf_yaml is None:
        return model
    try:
        mc = yaml.safe_load(Path(mf_yaml).read_text())["model"]["model_config"]
        heads = int(mc["num_heads"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise MindFormersError(f"--mf-yaml {mf_yaml}: no model.model_config with num_heads ({type(exc).__name__}); "
                               "pass the YAML the checkpoint was trained with")
    if str(mc.get("extend_method", "None")) != "None" or mc.get("qkv_has_bias") or mc.get("attn_proj_has_bias"):
        raise MindFormersError(f"--mf-yaml {mf_yaml}: RoPE extension methods and attention biases are not "
                               "supported; convert a plain LLaMA checkpoint")
    return model | {"num_heads": heads, "num_kv_heads": int(mc.get("n_kv_heads") or heads),
                    "rope_theta": float(mc.get("theta", 10000.0)), "norm_eps": float(mc.get("rms_norm_eps", 1e-5)),
                    "seq_length": int(mc.get("seq_length", 4096))}
