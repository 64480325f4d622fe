"""Text generation from any checkpoint the trainer can load, with KV-cache incremental decoding
(tools/generate.py runs it; the decoder and the sampler are models/generation.py).

The checkpoint is a MindScale step folder (a LoRA run's adapters are merged into the config's
checkpoint.load_path), a .safetensors file, or a Hugging Face folder (config.json + safetensors;
the model dims then come from its config.json and its tokenizer.model, else its tokenizer.json,
is used when data.tokenizer is unset). A text prompt is wrapped in finetune.template when set (the
SFT format the model was trained on), else encoded after BOS. Generation stops at the EOS id (the
tokenizer's, config.json's eos_token_id, or data.eos_id) or after the requested number of tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

from mindscale.config import Config, ConfigError
from mindscale.train.data import tokenizers
from mindscale.train.loop.runtime import resolve_device


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


def eos_id(cfg: Config, checkpoint: str, tokenizer) -> int:
    """The tokenizer's EOS id, else the HF folder's eos_token_id, else data.eos_id."""
    if tokenizer is not None and tokenizer.eos_id is not None:
        return tokenizer.eos_id
    hf_config = Path(checkpoint) / "config.json"
    if hf_config.is_file():
        eos = json.loads(hf_config.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            return eos
    return cfg.data.eos_id


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
        raise ConfigError("--prompt needs a tokenizer: set data.tokenizer or put tokenizer.model or tokenizer.json "
                          "in the checkpoint folder, or pass --prompt-ids")
    if cfg.finetune.template:
        from mindscale.train.data.chat_template import get_template
        from mindscale.train.data.templates import encode_prompt
        return encode_prompt([{"role": "user", "content": prompt}], get_template(cfg.finetune.template, tokenizer),
                             tokenizer)
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode([prompt])[0]


def generate_from_checkpoint(cfg: Config, checkpoint: str, sampler, max_new_tokens: int, prompt: str | None = None,
                             ids_text: str | None = None) -> dict:
    """{"ids": new ids, "text": them decoded (None without a tokenizer), "prompt_ids": ...} of `prompt`
    (or of the ids in `ids_text`) continued by the checkpoint's model with `sampler`
    (models.generation.Sampler)."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={max_new_tokens}: must be >= 1")

    import mindspore as ms
    import models
    from models.generation import KVCacheDecoder, generate
    weights, cfg = models.load_inference_weights(checkpoint, cfg)
    tokenizer = load_tokenizer(cfg, checkpoint)
    prompt = prompt_ids(cfg, tokenizer, prompt, ids_text)
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens > model.vocab_size={cfg.model.vocab_size}; "
                          "use the tokenizer the model was trained with")
    # One device whatever the training layout. On CPU, PyNative: the two small graphs (prefill and one-token
    # step) would take longer to compile than a short generation takes to run.
    device = resolve_device(cfg.run.device_target)
    graph = cfg.run.mode == "graph" and device != "CPU"
    ms.set_context(mode=ms.GRAPH_MODE if graph else ms.PYNATIVE_MODE)
    ms.set_device(device)
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    decoder = KVCacheDecoder(model, cfg, len(prompt) + max_new_tokens)
    ids = generate(decoder, prompt, max_new_tokens, sampler, eos_id(cfg, checkpoint, tokenizer))
    return {"ids": ids, "text": tokenizer.decode(ids) if tokenizer is not None else None, "prompt_ids": prompt}
