"""Text into fixed-length MindRecord training samples with a manifest (tools/preprocess_data.py runs it;
docs/data.md describes the formats).

pretrain: documents are tokenized, each followed by EOS, joined into one stream and cut into
samples of seq_length + 1 tokens; sample k holds stream tokens [k*S, k*S + S] (consecutive
samples share one boundary token, as in Megatron's GPTDataset), so every token but the first is a
training target exactly once. The tail of fewer than S tokens after the last sample is dropped and
counted in the manifest. With a valid fraction, whole documents are held out (mindscale/train/data/heldout.py)
and packed the same way into <output>/valid, a data folder of its own.
sft: Alpaca (instruction/input/output) or chat (messages) records are rendered with a prompt
template (mindscale/train/data/templates.py) into token ids and a loss mask that is 1 only on answer tokens;
one example per sample padded with pad_id (mask 0), or packed: several examples per sample with
segment_ids (1, 2, ... per example, 0 on padding). Examples longer than S + 1 are truncated and
counted; examples left without answer tokens are dropped and counted.

The output folder is written under a temporary name and renamed when complete, so a failure or a
kill never leaves a half-written or half-replaced folder. Every problem with the input raises
DataError (one line).

Streaming (pretrain): the main process reads the inputs in record batches and groups the documents into
chunks of about CHUNK_CHARS characters; with workers > 1 a pool of that many processes tokenizes the
chunks, at most IN_FLIGHT x workers of them in flight (`ordered_map`), and the main process receives each chunk's
tokens (one int32 array) in input order, holds out, packs and writes them. Memory is therefore a few
chunks plus the reader's and the writer's buffers, whatever the input size (one document is never split:
a single huge document is tokenized whole). Tokenizing a document does not depend on its neighbours, so
the samples are the same for any worker count or chunk size.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mindscale.io import DataError, publish_folder, write_atomically
from mindscale.train.data import tokenizers
from mindscale.train.data.heldout import VALID_DIR, split_documents
from mindscale.train.data.dataset import FORMAT_VERSION, MANIFEST_NAME, has_checksums, read_manifest, shard_checksums
from mindscale.train.data.raw_text import Source, column, read_batches
from mindscale.train.data.chat_template import get_template
from mindscale.train.data.templates import RecordError, encode_examples

WRITE_BATCH = 1024  # samples per FileWriter.write_raw_data call
READ_BATCH = 256  # records per batch read from an input (datasets' iter); documents are then chunked by size
CHUNK_CHARS = 1 << 21  # pretrain: characters of text per tokenizer task (2 Mi: ~10 ms of pickling, ~1 s to tokenize)
IN_FLIGHT = 4  # chunks per tokenizer process submitted ahead of the one being packed


@dataclass(frozen=True)
class Options:
    """How the inputs become samples (tools/preprocess_data.py's flags of the same names)."""

    mode: str = "pretrain"  # pretrain | sft
    template: str = "alpaca"  # sft: prompt template
    pack: bool = False  # sft: several examples per sample
    shard_size: int = 16384  # samples per MindRecord file
    text_key: str = "text"  # pretrain: column holding the text
    text_unit: str = "document"  # text files: document (a whole file) | paragraph | line
    workers: int = 1  # tokenizer processes (pretrain) or threads (sft)
    valid_fraction: float = 0.0  # pretrain: documents held out into <output>/valid (mindscale/train/data/heldout.py)
    chunk_chars: int = CHUNK_CHARS  # pretrain: characters of text per tokenizer task


def load_tokenizer(path: str, vocab_limit: int | None):
    """The tokenizer at `path` (mindscale/train/data/tokenizers.py), refused when larger than `vocab_limit`
    or without EOS."""
    tokenizer = tokenizers.load_tokenizer(path, "--tokenizer")
    if vocab_limit is not None and tokenizer.vocab_size > vocab_limit:
        raise DataError(
            f"tokenizer {path} has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
            f"{vocab_limit}; train a smaller tokenizer or raise model.vocab_size / --vocab-size"
        )
    if tokenizer.eos_id is None:
        raise DataError(
            f"tokenizer {path} has no EOS id (needed to join documents and end answers); train one "
            "with tools/train_tokenizer.py or set eos_token in the folder's tokenizer_config.json"
        )
    return tokenizer


def pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id."""
    return tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an --output that is a file, or a non-empty folder unless `overwrite`. The folder is replaced
    whole, so `overwrite` takes only a folder this tool wrote: its manifest names every file in it."""
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output} is a file; pass a folder path")
    if not output.is_dir() or not any(output.iterdir()):
        return
    if not overwrite:
        raise DataError(
            f"--output {output} exists and is not empty; pass --overwrite to replace it or choose another folder"
        )
    foreign = sorted(p.name for p in output.iterdir() if p.name not in written_names(output))
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DataError(
            f"--output {output} holds files tools/preprocess_data.py did not write ({listed}); "
            "--overwrite replaces only a folder it wrote: move them out or choose another folder"
        )


def written_names(folder: Path) -> set[str]:
    """The names in `folder` that a preprocessing run wrote, by its manifest (none without one)."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        shards = [shard["file"] for shard in manifest["shards"]]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {MANIFEST_NAME, *shards, *(f"{name}.db" for name in shards), *([VALID_DIR] if "valid" in manifest else [])}


class ShardWriter:
    """Samples into MindRecord files of at most `shard_size` samples each (data_00000.mindrecord, ...)."""

    def __init__(self, folder: Path, schema: dict, shard_size: int, progress=None):
        self.folder, self.schema, self.shard_size = folder, schema, shard_size
        self.progress = progress  # a mindscale.progress.Progress advanced per sample, or None
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
        # hashed while its pages are still in the page cache: the loader checks the shard against these
        self.shards.append({"file": self.name, "samples": self.in_shard, **shard_checksums(self.folder / self.name)})
        self.writer, self.in_shard = None, 0

    def add(self, sample: dict) -> None:
        if self.writer is None:
            from mindspore.mindrecord import FileWriter

            self.name = f"data_{len(self.shards):05d}.mindrecord"
            self.writer = FileWriter(str(self.folder / self.name), shard_num=1, overwrite=False)
            self.writer.add_schema(self.schema, "mindscale_samples")
        self.pending.append(sample)
        self.in_shard += 1
        if self.progress is not None:
            self.progress.advance()
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


def text_chunks(sources: list[Source], options: Options, stats: dict) -> Iterator[list[str]]:
    """The non-empty documents in input order, in lists of about `options.chunk_chars` characters (a list
    ends after the document that reaches it; the last may be shorter)."""
    chunk: list[str] = []
    size = 0
    for source in sources:
        for batch in read_batches(source, options.text_unit, READ_BATCH):
            texts = [t for t in column(batch, options.text_key, source) if t and t.strip()]
            stats["empty_documents_skipped"] += len(batch[options.text_key]) - len(texts)
            stats["documents"] += len(texts)
            for text in texts:
                chunk.append(text)
                size += len(text)
                if size >= options.chunk_chars:
                    yield chunk
                    chunk, size = [], 0
    if chunk:
        yield chunk


def encode_chunk(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of every text followed by EOS, concatenated as int32; each document's end offset)."""
    docs = [np.array(ids + [tokenizer.eos_id], np.int32) for ids in tokenizer.encode(texts)]
    return np.concatenate(docs), np.cumsum([len(d) for d in docs])


_worker_tokenizer = None  # the tokenizer of a pool process (_start_worker)


def _start_worker(path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizers.load_tokenizer(path, "--tokenizer")


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_chunk(_worker_tokenizer, texts)


def ordered_map(function, items: Iterable, workers: int, initializer, initargs: tuple) -> Iterator:
    """function(item) of each item in order, computed by `workers` spawned processes with at most
    IN_FLIGHT x workers items in flight (enough that the workers keep busy while the caller imports
    MindSpore or commits a shard). Not Pool.imap: its feeder thread reads the whole input ahead, so memory
    would grow with the input. Spawned, not forked: the parent may run reader threads (pyarrow) that a
    fork could catch holding a lock; so, as for any spawned pool, a script calling this needs the
    `if __name__ == "__main__":` guard."""
    with multiprocessing.get_context("spawn").Pool(workers, initializer, initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(function, (item,)))
            if len(pending) >= IN_FLIGHT * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def documents(sources: list[Source], options: Options, tokenizer, stats: dict) -> Iterator[list[np.ndarray]]:
    """Token ids of each non-empty document followed by EOS, in input order, one list per chunk of text
    (text_chunks), tokenized in `options.workers` processes (ordered_map) or, for one, in this one."""
    chunks = text_chunks(sources, options, stats)
    if options.workers == 1:
        encoded = (encode_chunk(tokenizer, texts) for texts in chunks)
    else:
        encoded = ordered_map(_encode_in_worker, chunks, options.workers, _start_worker, (str(tokenizer.path),))
    for tokens, ends in encoded:
        yield np.split(tokens, ends[:-1])


class Packer:
    """Documents into samples of seq_length + 1 tokens, consecutive ones overlapping by one token."""

    def __init__(self, seq_length: int, stats: dict):
        self.seq_length, self.stats = seq_length, stats
        self.pending = np.empty(0, np.int32)

    def add(self, docs: list[np.ndarray]) -> Iterator[np.ndarray]:
        """The samples `docs` complete (the rest waits for the next documents)."""
        seq_length = self.seq_length
        self.stats["num_tokens"] += sum(len(d) for d in docs)
        pending = np.concatenate([self.pending, *docs])
        full = (len(pending) - 1) // seq_length
        for k in range(full):
            yield pending[k * seq_length : k * seq_length + seq_length + 1]
        self.pending = pending[full * seq_length :]


def pack_stream(chunks: Iterable[list[np.ndarray]], seq_length: int, stats: dict) -> Iterator[np.ndarray]:
    """Samples of seq_length + 1 tokens from batches of documents (Packer)."""
    packer = Packer(seq_length, stats)
    for docs in chunks:
        yield from packer.add(docs)


# ----------------------------------------------------------------------------------------------
# sft: templated examples with answer-only loss masks, padded or packed


def examples(sources: list[Source], options: Options, tokenizer) -> Iterator[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of every record, rendered with the options' template."""
    template = get_template(options.template, tokenizer)
    for source in sources:
        seen = 0
        for batch in read_batches(source, options.text_unit):
            records = [dict(zip(batch, values)) for values in zip(*batch.values())]
            try:
                yield from encode_examples(records, template, tokenizer, num_threads=options.workers)
            except RecordError as exc:
                raise DataError(
                    f"{source.path} record {seen + exc.index} (0-based): {exc}; fix or remove the record"
                ) from None
            seen += len(records)


def sft_sample(parts: list[tuple[list[int], list[int]]], length: int, pad_id: int, with_segments: bool) -> dict:
    """One sample of `length` tokens from (ids, mask) parts, padded with pad_id (mask and segment 0)."""
    used = sum(len(ids) for ids, _ in parts)
    pad = [0] * (length - used)
    sample = {
        "input_ids": np.array([t for ids, _ in parts for t in ids] + [pad_id] * len(pad), np.int32),
        "loss_mask": np.array([m for _, mask in parts for m in mask] + pad, np.int32),
    }
    if with_segments:
        sample["segment_ids"] = np.array([k + 1 for k, (ids, _) in enumerate(parts) for _ in ids] + pad, np.int32)
    return sample


def sft_samples(
    encoded: Iterable[tuple[list[int], list[int]]], length: int, pad_id: int, pack: bool, stats: dict
) -> Iterator[dict]:
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


def manifest_entries(
    options: Options, sources: list[Source], tokenizer, seq_length: int, pad_id: int, stats: dict
) -> dict:
    """manifest.json of a folder written with `stats` (the training folder's and the held-out one's)."""
    return {
        "format_version": FORMAT_VERSION,
        "mode": options.mode,
        "seq_length": seq_length,
        "sample_length": seq_length + 1,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "pad_id": pad_id,
        "bos_id": tokenizer.bos_id,
        "tokenizer": {"path": str(Path(tokenizer.path).resolve()), "sha256": tokenizer.sha256},
        "sources": [{"path": s.path, "format": s.format} for s in sources],
        "text_key": options.text_key,
        **stats,
    }


def write(
    folder: Path, options: Options, sources: list[Source], tokenizer, seq_length: int, pad_id: int, progress=None
) -> dict:
    """Write the shards into `folder`, advancing `progress` per sample; returns the mode-specific manifest entries."""
    length = seq_length + 1
    fields = (
        ["input_ids"] + (["loss_mask"] if options.mode == "sft" else []) + (["segment_ids"] if options.pack else [])
    )
    schema = {name: {"type": "int32", "shape": [length]} for name in fields}
    writer = ShardWriter(folder, schema, options.shard_size, progress)
    held_out = None
    if options.mode == "pretrain":
        stats = {"documents": 0, "empty_documents_skipped": 0, "num_tokens": 0}
        chunks = documents(sources, options, tokenizer, stats)
        if options.valid_fraction:
            held_out = HeldOutWriter(folder / VALID_DIR, schema, options.shard_size, seq_length, progress)
            chunks = split_documents(chunks, options.valid_fraction, held_out.add)
        for tokens in pack_stream(chunks, seq_length, stats):
            writer.add({"input_ids": tokens})
    else:
        stats = {
            "template": options.template,
            "pack": options.pack,
            "examples": 0,
            "truncated_examples": 0,
            "dropped_examples": 0,
            "num_tokens": 0,
            "loss_tokens": 0,
        }
        for sample in sft_samples(examples(sources, options, tokenizer), length, pad_id, options.pack, stats):
            writer.add(sample)
    shards = writer.close()
    stats.update(fields=fields, shards=shards, num_samples=sum(s["samples"] for s in shards))
    if not stats["num_samples"] and options.mode == "pretrain":
        raise DataError(
            f"the inputs hold {stats['num_tokens']} tokens, too few for one sample of {length}; "
            "add text or lower --seq-length"
        )
    if not stats["num_samples"]:
        raise DataError(
            f"none of {stats['examples']} examples has answer tokens within the first {length} tokens "
            f"({stats['truncated_examples']} truncated); raise --seq-length or shorten the prompts"
        )
    if options.mode == "pretrain":  # num_tokens = num_samples * S + 1 + tail
        stats["tail_tokens_dropped"] = stats["num_tokens"] - stats["num_samples"] * seq_length - 1
    if held_out is not None:
        stats["valid"] = held_out.close(options.valid_fraction, stats)
    return stats


class HeldOutWriter:
    """The documents --valid-fraction holds out (mindscale/train/data/heldout.py), packed and written into their
    own folder as they come, so the training stream never holds them."""

    def __init__(self, folder: Path, schema: dict, shard_size: int, seq_length: int, progress=None):
        folder.mkdir()
        self.writer = ShardWriter(folder, schema, shard_size, progress)
        self.seq_length = seq_length
        self.stats = {"documents": 0, "num_tokens": 0}
        self.packer = Packer(seq_length, self.stats)

    def add(self, docs: list[np.ndarray]) -> None:
        self.stats["documents"] += len(docs)
        for tokens in self.packer.add(docs):
            self.writer.add({"input_ids": tokens})

    def close(self, fraction: float, stats: dict) -> dict:
        """The held-out folder's manifest entries; its documents leave the training folder's count in `stats`."""
        held, shards = self.stats, self.writer.close()
        held.update(
            fraction=fraction, fields=stats["fields"], shards=shards, num_samples=sum(s["samples"] for s in shards)
        )
        stats["documents"] -= held["documents"]
        if not held["num_samples"]:
            raise DataError(
                f"--valid-fraction {fraction} holds out {held['documents']} document(s), "
                f"{held['num_tokens']} tokens: too few for one sample of {self.seq_length + 1}; raise it"
            )
        held["tail_tokens_dropped"] = held["num_tokens"] - held["num_samples"] * self.seq_length - 1
        return held


def preprocess(
    output: Path, options: Options, sources: list[Source], tokenizer, seq_length: int, progress=None
) -> dict:
    """Write the shards and manifest.json of `sources`, encoded with `tokenizer` (load_tokenizer), into the
    folder `output` (replaced only once complete); returns the manifest. `progress` (mindscale.progress) counts
    the samples written."""
    pad_id = pad_id_of(tokenizer)
    os.environ.setdefault("GLOG_v", "3")  # MindRecord's writer logs at INFO/WARNING otherwise
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    partial.mkdir()
    try:
        stats = write(partial, options, sources, tokenizer, seq_length, pad_id, progress)
        valid = stats.pop("valid", None)
        manifest = manifest_entries(options, sources, tokenizer, seq_length, pad_id, stats)
        if valid is not None:  # a data folder of its own (data.valid_path), named in the training manifest
            held_out = manifest_entries(options, sources, tokenizer, seq_length, pad_id, valid)
            (partial / VALID_DIR / MANIFEST_NAME).write_text(json.dumps(held_out, indent=2) + "\n")
            manifest["valid"] = {"path": VALID_DIR, **{k: valid[k] for k in ("fraction", "documents", "num_samples")}}
        (partial / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        publish_folder(partial, output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return manifest


def add_checksums(folder: Path) -> tuple[int, int]:
    """Record the size and checksum of every shard of a folder preprocessed before MindScale kept them (its
    manifest.json rewritten atomically, nothing else touched); returns (shards, bytes hashed), (0, 0) when the
    manifest already records them. The shards are taken as they are now: check them first if in doubt."""
    manifest = read_manifest(folder, "--add-checksums")
    if has_checksums(manifest):
        return 0, 0
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file() or not Path(f"{path}.db").is_file():
            raise DataError(
                f"shard {path} (or its .db index) listed in {folder / MANIFEST_NAME} is missing; "
                "re-run tools/preprocess_data.py"
            )
        shard.update(shard_checksums(path))
    write_atomically(folder / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return len(manifest["shards"]), sum(s["bytes"] + s["db_bytes"] for s in manifest["shards"])
