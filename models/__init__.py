"""MindScale models: GPT and LLaMA, their sharding plans, recompute and checkpoint interop.

    model = build_model(cfg)                      # CausalLM: input_ids [B, S] -> logits [B, S, V] fp32
    network = build_train_network(cfg, model)     # (input_ids, labels, loss_mask) -> loss
    apply_sharding_plan(model, cfg)               # .shard() strategies, pipeline stages, comm fusion
    apply_recompute(model, cfg)                   # none / selective / full
    weights, cfg = load_inference_weights(path, cfg)  # full weights of any checkpoint, LoRA merged
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from mindspore import Tensor, nn
from mindspore.nn.utils import no_init_parameters

from models.hf_convert import (HFConversionError, hf_to_mindscale, is_hf_folder, model_config_differences,
                               model_config_from_hf, read_hf_folder)
from models.lora import apply_lora, is_adapter, lora_enabled, merge, split_adapters, without_lora
from models.recompute import apply_recompute
from models.sharding import apply_sharding_plan, describe_plan
from models.transformer import CausalLM, CausalLMLoss, uses_flash_attention
from training.checkpoint import CheckpointError, load_weights
from training.config import Config, ConfigError, config_from_tree

__all__ = ["CausalLM", "uses_flash_attention", "build_model", "build_train_network", "count_parameters", "apply_sharding_plan",
           "describe_plan", "apply_recompute", "check_weights", "load_weights_into", "load_pretrained", "WeightsMismatch",
           "with_hf_dims", "resolve_model_dims", "load_inference_weights", "lora_enabled"]


class WeightsMismatch(CheckpointError):
    """Checkpoint tensors do not match the model's names or shapes. One line; the CLIs exit 2."""


def build_model(cfg: Config) -> CausalLM:
    """The model; with finetune.lora.rank > 0 its targeted Linears carry adapters and the rest is frozen."""
    model = CausalLM(cfg)
    if lora_enabled(cfg):
        apply_lora(model, cfg)
    return model


def build_train_network(cfg: Config, model: CausalLM | None = None) -> nn.Cell:
    """The loss network; parameter names stay those of the model (no `model.` prefix)."""
    return CausalLMLoss(model if model is not None else build_model(cfg))


def count_parameters(cfg: Config) -> int:
    """Parameters of the model `cfg` describes, counted on a model built without allocating weights."""
    with no_init_parameters():
        model = CausalLM(cfg)
    return sum(int(np.prod(p.shape)) for p in model.get_parameters())


def _first(items, n: int = 3) -> str:
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check_weights(model: nn.Cell, weights: dict) -> None:
    """Raise WeightsMismatch unless `weights` has exactly the model's parameter names and shapes.
    LoRA adapters may be absent (base weights for a LoRA model: the adapters keep their initial values)."""
    params = {p.name: tuple(p.shape) for p in model.get_parameters() if p.name in weights or not is_adapter(p.name)}
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


def load_weights_into(model: nn.Cell, weights: dict) -> None:
    """Copy every weight into the model after checking all names and shapes (no partial loads)."""
    check_weights(model, weights)
    for p in model.get_parameters():
        if p.name in weights:
                p.set_data(Tensor(np.asarray(weights[p.name]), dtype=p.dtype))


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
