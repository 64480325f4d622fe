"""Tokenize text into fixed-length MindRecord training samples with a manifest.

    pretrain: python tools/preprocess_data.py --input 'corpus/*.jsonl' --tokenizer tok.model \\
                  --seq-length 2048 --output data/corpus
    sft:      python tools/preprocess_data.py --mode sft --template llama2 --input chats.jsonl \\
                  --tokenizer tok.model --seq-length 2048 --output data/chats [--pack]
    from a training config (seq_length, vocab size, tokenizer): --config C [--set k=v ...]
    a folder written before manifests kept shard checksums: python tools/preprocess_data.py --add-checksums DIR

pretrain: documents are tokenized, each followed by EOS, joined into one stream and cut into
samples of seq_length + 1 tokens (consecutive samples share one boundary token); the tail is
dropped and counted in the manifest. sft: records rendered with a prompt template into token ids
and an answer-only loss mask, one example per sample or with --pack several per sample with
segment_ids. pretrain streams in bounded memory: --workers N processes tokenize chunks of documents
while the main process reads, packs and writes, with the same output for any N (docs/data.md
"Workers, memory and throughput"). The output folder appears only when complete. The samples written are counted on
stderr: a bar on a terminal, else a line every 10 s (mindscale/progress.py). The layout of the samples
is described in mindscale/train/data/preprocess.py (which does the work) and docs/data.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mindscale.cli import add_config_arguments, config_from_args, emit, fail
from mindscale.config import Config, UserError
from mindscale.progress import Progress
from mindscale.train.data.dataset import check_special_ids
from mindscale.train.data.preprocess import Options, add_checksums, check_output, load_tokenizer, pad_id_of, preprocess
from mindscale.train.data.raw_text import resolve_sources
from mindscale.train.data.templates import TEMPLATE_CHOICES


def parse_args(argv):
    defaults = Options()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, required=False)
    parser.add_argument(
        "--add-checksums",
        metavar="DIR",
        help="only record the size and checksum of each shard "
        "of DIR in its manifest.json (a folder written "
        "before MindScale kept them), then exit",
    )
    parser.add_argument("--input", nargs="+", help="files, globs or save_to_disk folders")
    parser.add_argument(
        "--tokenizer",
        help="SentencePiece .model or Hugging Face folder with tokenizer.json (default: the config's data.tokenizer)",
    )
    parser.add_argument("--seq-length", type=int, help="model sequence length S (default: model.seq_length)")
    parser.add_argument("--output", help="folder for the MindRecord shards and manifest.json")
    parser.add_argument("--mode", choices=["pretrain", "sft"], default=defaults.mode)
    parser.add_argument(
        "--template",
        choices=TEMPLATE_CHOICES,
        default=defaults.template,
        help="SFT prompt template; hf = the tokenizer folder's chat_template",
    )
    parser.add_argument("--pack", action="store_true", help="SFT: pack several examples per sample")
    parser.add_argument("--shard-size", type=int, default=defaults.shard_size, help="samples per MindRecord file")
    parser.add_argument("--text-key", default=defaults.text_key, help="pretrain: column holding the text")
    parser.add_argument(
        "--text-unit",
        choices=["document", "paragraph", "line"],
        default=defaults.text_unit,
        help="text files: what one document is (a whole file, a blank-line block, a line)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=defaults.workers,
        help="tokenizer processes (pretrain; the main process reads and writes) or threads (sft)",
    )
    parser.add_argument(
        "--vocab-size", type=int, help="refuse a tokenizer larger than this (default: model.vocab_size with --config)"
    )
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=defaults.valid_fraction,
        help="pretrain: hold out this fraction of the documents (whole, evenly spread) into "
        "OUTPUT/valid, for data.valid_path",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    parser.add_argument("--json", action="store_true", help="print the manifest as one JSON object")
    return parser.parse_args(argv)


def resolve_settings(args) -> tuple[Config | None, int, str, int | None]:
    """(config, seq_length, tokenizer path, vocab limit) from the flags, falling back to --config."""
    if not args.input or not args.output:
        fail("--input and --output are required (or pass --add-checksums DIR alone)")
    cfg = config_from_args(args) if args.config else None
    seq_length = args.seq_length or (cfg.model.seq_length if cfg else None)
    tokenizer = args.tokenizer or (cfg.data.tokenizer if cfg else None)
    vocab_limit = args.vocab_size or (cfg.model.vocab_size if cfg else None)
    if not seq_length or seq_length < 1:
        fail("--seq-length must be a positive integer (or pass --config with model.seq_length)")
    if not tokenizer:
        fail("--tokenizer is required (or pass --config with data.tokenizer); train one with tools/train_tokenizer.py")
    if args.shard_size < 1 or args.workers < 1:
        fail("--shard-size and --workers must be >= 1")
    if not 0 <= args.valid_fraction < 1:
        fail(f"--valid-fraction {args.valid_fraction}: must be in [0, 1)")
    if args.valid_fraction and args.mode != "pretrain":
        fail(
            "--valid-fraction applies to --mode pretrain (SFT examples are not split yet); hold out a file of "
            "examples and preprocess it on its own"
        )
    if args.pack and args.mode != "sft":
        fail("--pack applies to --mode sft (pretraining always packs documents)")
    return cfg, seq_length, tokenizer, vocab_limit


def summary(manifest: dict, seq_length: int, output: Path) -> str:
    """The line printed at the end: what was written, and for SFT what became of the examples."""
    sft = manifest["mode"] == "sft"
    tokens = f"{manifest['num_tokens']} tokens" + (f", {manifest['loss_tokens']} trained" if sft else "")
    written = (
        f"{manifest['num_samples']} samples of {seq_length + 1} tokens ({tokens}) in "
        f"{len(manifest['shards'])} shard(s) -> {output}"
    )
    if sft:
        return (
            f"sft: {manifest['examples']} examples ({manifest['truncated_examples']} truncated, "
            f"{manifest['dropped_examples']} dropped without answer tokens; template {manifest['template']}"
            f"{', packed' if manifest['pack'] else ''}) -> {written}"
        )
    held_out = manifest.get("valid")
    return f"pretrain: {written}" + (
        f"; held out {held_out['documents']} document(s), {held_out['num_samples']} "
        f"samples -> {output / held_out['path']}"
        if held_out
        else ""
    )


def add_checksums_to(folder: Path, as_json: bool) -> int:
    """--add-checksums DIR: record the shard checksums of an older folder (mindscale/train/data/preprocess.py)."""
    began = time.perf_counter()
    try:
        shards, size = add_checksums(folder)
    except UserError as exc:
        fail(str(exc))
    line = (
        f"{folder}: recorded the size and checksum of {shards} shard(s) ({size / 1e9:.2f} GB in "
        f"{time.perf_counter() - began:.1f} s) in {folder / 'manifest.json'}"
        if shards
        else f"{folder}: its manifest.json already records the shard checksums; nothing to do"
    )
    emit({"folder": str(folder), "shards": shards, "bytes": size}, as_json, line)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.add_checksums:
        return add_checksums_to(Path(args.add_checksums), args.json)
    cfg, seq_length, tokenizer, vocab_limit = resolve_settings(args)
    output = Path(args.output)
    options = Options(
        args.mode,
        args.template,
        args.pack,
        args.shard_size,
        args.text_key,
        args.text_unit,
        args.workers,
        args.valid_fraction,
    )
    try:
        check_output(output, args.overwrite)
        encoder = load_tokenizer(tokenizer, vocab_limit)
        if cfg is not None:
            check_special_ids(cfg, encoder.eos_id, pad_id_of(encoder), args.mode, f"tokenizer {tokenizer}")
        sources = resolve_sources(args.input)
        with Progress("preprocess") as progress:
            progress.stage("writing samples", unit="sample")
            manifest = preprocess(output, options, sources, encoder, seq_length, progress)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    emit({"output": str(output), **manifest}, args.json, summary(manifest, seq_length, output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
