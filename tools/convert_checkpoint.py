"""Convert checkpoints between Hugging Face and MindScale, and from MindFormers.

    # HF folder (config.json + model.safetensors or a sharded index) -> <output>/step_00000000/
    python tools/convert_checkpoint.py --direction hf2ms --input HF_DIR --output CKPT_ROOT [--config C]
    # MindScale checkpoint (step folder or .safetensors) -> HF folder that transformers loads and generates from
    python tools/convert_checkpoint.py --direction ms2hf --input STEP_DIR --output HF_DIR [--config C]
    # MindFormers LLaMA .ckpt or .safetensors -> <output>/step_00000000/ (head counts from --mf-yaml or --config)
    python tools/convert_checkpoint.py --direction mf2ms --input MF.ckpt --mf-yaml MF.yaml --output CKPT_ROOT

Nothing is replaced without --overwrite: ms2hf refuses a non-empty --output, hf2ms and mf2ms an
existing <output>/step_00000000. With it, ms2hf replaces only the files it writes and keeps the others.
hf2ms with --config checks that the HF model matches the config's model section and stores the
resolved config; without it the checkpoint's config.yaml holds the model section from config.json.
ms2hf reads the model dims from --config (finetune.hf_dims resolved), else from the step folder's
config.yaml, which a mismatch with --config names; a LoRA run's checkpoint (adapters only) is merged into
the base weights of that config's checkpoint.load_path. Beside config.json and model.safetensors it
writes what transformers needs to generate as the run's starting model did (mindscale/train/inference.py,
export_extras): that Hugging Face folder's token ids, max_position_embeddings and generation_config.json,
and the tokenizer the run trained with (data.tokenizer).
mf2ms takes widths and depth from the tensors and the head counts, RoPE base and epsilon from --mf-yaml
(MindFormers' model.model_config), else from --config, and checks one against the other when both are given.
Supported: the Hugging Face classes of every family in models/archs/ (LLaMA, Qwen2, Qwen3, GPT-2, Mixtral,
Qwen3-MoE, DeepSeek-V3); MindFormers 1.x LlamaForCausalLM (models/mf_convert.py).
Exit 2 with one line on stderr for a bad or mismatched checkpoint. Progress (reading, converting,
writing) goes to stderr: a bar on a terminal, else plain lines every 10 s (mindscale/progress.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from mindspore.nn.utils import no_init_parameters

from models import WeightsMismatch, build_model, check_weights, count_parameters
from models.hf_convert import (
    check_export_folder,
    hf_to_mindscale,
    mindscale_to_hf,
    model_config_differences,
    model_config_from_hf,
    read_hf_folder,
    write_hf_folder,
)
from models.mf_convert import MindFormersError, mf_views, model_config_from_mf, read_mindformers
from mindscale.train.checkpoints.folder import save_checkpoint, step_dir_name
from mindscale.train.inference import export_extras, inference_config, inference_weights
from mindscale.config import Config, UserError, config_from_tree, load_config
from mindscale.io import CheckpointError
from mindscale.cli import OneLineParser, add_config_arguments, emit, fail
from mindscale.progress import Progress


def _config_for_model(args, found: dict) -> Config:
    """The resolved config for a converted model's keys: --config (checked against them) or built from them."""
    if not args.config:
        return config_from_tree({"model": found})
    cfg = load_config(args.config, args.overrides)
    differ = model_config_differences(found, cfg.model)
    if differ:
        raise WeightsMismatch(
            f"{args.input} does not match {args.config}: {', '.join(differ[:4])}; fix the config or drop --config"
        )
    return cfg


def _check_against_model(cfg: Config, weights: dict) -> None:
    """Names and shapes against a model built from cfg without allocating its weights."""
    with no_init_parameters():
        check_weights(build_model(cfg), weights)


def _check_checkpoint_output(args) -> None:
    """Refuse to replace the step folder hf2ms and mf2ms write unless --overwrite: before anything is read."""
    step = Path(args.output) / step_dir_name(0)
    if step.exists() and not args.overwrite:
        raise CheckpointError(f"{step} exists; pass --overwrite to replace it, or choose another --output")


def _write_checkpoint(args, progress: Progress, weights: dict, cfg: Config):
    with progress.single(f"writing {args.output}", "folder"):
        return save_checkpoint(args.output, 0, weights, config=cfg.to_yaml())


def hf2ms(args, progress: Progress) -> dict:
    _check_checkpoint_output(args)
    stored, hf_config = read_hf_folder(args.input, lazy=True)  # read below, tensor by tensor
    hf_state = {
        name: tensor[...]
        for name, tensor in progress.track(stored.items(), f"reading {args.input}", len(stored), "tensor")
    }
    with progress.single("converting", "model"):
        cfg = _config_for_model(args, model_config_from_hf(hf_config))
        _, weights = hf_to_mindscale(hf_state, hf_config, cfg.model.mtp_depth)
        _check_against_model(cfg, weights)
    folder = _write_checkpoint(args, progress, weights, cfg)
    return {"output": str(folder), "arch": cfg.model.arch, "tensors": len(weights), "parameters": count_parameters(cfg)}


def mf2ms(args, progress: Progress) -> dict:
    _check_checkpoint_output(args)
    mf_state = read_mindformers(args.input)  # headers only: read below, tensor by tensor
    found = model_config_from_mf(mf_state, args.mf_yaml)
    if "num_heads" not in found and not args.config:
        raise MindFormersError(
            "mf2ms needs the head counts: pass --mf-yaml (the MindFormers YAML the checkpoint "
            "was trained with) or --config"
        )
    cfg = _config_for_model(args, found)
    views = mf_views(mf_state, cfg.model.num_heads, cfg.model.kv_heads)
    weights = {
        name: view[...] for name, view in progress.track(views.items(), f"reading {args.input}", len(views), "tensor")
    }
    with progress.single("converting", "model"):
        _check_against_model(cfg, weights)
    folder = _write_checkpoint(args, progress, weights, cfg)
    return {"output": str(folder), "arch": cfg.model.arch, "tensors": len(weights), "parameters": count_parameters(cfg)}


def ms2hf(args, progress: Progress) -> dict:
    check_export_folder(args.output, args.overwrite)  # before anything is read
    cfg = inference_config(args.input, args.config, args.overrides)
    with progress.single(f"reading {args.input}", "checkpoint"):
        # a LoRA run's checkpoint holds adapters only: merged into its config's checkpoint.load_path base
        weights, cfg = inference_weights(args.input, cfg, args.config)
    with progress.single("converting", "model"):
        hf_state, hf_config = mindscale_to_hf(weights, cfg.model)
        extras = export_extras(cfg)
    with progress.single(f"writing {args.output}", "folder"):
        folder = write_hf_folder(args.output, hf_state, hf_config | extras.config, extras.files, args.overwrite)
    return {
        "output": str(folder),
        "arch": cfg.model.arch,
        "tensors": len(hf_state),
        "parameters": count_parameters(cfg),
        "tokenizer": extras.tokenizer,
        "generation_config": extras.generation_config,
    }


def _described(result: dict) -> str:
    """The tool's line: what it wrote, and for an export where its tokenizer and generation config came from."""
    line = (
        f"wrote {result['output']} ({result['arch']}, {result['tensors']} tensors, {result['parameters']:,} parameters"
    )
    if "tokenizer" in result:
        line += (
            f"; tokenizer from {result['tokenizer']}"
            if result["tokenizer"]
            else "; no tokenizer (data.tokenizer unset)"
        )
    if result.get("generation_config"):
        line += f"; generation_config.json from {result['generation_config']}"
    return line + ")"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--direction", required=True, choices=["hf2ms", "ms2hf", "mf2ms"])
    parser.add_argument(
        "--input",
        required=True,
        help="HF model folder (hf2ms), MindScale checkpoint (ms2hf) or MindFormers .ckpt/.safetensors file (mf2ms)",
    )
    parser.add_argument("--mf-yaml", help="mf2ms: the MindFormers YAML (model.model_config: head counts, theta)")
    parser.add_argument("--output", required=True, help="checkpoint root (hf2ms) or HF folder to write (ms2hf)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --output: replace the files this conversion writes, keep the rest",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object with the result")
    add_config_arguments(parser, required=False)
    args = parser.parse_args(argv)
    try:
        with Progress(args.direction) as progress:
            result = {"hf2ms": hf2ms, "ms2hf": ms2hf, "mf2ms": mf2ms}[args.direction](args, progress)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    except OSError as exc:  # e.g. --output names a folder that cannot be written
        fail(f"cannot write {args.output}: {exc.strerror or exc}")
    emit(result, args.json, _described(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
