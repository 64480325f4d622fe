"""Tokenize text into fixed-length MindRecord training samples with a manifest.

    pretrain: python tools/preprocess_data.py --input 'corpus/*.jsonl' --tokenizer tok.model \\
                  --seq-length 2048 --output data/corpus
    sft:      python tools/preprocess_data.py --mode sft --template llama2 --input chats.jsonl \\
                  --tokenizer tok.model --seq-length 2048 --output data/chats [--pack]
    from a training config (seq_length, vocab size, tokenizer): --config C [--set k=v ...]

pretrain: documents are tokenized, each followed by EOS, joined into one stream and cut into
samples of seq_length + 1 tokens; sample k holds stream tokens [k*S, k*S + S] (consecutive
samples share one boundary token, as in Megatron's GPTDataset), so every token but the first is a
training target exactly once. The tail of fewer than S tokens after the last sample is dropped and
counted in the manifest.
sft: Alpaca (instruction/input/output) or chat (messages) records are rendered with a prompt
template (mindscale/train/templates.py) into token ids and a loss mask that is 1 only on answer tokens;
one example per sample padded with pad_id (mask 0), or with --pack several examples per sample
with segment_ids (1, 2, ... per example, 0 on padding). Examples longer than S + 1 are truncated
and counted; examples left without answer tokens are dropped and counted.

The output folder is written under a temporary name and renamed when complete, so a failure or a
kill never leaves a half-written or half-replaced folder. See docs/data.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mindscale.io import publish_folder
from mindscale.config import Config
from mindscale.cli import add_config_arguments, config_from_args, emit, fail
from mindscale.train.data import (FORMAT_VERSION, MANIFEST_NAME, DataError, Source, check_special_ids, column,
                                  read_batches, resolve_sources, sha256_file)
from mindscale.train.templates import TEMPLATES, RecordError, encode_examples, get_template

WRITE_BATCH = 1024  # samples per FileWriter.write_raw_data call


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, required=False)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or save_to_disk folders")
    parser.add_argument("--tokenizer", help="SentencePiece .model (default: the config's data.tokenizer)")
    parser.add_argument("--seq-length", type=int, help="model sequence length S (default: model.seq_length)")
    parser.add_argument("--output", required=True, help="folder for the MindRecord shards and manifest.json")
    parser.add_argument("--mode", choices=["pretrain", "sft"], default="pretrain")
    parser.add_argument("--template", choices=sorted(TEMPLATES), default="alpaca", help="SFT prompt template")
    parser.add_argument("--pack", action="store_true", help="SFT: pack several examples per sample")
    parser.add_argument("--shard-size", type=int, default=16384, help="samples per MindRecord file")
    parser.add_argument("--text-key", default="text", help="pretrain: column holding the text")
    parser.add_argument("--text-unit", choices=["document", "paragraph", "line"], default="document",
                        help="text files: what one document is (a whole file, a blank-line block, a line)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer threads")
    parser.add_argument("--vocab-size", type=int, help="refuse a tokenizer larger than this (default: "
                                                       "model.vocab_size with --config)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    parser.add_argument("--json", action="store_true", help="print the manifest as one JSON object")
    return parser.parse_args(argv)


def resolve_settings(args) -> tuple[Config | None, int, str, int | None]:
    """(config, seq_length, tokenizer path, vocab limit) from the flags, falling back to --config."""
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
    if args.pack and args.mode != "sft":
        fail("--pack applies to --mode sft (pretraining always packs documents)")
    return cfg, seq_length, tokenizer, vocab_limit


def load_tokenizer(path: str, vocab_limit: int | None):
    import sentencepiece

    if not Path(path).is_file():
        fail(f"--tokenizer {path} does not exist; train one with tools/train_tokenizer.py")
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as exc:
        fail(f"--tokenizer {path} is not a SentencePiece model ({str(exc).splitlines()[0]})")
    if vocab_limit is not None and sp.vocab_size() > vocab_limit:
        fail(f"tokenizer {path} has {sp.vocab_size()} tokens, more than the model's vocabulary of {vocab_limit}; "
             "train a smaller tokenizer or raise model.vocab_size / --vocab-size")
    if sp.eos_id() < 0:
        fail(f"tokenizer {path} has no EOS id (needed to join documents and end answers); "
             "train it with tools/train_tokenizer.py")
    return sp


def check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        fail(f"--output {output} is a file; pass a folder path")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        fail(f"--output {output} exists and is not empty; pass --overwrite to replace it or choose another folder")


class ShardWriter:
    """Samples into MindRecord files of at most `shard_size` samples each (data_00000.mindrecord, ...)."""

    def __init__(self, folder: Path, schema: dict, shard_size: int):
        self.folder, self.schema, self.shard_size = folder, schema, shard_size
        self.shards: list[dict] = []
        self.writer = None
        self.pending: list[dict] = []
        self.in_shard = 0

    def _flush(self) -> None:
        if self.pending:
            self.writer.write_raw_data(self.pending)
            self.pending = []

    def _close_shard(self) -> None:
        self._flush()
        self.writer.commit()
        self.shards.append({"file": self.name, "samples": self.in_shard})
        self.writer, self.in_shard = None, 0

    def add(self, sample: dict) -> None:
        if self.writer is None:
            from mindspore.mindrecord import FileWriter

            self.name = f"data_{len(self.shards):05d}.mindrecord"
            self.writer = FileWriter(str(self.folder / self.name), shard_num=1, overwrite=False)
            self.writer.add_schema(self.schema, "mindscale_samples")
        self.pending.append(sample)
        self.in_shard += 1
        if len(self.pending) >= WRITE_BATCH:
            self._flush()
        if self.in_shard == self.shard_size:
            self._close_shard()

    def close(self) -> list[dict]:
        if self.writer is not None:
            self._close_shard()
        return self.shards


# ----------------------------------------------------------------------------------------------
# pretrain: documents joined with EOS and cut into seq_length + 1 token samples


def documents(sources: list[Source], args, sp, stats: dict) -> Iterator[np.ndarray]:
    """Token ids of each non-empty document followed by EOS, in input order, one array per batch."""
    for source in sources:
        for batch in read_batches(source, args.text_unit):
            texts = [t for t in column(batch, args.text_key, source) if t and t.strip()]
            stats["empty_documents_skipped"] += len(batch[args.text_key]) - len(texts)
            stats["documents"] += len(texts)
            if texts:
                encoded = sp.encode(texts, num_threads=args.workers)
                yield np.concatenate([np.array(ids + [sp.eos_id()], np.int32) for ids in encoded])


def pack_stream(chunks: Iterable[np.ndarray], seq_length: int, stats: dict) -> Iterator[np.ndarray]:
    """Samples of seq_length + 1 tokens, consecutive ones overlapping by one token."""
    pending = np.empty(0, np.int32)
    for chunk in chunks:
        stats["num_tokens"] += len(chunk)
        pending = np.concatenate([pending, chunk])
        full = (len(pending) - 1) // seq_length
        for k in range(full):
            yield pending[k * seq_length: k * seq_length + seq_length + 1]
        pending = pending[full * seq_length:]


# ----------------------------------------------------------------------------------------------
# sft: templated examples with answer-only loss masks, padded or packed


def examples(sources: list[Source], args, sp) -> Iterator[tuple[list[int], list[int]]]:
    template = get_template(args.template)
    for source in sources:
        seen = 0
        for batch in read_batches(source, args.text_unit):
            records = [dict(zip(batch, values)) for values in zip(*batch.values())]
            try:
                yield from encode_examples(records, template, sp, num_threads=args.workers)
            except RecordError as exc:
                raise DataError(f"{source.path} record {seen + exc.index} (0-based): {exc}; "
                                "fix or remove the record") from None
            seen += len(records)


def sft_sample(parts: list[tuple[list[int], list[int]]], length: int, pad_id: int, with_segments: bool) -> dict:
    used = sum(len(ids) for ids, _ in parts)
    pad = [0] * (length - used)
    sample = {"input_ids": np.array([t for ids, _ in parts for t in ids] + [pad_id] * len(pad), np.int32),
              "loss_mask": np.array([m for _, mask in parts for m in mask] + pad, np.int32)}
    if with_segments:
        sample["segment_ids"] = np.array([k + 1 for k, (ids, _) in enumerate(parts) for _ in ids] + pad, np.int32)
    return sample


def sft_samples(encoded: Iterable[tuple[list[int], list[int]]], length: int, pad_id: int, pack: bool,
                stats: dict) -> Iterator[dict]:
    """One example per sample, or (pack) consecutive examples while they fit (next-fit, order kept)."""
    group: list[tuple[list[int], list[int]]] = []
    used = 0
    for ids, mask in encoded:
        stats["examples"] += 1
        if len(ids) > length:
            ids, mask = ids[:length], mask[:length]
            stats["truncated_examples"] += 1
        if not any(mask):
            stats["dropped_examples"] += 1
            continue
        stats["num_tokens"] += len(ids)
        stats["loss_tokens"] += sum(mask)
        if not pack:
            yield sft_sample([(ids, mask)], length, pad_id, with_segments=False)
            continue
        if used + len(ids) > length:
            yield sft_sample(group, length, pad_id, with_segments=True)
            group, used = [], 0
        group.append((ids, mask))
        used += len(ids)
    if group:
        yield sft_sample(group, length, pad_id, with_segments=True)


# ----------------------------------------------------------------------------------------------


def write(folder: Path, args, sources: list[Source], sp, seq_length: int, pad_id: int) -> dict:
    """Write the shards into `folder`; returns the mode-specific manifest entries."""
    length = seq_length + 1
    fields = ["input_ids"] + (["loss_mask"] if args.mode == "sft" else []) + (["segment_ids"] if args.pack else [])
    writer = ShardWriter(folder, {name: {"type": "int32", "shape": [length]} for name in fields}, args.shard_size)
    if args.mode == "pretrain":
        stats = {"documents": 0, "empty_documents_skipped": 0, "num_tokens": 0}
        for tokens in pack_stream(documents(sources, args, sp, stats), seq_length, stats):
            writer.add({"input_ids": tokens})
    else:
        stats = {"template": args.template, "pack": args.pack, "examples": 0, "truncated_examples": 0,
                 "dropped_examples": 0, "num_tokens": 0, "loss_tokens": 0}
        for sample in sft_samples(examples(sources, args, sp), length, pad_id, args.pack, stats):
            writer.add(sample)
    shards = writer.close()
    stats.update(fields=fields, shards=shards, num_samples=sum(s["samples"] for s in shards))
    if not stats["num_samples"] and args.mode == "pretrain":
        raise DataError(f"the inputs hold {stats['num_tokens']} tokens, too few for one sample of {length}; "
                        "add text or lower --seq-length")
    if not stats["num_samples"]:
        raise DataError(f"none of {stats['examples']} examples has answer tokens within the first {length} tokens "
                        f"({stats['truncated_examples']} truncated); raise --seq-length or shorten the prompts")
    if args.mode == "pretrain":  # num_tokens = num_samples * S + 1 + tail
        stats["tail_tokens_dropped"] = stats["num_tokens"] - stats["num_samples"] * seq_length - 1
    return stats


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg, seq_length, tokenizer, vocab_limit = resolve_settings(args)
    output = Path(args.output)
    check_output(output, args.overwrite)
    sp = load_tokenizer(tokenizer, vocab_limit)
    pad_id = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    try:
        if cfg is not None:
            check_special_ids(cfg, sp.eos_id(), pad_id, args.mode, f"tokenizer {tokenizer}")
        sources = resolve_sources(args.input)
    except DataError as exc:
        fail(str(exc))
    os.environ.setdefault("GLOG_v", "3")  # MindRecord's writer logs at INFO/WARNING otherwise
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    partial.mkdir()
    try:
        stats = write(partial, args, sources, sp, seq_length, pad_id)
        manifest = {"format_version": FORMAT_VERSION, "mode": args.mode, "seq_length": seq_length,
                    "sample_length": seq_length + 1, "vocab_size": sp.vocab_size(), "eos_id": sp.eos_id(),
                    "pad_id": pad_id, "bos_id": sp.bos_id(),
                    "tokenizer": {"path": str(Path(tokenizer).resolve()), "sha256": sha256_file(tokenizer)},
                    "sources": [{"path": s.path, "format": s.format} for s in sources],
                    "text_key": args.text_key, **stats}
        (partial / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        publish_folder(partial, output)
    except DataError as exc:
        fail(str(exc))
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    emit({"output": str(output), **manifest}, args.json,
         f"{args.mode}: {manifest['num_samples']} samples of {seq_length + 1} tokens "
         f"({manifest['num_tokens']} tokens) in {len(manifest['shards'])} shard(s) -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
