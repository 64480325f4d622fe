"""MindScale models: GPT and LLaMA, their sharding plans, recompute and checkpoint interop.

    model = build_model(cfg, layout)              # CausalLM: input_ids [B, S] -> logits [B, S, V] fp32
    network = build_train_network(cfg, model, layout)  # (input_ids, labels, loss_mask) -> loss
    apply_sharding_plan(model, cfg, layout)       # .shard() strategies, pipeline stages, comm fusion
    apply_recompute(model, cfg, layout)           # none / selective / full
    weights, cfg = load_inference_weights(path, cfg)  # full weights of any checkpoint, LoRA merged

`layout` (training.layout.Layout) carries every parallel decision; without one, models are built
stand-alone for the device MindSpore is set to (inference, conversion, tests).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.nn.utils import no_init_parameters

from models.hf_convert import (HFConversionError, hf_to_mindscale, is_hf_folder, model_config_differences,
                               model_config_from_hf, read_hf_folder)
from models.lora import apply_lora, is_adapter, lora_enabled, merge, split_adapters, without_lora
from models.recompute import apply_recompute
from models.sharding import apply_sharding_plan, describe_plan
from models.transformer import CausalLM, CausalLMLoss, ReusedCausalLMLoss
from training.checkpoint import CheckpointError, assign, load_weights
from training.config import Config, ConfigError, config_from_tree
from training.layout import Layout

__all__ = ["CausalLM", "build_model", "standalone_layout", "build_train_network", "count_parameters", "apply_sharding_plan",
           "describe_plan", "apply_recompute", "check_weights", "load_weights_into", "load_pretrained", "WeightsMismatch",
           "with_hf_dims", "resolve_model_dims", "load_inference_weights", "lora_enabled"]


class WeightsMismatch(CheckpointError):
    """Checkpoint tensors do not match the model's names or shapes. One line; the CLIs exit 2."""


def standalone_layout(cfg: Config) -> Layout:
    """One process on the device MindSpore is set to: no strategies, the kernels that device has."""
    return Layout.of(cfg, ms.get_context("device_target"), world=1)


def build_model(cfg: Config, layout: Layout | None = None) -> CausalLM:
    """The model; with finetune.lora.rank > 0 its targeted Linears carry adapters and the rest is frozen."""
    model = CausalLM(cfg, layout or standalone_layout(cfg))
    if lora_enabled(cfg):
        apply_lora(model, cfg)
    return model


def build_train_network(cfg: Config, model: CausalLM | None = None, layout: Layout | None = None) -> nn.Cell:
    """The loss network; parameter names stay those of the model (no `model.` prefix)."""
    layout = layout or standalone_layout(cfg)
    model = model if model is not None else build_model(cfg, layout)
    return (ReusedCausalLMLoss if layout.graph_reuse == "model" else CausalLMLoss)(model)


def count_parameters(cfg: Config) -> int:
    """Parameters of the model `cfg` describes, counted on a model built without allocating weights."""
    with no_init_parameters():
        model = CausalLM(cfg, Layout.of(cfg, "CPU", world=1))
    return sum(int(np.prod(p.shape)) for p in model.get_parameters())


def _first(items, n: int = 3) -> str:
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check_weights(model: nn.Cell, weights: dict, layouts: dict | None = None) -> None:
    """Raise WeightsMismatch unless `weights` has exactly the model's parameter names and full shapes
    (a compiled sharded model's parameters are slices: `layouts`, its parameter_layout_dict, holds the
    full shapes). LoRA adapters may be absent (base weights for a LoRA model: the adapters keep their
    initial values)."""
    layouts = layouts or {}
    params = {p.name: tuple(layouts[p.name][6]) if p.name in layouts else tuple(p.shape)
              for p in model.get_parameters() if p.name in weights or not is_adapter(p.name)}
    problems = []
    missing = [n for n in params if n not in weights]
    unexpected = [n for n in weights if n not in params]
    wrong = [f"{n} {tuple(np.shape(weights[n]))} vs model {shape}"
             for n, shape in params.items() if n in weights and tuple(np.shape(weights[n])) != shape]
    if missing:
        problems.append(f"missing {len(missing)}: {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_first(unexpected)}")
    if wrong:
        problems.append(f"wrong shape {len(wrong)}: {_first(wrong)}")
    if problems:
        raise WeightsMismatch("checkpoint does not match the model config (" + "; ".join(problems) +
                              "); use the config the checkpoint was trained with")


def load_weights_into(model: nn.Cell, weights: dict, layouts: dict | None = None, rank: int = 0) -> None:
    """Copy full weights into the model after checking all names and shapes (no partial loads). A
    compiled sharded model takes `rank`'s slice of each, cut by its compiled layout (`layouts`)."""
    check_weights(model, weights, layouts)
    assign([p for p in model.get_parameters() if p.name in weights], weights, "weights", layouts, rank)


def load_pretrained(path: str | Path, cfg: Config) -> dict[str, np.ndarray]:
    """MindScale-named weights from a MindScale checkpoint (folder or .safetensors) or a Hugging Face
    model folder (config.json + safetensors). Raises CheckpointError / WeightsMismatch (one line)."""
    if not is_hf_folder(path):
        return load_weights(path)
    hf_model, weights = hf_to_mindscale(*read_hf_folder(path))
    differ = model_config_differences(hf_model, cfg.model)
    if differ:
        raise WeightsMismatch(f"{path}: the Hugging Face model differs from the config: {_first(differ)}; "
                              "set those model keys or use a matching checkpoint")
    return weights


def with_hf_dims(cfg: Config, hf_folder: str | Path) -> Config:
    """`cfg` with its model dims taken from a Hugging Face folder's config.json. LLaMA keeps the config's
    seq_length (max_position_embeddings is a limit, not the training length); dtypes stay the config's."""
    if not is_hf_folder(hf_folder):
        raise HFConversionError(f"{hf_folder} is not a Hugging Face folder (no config.json); "
                                "finetune.hf_dims and generate's HF mode need one")
    try:
        hf_model = model_config_from_hf(json.loads((Path(hf_folder) / "config.json").read_text()))
    except json.JSONDecodeError as exc:
        raise HFConversionError(f"{Path(hf_folder) / 'config.json'} is not valid JSON ({exc.msg})")
    if hf_model["arch"] == "llama":
        hf_model.pop("seq_length")
    tree = cfg.to_dict()
    tree["model"].update(hf_model)
    try:
        return config_from_tree(tree)
    except ConfigError as exc:
        raise ConfigError(f"with the dims of {hf_folder}: {exc}")


def resolve_model_dims(cfg: Config) -> Config:
    """finetune.hf_dims: the model section comes from checkpoint.load_path's config.json."""
    return with_hf_dims(cfg, cfg.checkpoint.load_path) if cfg.finetune.hf_dims else cfg


def load_inference_weights(path: str | Path, cfg: Config) -> tuple[dict[str, np.ndarray], Config]:
    """(full weights, config of the plain model) for any checkpoint the trainer can load or write.

    A Hugging Face folder brings its own dims; a LoRA run's checkpoint holds only adapters, which are
    merged into the base weights from the config's checkpoint.load_path."""
    if is_hf_folder(path):
        cfg = with_hf_dims(cfg, path)
    base, adapters = split_adapters(load_pretrained(path, cfg))
    if adapters:
        if not cfg.checkpoint.load_path:
            raise WeightsMismatch(f"{path} holds LoRA adapters only and the config has no checkpoint.load_path "
                                  "for the base weights; pass the config the LoRA run used")
        base = load_pretrained(cfg.checkpoint.load_path, cfg)
        base = merge(base, adapters, cfg.finetune.lora)
    return base, without_lora(cfg)
