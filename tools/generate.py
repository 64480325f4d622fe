"""Generate text from any checkpoint the trainer can load, with KV-cache incremental decoding.

    python tools/generate.py --load_checkpoint PATH [--config C] [--set k=v ...] (--prompt TEXT | --prompt-ids 1,2,3) \\
        --max_new_tokens N [--greedy | --temperature T --top-k K --top-p P --seed S] [--json]

PATH: a MindScale step folder (LoRA adapters are merged into their base), a .safetensors file, or a
Hugging Face folder. Without --config a step folder's own config.yaml (the config it was trained with)
is used, and a Hugging Face folder brings its model keys; --config is then needed only for a bare
.safetensors file. With --config, finetune.hf_dims takes the model dims from checkpoint.load_path as the
trainer does. A text prompt is wrapped in finetune.template when set, else encoded after BOS;
generation stops at the EOS id or after N tokens (the choices are described in
mindscale/train/inference.py, which does the work). --json prints {"ids": [...new ids], "text": ...,
"prompt_ids": [...]}; text is null without a tokenizer. Exit 2 with one line for bad input.
"""

from __future__ import annotations

import sys

from mindscale.cli import OneLineParser, add_config_arguments, emit, fail
from mindscale.config import UserError
from mindscale.train.inference import generate_from_checkpoint, inference_config


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser, required=False)
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
    try:
        cfg = inference_config(args.load_checkpoint, args.config, args.overrides)
    except UserError as exc:
        fail(str(exc))
    from models.generation import Sampler  # imports MindSpore: after the arguments are read

    try:
        # sampling flags are checked here, before anything heavy is loaded
        sampler = Sampler(
            greedy=args.greedy or not sampling,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        result = generate_from_checkpoint(
            cfg, args.load_checkpoint, sampler, args.max_new_tokens, args.prompt, args.prompt_ids, args.config
        )
    except ValueError as exc:  # every UserError (config, checkpoint, prompt), and bad sampling or lengths
        fail(str(exc))
    emit(result, args.json, result["text"] if result["text"] is not None else " ".join(map(str, result["ids"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
