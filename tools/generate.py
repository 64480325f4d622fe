"""Generate text from any checkpoint the trainer can load, with KV-cache incremental decoding.

    python tools/generate.py --config C --load_checkpoint PATH (--prompt TEXT | --prompt-ids 1,2,3) \\
        --max_new_tokens N [--greedy | --temperature T --top-k K --top-p P --seed S] [--json]

PATH: a MindScale step folder (a LoRA run's adapters are merged into the config's
checkpoint.load_path), a .safetensors file, or a Hugging Face folder (config.json + safetensors;
the model dims then come from its config.json and its tokenizer.model is used when data.tokenizer
is unset). A text prompt is wrapped in finetune.template when set (the SFT format the model was
trained on), else encoded after BOS. Stops at the EOS id (the tokenizer's, config.json's
eos_token_id, or data.eos_id) or after N tokens. --json prints {"ids": [...new ids], "text": ...,
"prompt_ids": [...]}; text is null without a tokenizer. Exit 2 with one line for bad input.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mindscale.config import ConfigError
from mindscale.cli import OneLineParser, add_config_arguments, config_from_args, emit, fail


def _tokenizer(cfg, checkpoint: str):
    """SentencePiece processor from data.tokenizer, else the checkpoint folder's tokenizer.model, else None."""
    import sentencepiece as spm
    path = cfg.data.tokenizer or (Path(checkpoint) / "tokenizer.model" if Path(checkpoint).is_dir() else None)
    if path is None or not Path(path).is_file():
        if cfg.data.tokenizer:
            raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} does not exist; fix the path")
        return None
    return spm.SentencePieceProcessor(model_file=str(path))


def _eos_id(cfg, checkpoint: str, sp) -> int:
    if sp is not None and sp.eos_id() >= 0:
        return sp.eos_id()
    hf_config = Path(checkpoint) / "config.json"
    if hf_config.is_file():
        eos = json.loads(hf_config.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            return eos
    return cfg.data.eos_id


def _prompt_ids(args, cfg, sp) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids={args.prompt_ids!r}: give comma-separated integers, e.g. 1,2,3")
        bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
        if bad or not ids:
            raise ConfigError(f"--prompt-ids: need ids in [0, {cfg.model.vocab_size}), got {bad or 'none'}")
        return ids
    if sp is None:
        raise ConfigError("--prompt needs a tokenizer: set data.tokenizer or put tokenizer.model in the checkpoint "
                          "folder, or pass --prompt-ids")
    if cfg.finetune.template:
        from mindscale.train.templates import encode_prompt, get_template
        return encode_prompt([{"role": "user", "content": args.prompt}], get_template(cfg.finetune.template), sp)
    return ([sp.bos_id()] if sp.bos_id() >= 0 else []) + sp.encode(args.prompt)


def run(args) -> dict:
    cfg = config_from_args(args)
    from models.generation import Sampler  # validate sampling flags before loading anything heavy
    sampler = Sampler(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={args.max_new_tokens}: must be >= 1")

    import mindspore as ms
    import models
    from models.generation import KVCacheDecoder, generate
    from mindscale.train.runtime import detect_device
    weights, cfg = models.load_inference_weights(args.load_checkpoint, cfg)
    sp = _tokenizer(cfg, args.load_checkpoint)
    prompt = _prompt_ids(args, cfg, sp)
    if sp is not None and sp.get_piece_size() > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {sp.get_piece_size()} pieces > model.vocab_size={cfg.model.vocab_size}; "
                          "use the tokenizer the model was trained with")
    # One device whatever the training layout. On CPU, PyNative: the two small graphs (prefill and one-token
    # step) would take longer to compile than a short generation takes to run.
    device = cfg.run.device_target if cfg.run.device_target != "auto" else detect_device()
    graph = cfg.run.mode == "graph" and device != "CPU"
    ms.set_context(mode=ms.GRAPH_MODE if graph else ms.PYNATIVE_MODE)
    ms.set_device(device)
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    decoder = KVCacheDecoder(model, cfg, len(prompt) + args.max_new_tokens)
    ids = generate(decoder, prompt, args.max_new_tokens, sampler, _eos_id(cfg, args.load_checkpoint, sp))
    return {"ids": ids, "text": sp.decode(ids) if sp is not None else None, "prompt_ids": prompt}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--load_checkpoint", required=True, help="MindScale checkpoint or Hugging Face folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    source.add_argument("--prompt-ids", dest="prompt_ids", help="prompt token ids, comma-separated")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (default unless sampling flags given)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", dest="top_k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", dest="top_p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    sampling = args.temperature != 1.0 or args.top_k or args.top_p != 1.0 or "--seed" in (argv or sys.argv)
    args.greedy = args.greedy or not sampling

    from models import WeightsMismatch
    from mindscale.io import CheckpointError
    try:
        result = run(args)
    except (ConfigError, CheckpointError, WeightsMismatch, ValueError) as exc:
        fail(str(exc))
    emit(result, args.json, result["text"] if result["text"] is not None else " ".join(map(str, result["ids"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
