"""MindScale models: GPT and LLaMA, their sharding plans, recompute and checkpoint interop.

    model = build_model(cfg)                      # CausalLM: input_ids [B, S] -> logits [B, S, V] fp32
    network = build_train_network(cfg, model)     # (input_ids, labels, loss_mask) -> loss
    apply_sharding_plan(model, cfg)               # .shard() strategies, pipeline stages, comm fusion
    apply_recompute(model, cfg)                   # none / selective / full
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from mindspore import Tensor, nn
from mindspore.nn.utils import no_init_parameters

from models.hf_convert import hf_to_mindscale, is_hf_folder, model_config_differences, read_hf_folder
from models.recompute import apply_recompute
from models.sharding import apply_sharding_plan, describe_plan
from models.transformer import CausalLM, CausalLMLoss
from training.checkpoint import CheckpointError, load_weights
from training.config import Config

__all__ = ["CausalLM", "build_model", "build_train_network", "count_parameters", "apply_sharding_plan",
           "describe_plan", "apply_recompute", "check_weights", "load_weights_into", "load_pretrained", "WeightsMismatch"]


class WeightsMismatch(CheckpointError):
    """Checkpoint tensors do not match the model's names or shapes. One line; the CLIs exit 2."""


def build_model(cfg: Config) -> CausalLM:
    return CausalLM(cfg)


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
    """Raise WeightsMismatch unless `weights` has exactly the model's parameter names and shapes."""
    params = {p.name: tuple(p.shape) for p in model.get_parameters()}
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
