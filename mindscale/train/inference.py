"""Text generation from any checkpoint the trainer can load, with KV-cache incremental decoding
(tools/generate.py runs it; the decoder and the sampler are models/generation.py), and what a Hugging
Face export needs beside the weights to generate as the run's starting model did
(tools/convert_checkpoint.py --direction ms2hf).

The checkpoint is a MindScale step folder (a LoRA run's adapters are merged into the config's
checkpoint.load_path), a .safetensors file, or a Hugging Face folder (config.json + safetensors;
the model dims then come from its config.json and its tokenizer.model, else its tokenizer.json,
is used when data.tokenizer is unset). Its config is --config when given (finetune.hf_dims resolved,
as the trainer resolves it), else the config.yaml a step folder keeps: the resolved config it was
trained with. A text prompt is wrapped in finetune.template when set (the SFT format the model was
trained on), else encoded after BOS. Generation stops after an EOS id (the tokenizer's, and every
eos_token_id of config.json and generation_config.json; else data.eos_id) or after the requested number
of tokens, and chooses only ids the tokenizer has when the model's vocabulary is padded past it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mindscale.config import Config, ConfigError, apply_override, config_from_tree, load_config
from mindscale.io import CheckpointError
from mindscale.train.checkpoints.folder import CONFIG
from mindscale.train.data import tokenizers
from mindscale.train.loop.runtime import resolve_device
from models.hf_convert import (
    CONFIG_FILE,
    GENERATION_CONFIG,
    TOKEN_ID_KEYS,
    TOKENIZER_FILES,
    carried_from_source,
    is_hf_folder,
    read_hf_config,
)
from models.weights import WeightsMismatch, resolve_model_dims, weight_problems


def trained_config(checkpoint: str | Path) -> Path | None:
    """The config.yaml of a MindScale step folder (the resolved config it was trained with), or None."""
    stored = Path(checkpoint) / CONFIG
    return stored if stored.is_file() else None


def inference_config(checkpoint: str | Path, config: str | None, overrides=()) -> Config:
    """The config to load `checkpoint` with: `config` (--config) with `overrides`, its finetune.hf_dims
    resolved as the trainer does; else the step folder's config.yaml (dims already resolved); else, for a
    Hugging Face folder, the defaults (its model keys come from its config.json when it is loaded)."""
    if config:
        return resolve_model_dims(load_config(config, overrides))
    stored = trained_config(checkpoint)
    if stored is not None:
        return load_config(stored, overrides)
    if is_hf_folder(checkpoint):
        tree: dict = {}
        for assignment in overrides:
            apply_override(tree, assignment)
        return config_from_tree(tree)
    raise ConfigError(
        f"{checkpoint} has no {CONFIG} beside its weights (a step folder keeps the config it was "
        "trained with); pass --config with that config"
    )


def inference_weights(checkpoint: str | Path, cfg: Config, config: str | None = None) -> tuple[dict, Config]:
    """(full weights, config of the plain model) of `checkpoint` (models.load_inference_weights: a LoRA
    run's adapters merged), checked against the model the config builds. `config`: the --config `cfg`
    came from; a mismatch then names the config.yaml the step was trained with, and how it differs."""
    import models
    from mindspore.nn.utils import no_init_parameters

    weights, plain = models.load_inference_weights(checkpoint, cfg)
    with no_init_parameters():
        problems = weight_problems(models.build_model(plain), weights)
    if not problems:
        return weights, plain
    stored = trained_config(checkpoint)
    if config and stored is not None:
        differ = _model_differences(load_config(stored), cfg)
        raise WeightsMismatch(
            f"{checkpoint} was trained with {stored}{differ}, not --config {config}: leave out "
            f"--config to use it (the tensors: {'; '.join(problems)})"
        )
    raise WeightsMismatch(
        f"{checkpoint} does not match the model config ({'; '.join(problems)}); use the config it was trained with"
    )


def _model_differences(trained: Config, given: Config) -> str:
    """` (model.hidden_size=64 (--config: 128), ...)`: the first model keys that differ, or ''."""
    ours, theirs = _flat(dataclasses.asdict(given.model)), _flat(dataclasses.asdict(trained.model))
    differ = [
        f"model.{key}={theirs[key]!r} (--config: {ours.get(key)!r})" for key in theirs if theirs[key] != ours.get(key)
    ]
    return f" ({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''})" if differ else ""


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        flat |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return flat


def load_tokenizer(cfg: Config, checkpoint: str):
    """The tokenizer of data.tokenizer, else of the checkpoint folder (its tokenizer.model, else its
    tokenizer.json), else None."""
    if cfg.data.tokenizer:
        return tokenizers.load_tokenizer(cfg.data.tokenizer)
    folder = Path(checkpoint)
    if (folder / "tokenizer.model").is_file():
        return tokenizers.load_tokenizer(folder / "tokenizer.model", "--load_checkpoint")
    if (folder / tokenizers.HF_FILE).is_file():
        return tokenizers.load_tokenizer(folder, "--load_checkpoint")
    return None


def stop_ids(cfg: Config, checkpoint: str, tokenizer) -> set[int]:
    """The ids generation stops after: the tokenizer's EOS, and every eos_token_id of the Hugging Face
    folder's config.json and generation_config.json (a list in LLaMA-3's, e.g. end of text and end of
    turn; transformers stops on each); data.eos_id when none of these has one."""
    ids = {tokenizer.eos_id} if tokenizer is not None and tokenizer.eos_id is not None else set()
    for name in (CONFIG_FILE, GENERATION_CONFIG):
        path = Path(checkpoint) / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise CheckpointError(f"{path} is not a JSON object; fix it or remove it from the folder") from None
        ids |= {eos} if isinstance(eos, int) else {i for i in eos or () if isinstance(i, int)}
    return ids or {cfg.data.eos_id}


def prompt_ids(cfg: Config, tokenizer, prompt: str | None, ids_text: str | None) -> list[int]:
    """The prompt's token ids: `ids_text` ("1,2,3") checked against the vocabulary, else `prompt` encoded."""
    if ids_text is not None:
        try:
            ids = [int(t) for t in ids_text.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids={ids_text!r}: give comma-separated integers, e.g. 1,2,3") from None
        bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
        if bad or not ids:
            raise ConfigError(f"--prompt-ids: need ids in [0, {cfg.model.vocab_size}), got {bad or 'none'}")
        return ids
    if tokenizer is None:
        raise ConfigError(
            "--prompt needs a tokenizer: set data.tokenizer or put tokenizer.model or tokenizer.json "
            "in the checkpoint folder, or pass --prompt-ids"
        )
    if cfg.finetune.template:
        from mindscale.train.data.chat_template import get_template
        from mindscale.train.data.templates import encode_prompt

        return encode_prompt(
            [{"role": "user", "content": prompt}], get_template(cfg.finetune.template, tokenizer), tokenizer
        )
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode([prompt])[0]


def generate_from_checkpoint(
    cfg: Config,
    checkpoint: str,
    sampler,
    max_new_tokens: int,
    prompt: str | None = None,
    ids_text: str | None = None,
    config: str | None = None,
) -> dict:
    """{"ids": new ids, "text": them decoded (None without a tokenizer), "prompt_ids": ...} of `prompt`
    (or of the ids in `ids_text`) continued by the checkpoint's model with `sampler`
    (models.generation.Sampler). `cfg` is inference_config's; `config` the --config it came from, if any."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={max_new_tokens}: must be >= 1")

    import mindspore as ms
    import models
    from models.generation import KVCacheDecoder, generate

    weights, cfg = inference_weights(checkpoint, cfg, config)
    tokenizer = load_tokenizer(cfg, checkpoint)
    prompt = prompt_ids(cfg, tokenizer, prompt, ids_text)
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens > model.vocab_size={cfg.model.vocab_size}; "
            "use the tokenizer the model was trained with"
        )
    # One device whatever the training layout. On CPU, PyNative: the two small graphs (prefill and one-token
    # step) would take longer to compile than a short generation takes to run.
    device = resolve_device(cfg.run.device_target)
    graph = cfg.run.mode == "graph" and device != "CPU"
    ms.set_context(mode=ms.GRAPH_MODE if graph else ms.PYNATIVE_MODE)
    if ms.get_context("device_target") != device:  # set_device raises once a kernel ran (a caller's, a test's)
        ms.set_device(device)
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    decoder = KVCacheDecoder(model, cfg, len(prompt) + max_new_tokens)
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    ids = generate(decoder, prompt, max_new_tokens, sampler, stop_ids(cfg, checkpoint, tokenizer), vocab)
    return {"ids": ids, "text": tokenizer.decode(ids) if tokenizer is not None else None, "prompt_ids": prompt}


@dataclasses.dataclass
class ExportExtras:
    """What a Hugging Face export carries beside the weights so that transformers generates as the model
    the run started from did (export_extras)."""

    config: dict  # config.json keys: special-token ids, the starting model's max_position_embeddings
    files: dict  # file name -> contents: generation_config.json, the tokenizer's files
    tokenizer: str | None  # where the tokenizer came from
    generation_config: str | None  # where generation_config.json came from


def export_extras(cfg: Config) -> ExportExtras:
    """The extras of an export of a run whose config is `cfg`. From the Hugging Face folder the run started
    from (checkpoint.load_path), its special-token ids, max_position_embeddings and generation_config.json,
    as they are. The tokenizer is the one the run trained with (data.tokenizer; that folder's own when it
    is the same), else that folder's: a Hugging Face tokenizer's files, or a SentencePiece .model as
    tokenizer.model with the tokenizer_config.json that makes transformers encode as it does. Without a
    starting folder the token ids are the tokenizer's (none without one: data.eos_id's default is no
    model's)."""
    source = _starting_folder(cfg)
    config, files, generation = {}, {}, None
    if source is not None:
        config = carried_from_source(read_hf_config(source), cfg.model)
        if (source / GENERATION_CONFIG).is_file():
            generation = source / GENERATION_CONFIG
            files[GENERATION_CONFIG] = generation.read_bytes()
    tokenizer = _trained_tokenizer(cfg)
    if tokenizer is not None and source is not None and _same_tokenizer(tokenizer, source):
        tokenizer_folder = source
    else:
        tokenizer_folder = tokenizer.folder if tokenizer is not None else source
    if tokenizer is not None and tokenizer_folder is None:  # a SentencePiece file of its own
        files |= {
            "tokenizer.model": Path(tokenizer.path).read_bytes(),
            "tokenizer_config.json": (json.dumps(_sentencepiece_config(tokenizer), indent=2) + "\n").encode(),
        }
        where = tokenizer.path
    else:
        found = {
            name: (tokenizer_folder / name).read_bytes()
            for name in TOKENIZER_FILES
            if tokenizer_folder is not None and (tokenizer_folder / name).is_file()
        }
        files |= found
        where = tokenizer_folder if found else None
    if source is None and tokenizer is not None:
        own = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
        config |= {key: value for key, value in zip(TOKEN_ID_KEYS, own) if value is not None}
    return ExportExtras(
        config, files, None if where is None else str(where), None if generation is None else str(generation)
    )


def _starting_folder(cfg: Config) -> Path | None:
    """checkpoint.load_path when it is a Hugging Face folder, else None."""
    path = cfg.checkpoint.load_path
    if path and not Path(path).exists():
        raise CheckpointError(
            f"checkpoint.load_path={path} does not exist: the export takes the token ids, "
            "generation config and tokenizer of the model the run started from there; fix it with "
            "--set checkpoint.load_path=PATH"
        )
    return Path(path) if path and is_hf_folder(path) else None


def _trained_tokenizer(cfg: Config):
    """The tokenizer of data.tokenizer, or None when unset."""
    if not cfg.data.tokenizer:
        return None
    if not Path(cfg.data.tokenizer).exists():
        raise ConfigError(
            f"data.tokenizer={cfg.data.tokenizer} does not exist: the export copies the tokenizer the "
            "run trained with; fix it with --set data.tokenizer=PATH, or export without a tokenizer: "
            "--set data.tokenizer=null"
        )
    return tokenizers.load_tokenizer(cfg.data.tokenizer)


def _same_tokenizer(tokenizer, folder: Path) -> bool:
    """Whether `tokenizer` is the one of Hugging Face folder `folder` (the folder itself, or its tokenizer.model)."""
    if tokenizer.folder is not None:
        return Path(tokenizer.folder).resolve() == folder.resolve()
    own = folder / "tokenizer.model"
    return own.is_file() and own.read_bytes() == Path(tokenizer.path).read_bytes()


def _sentencepiece_config(tokenizer) -> dict:
    """tokenizer_config.json for a SentencePiece .model: transformers' LlamaTokenizer in its legacy mode
    (slow or fast) gives SentencePiece's own ids, BOS first, as tools/generate.py encodes a raw prompt."""
    processor = tokenizer.processor

    def piece(token_id):
        return None if token_id is None or token_id < 0 else processor.id_to_piece(token_id)

    return {
        "tokenizer_class": "LlamaTokenizer",
        "legacy": True,
        "add_bos_token": tokenizer.bos_id is not None,
        "add_eos_token": False,
        "bos_token": piece(tokenizer.bos_id),
        "eos_token": piece(tokenizer.eos_id),
        "pad_token": piece(tokenizer.pad_id),
        "unk_token": piece(processor.unk_id()),
        "clean_up_tokenization_spaces": False,
    }
