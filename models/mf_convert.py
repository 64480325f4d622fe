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

Both files are read lazily (models/tensor_file.py): opening one reads its headers, and a fused
tensor's parts are views of its rows (RowsOf), so a sharded rank reads only its slices of them and a
.ckpt's optimizer state is never read.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import yaml

from mindscale.io import CheckpointError
from models.tensor_file import full_index, open_ckpt, open_tensors

EMBEDDING = "model.tok_embeddings.embedding_weight"
RENAMES = {
    EMBEDDING: "tok_embeddings.weight",
    "model.norm_out.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
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


def _is_model_tensor(name: str) -> bool:
    return name.startswith(("model.", "lm_head."))


def read_mindformers(path: str | Path) -> dict:
    """The model tensors (named `model.*` or `lm_head.*`) of a MindFormers .ckpt or .safetensors file, as
    lazy tensors (models/tensor_file.py): nothing read but headers."""
    path = Path(path)
    if not path.is_file():
        raise MindFormersError(f"{path} does not exist; give a MindFormers .ckpt or .safetensors file")
    if path.suffix == ".ckpt":
        tensors = open_ckpt(path, _is_model_tensor)
    else:
        tensors = {name: t for name, t in open_tensors(path).items() if _is_model_tensor(name)}
    if EMBEDDING not in tensors:
        raise MindFormersError(f"{path} has no {EMBEDDING}; it is not a MindFormers LLaMA checkpoint")
    return tensors


class RowsOf:
    """A MindScale tensor that is rows `rows` of a fused MindFormers tensor `source` (a lazy tensor or an
    array): its `shape`, and `[index]` reads only the rows and columns it selects."""

    def __init__(self, source, rows: np.ndarray):
        self.source, self.rows = source, rows
        self.shape = (len(rows), *source.shape[1:])

    def __getitem__(self, index) -> np.ndarray:
        index = full_index(index, self.shape)
        return self.source[(self.rows[index[0]], *index[1:])]


def _qkv_rows(rows: int, heads: int, kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of w_qkv that are wq, wk and wv: per kv head g, its heads/kv query heads, its key head,
    its value head, d rows each."""
    per_group = heads // kv_heads + 2
    d = rows // (kv_heads * per_group)
    blocks = np.arange(kv_heads * per_group).reshape(kv_heads, per_group)  # head-sized row blocks by group

    def rows_of(picked: np.ndarray) -> np.ndarray:
        return (picked.reshape(-1, 1) * d + np.arange(d)).reshape(-1)

    return rows_of(blocks[:, :-2]), rows_of(blocks[:, -2]), rows_of(blocks[:, -1])


def mf_views(mf_state: dict, num_heads: int, num_kv_heads: int) -> dict:
    """MindScale LLaMA weights as views of MindFormers tensors (read_mindformers), nothing read: renamed
    ones as they are, the fused ones' parts as RowsOf them; the head counts split w_qkv."""
    weights = {}
    for name, value in mf_state.items():
        ours = RENAMES.get(name) or name.removeprefix("model.")
        fused = FUSED.match(ours)
        if fused is None:
            weights[ours] = value
            continue
        layer, kind = fused.groups()
        rows = value.shape[0]
        if kind == "attention.w_qkv":
            if rows % (num_heads + 2 * num_kv_heads):
                raise MindFormersError(
                    f"{name} has {rows} rows, not a multiple of heads + 2 kv heads = "
                    f"{num_heads + 2 * num_kv_heads}; give the checkpoint's head counts"
                )
            parts = zip(("wq", "wk", "wv"), _qkv_rows(rows, num_heads, num_kv_heads))
            weights.update({f"layers.{layer}.attention.{w}.weight": RowsOf(value, part) for w, part in parts})
        else:  # gate (w1) and up (w3) rows interleaved
            weights[f"layers.{layer}.feed_forward.w1.weight"] = RowsOf(value, np.arange(0, rows, 2))
            weights[f"layers.{layer}.feed_forward.w3.weight"] = RowsOf(value, np.arange(1, rows, 2))
    return weights


def model_config_from_mf(mf_state: dict[str, np.ndarray], mf_yaml: str | Path | None) -> dict:
    """MindScale `model:` keys: widths and depth from the MindFormers tensors, head counts, RoPE base,
    norm epsilon and sequence length from a MindFormers YAML's model.model_config (when given)."""
    vocab, hidden = mf_state[EMBEDDING].shape
    layers = {int(n.split(".")[2]) for n in mf_state if n.startswith("model.layers.")}
    w1 = mf_state.get("model.layers.0.feed_forward.w1.weight")
    ffn = w1.shape[0] if w1 is not None else mf_state["model.layers.0.feed_forward.w_gate_hidden.weight"].shape[0] // 2
    model = {
        "arch": "llama",
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "num_layers": len(layers),
        "ffn_hidden_size": int(ffn),
        "tie_embeddings": "lm_head.weight" not in mf_state,
    }
    if mf_yaml is None:
        return model
    try:
        mc = yaml.safe_load(Path(mf_yaml).read_text())["model"]["model_config"]
        heads = int(mc["num_heads"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise MindFormersError(
            f"--mf-yaml {mf_yaml}: no model.model_config with num_heads ({type(exc).__name__}); "
            "pass the YAML the checkpoint was trained with"
        )
    if str(mc.get("extend_method", "None")) != "None" or mc.get("qkv_has_bias") or mc.get("attn_proj_has_bias"):
        raise MindFormersError(
            f"--mf-yaml {mf_yaml}: RoPE extension methods and attention biases are not "
            "supported; convert a plain LLaMA checkpoint"
        )
    return model | {
        "num_heads": heads,
        "num_kv_heads": int(mc.get("n_kv_heads") or heads),
        "rope_theta": float(mc.get("theta", 10000.0)),
        "norm_eps": float(mc.get("rms_norm_eps", 1e-5)),
        "seq_length": int(mc.get("seq_length", 4096)),
    }
