"""Training data: the MindRecord sample format, its manifest, and the batches the trainer consumes.

A data folder written by tools/preprocess_data.py holds MindRecord shards of fixed-length samples
(`input_ids` int32 [seq_length + 1]; SFT adds `loss_mask` and, when packed, `segment_ids`) and a
`manifest.json`. `build_dataset(cfg, rank, world, start_step)` yields this worker's batches (`make_batch`):
`tokens` int32 [rows, seq_length + 1] as stored (the loss network shifts them into inputs and labels), and
for SFT data `loss_mask` float32 [rows, seq_length] and, when packed, `segment_ids` int32 [rows, seq_length].

Sample order (see docs/data.md): every sample has a position in one global stream. The stream draws from
one folder (data.path) or a weighted blend of folders (data.blend); mindscale/train/data/blend.py decides
which source each position draws from (per step of G = the global batch size: counts within one sample of
weight x position at every step boundary), and source k's draws walk through its epochs, epoch e a
permutation of its stored samples seeded by (run.seed, k, e) (the stored order when data.shuffle is
false). Both are built once into memory-mapped index files in the run folder (mindscale/train/data/index.py)
and read a window of steps at a time. Optimizer step s takes stream positions [s*G, (s+1)*G); micro step
m of that step takes the next world*rows of them and rank r takes rows [r*rows, (r+1)*rows) of those.
Hence the order depends only on the seed, the data and G: one worker with a big batch, several workers
with small ones, or gradient accumulation see the same samples in the same steps, and resuming at step k
is the same as running through k steps. Sharding is done here rather than by MindDataset's
num_shards/shard_id, whose shard split would not have this property; MindSpore's dataset API reads the
chosen records (MindDataset with a SubsetSampler over one window's indices), in the given order whatever
its number of parallel workers.

Damaged shards are refused before MindDataset reads them: MindSpore 2.9's reader ends the process with a
segmentation fault on a truncated or overwritten shard read on the loader's thread (once any dataset was
opened before in the process), which Python cannot catch. Every start compares each shard's size with the
manifest; the process that builds the run's index first hashes every shard against the manifest's
checksum (`verify_checksums`); each batch's token ids are range-checked (`DataStream.check_token_ids`).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from mindscale.config import Config
from mindscale.io import DataError
from mindscale.train.data.index import IndexSource, SampleIndex, fingerprint

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
SYNTHETIC = "synthetic"
MANIFEST_KEYS = (
    "format_version",
    "mode",
    "seq_length",
    "num_samples",
    "vocab_size",
    "eos_id",
    "pad_id",
    "tokenizer",
    "fields",
    "shards",
)
PREPROCESS_HINT = "tools/preprocess_data.py --input ... --tokenizer ... --output DIR"
CHECKSUM = "xxh3_128"  # a shard's digest in the manifest: it finds damaged bytes, not deliberate edits
HASH_BLOCK = 1 << 20  # bytes hashed (and read) per block: a block in a sparse file's hole is not read
SHARD_FILES = (("", ""), ("db_", ".db"))  # (manifest key prefix, file suffix): the shard and its index
DAMAGED_FIX = "copy the folder again from where it was made, or re-run tools/preprocess_data.py"


def file_checksum(path: Path) -> str:
    """The xxh3_128 (xxhash) of the xxh3_128 digests of a file's HASH_BLOCK-byte blocks (the last one shorter)
    in order: a digest of its bytes whatever the file system stores. A block inside a hole of a sparse file is
    zeros, its digest known without reading: MindRecord preallocates 48 MiB of pages per shard, mostly holes in a
    small one. xxh3 hashes 4.9 GB/s in memory on the test host, hashlib's sha256 0.4 (BENCHMARKS.md, "Shard
    checksums"): the read is the cost."""
    import xxhash

    whole = xxhash.xxh3_128()
    buffer = bytearray(HASH_BLOCK)
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        for offset in range(0, size, HASH_BLOCK):
            length = min(HASH_BLOCK, size - offset)
            if _in_hole(handle.fileno(), offset, length):
                whole.update(_zeros_digest(length))
                continue
            view = memoryview(buffer)[:length]
            if os.preadv(handle.fileno(), [view], offset) != length:
                raise DataError(f"{path} changed while it was hashed; run again")
            whole.update(xxhash.xxh3_128(view).digest())
    return whole.hexdigest()


def _in_hole(fd: int, offset: int, length: int) -> bool:
    """Whether the file holds no data in [offset, offset + length): a hole reads as zeros."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + length
    except OSError as exc:  # ENXIO: no data after offset; a file system without SEEK_DATA reads every block
        return exc.errno == errno.ENXIO


@functools.lru_cache(maxsize=4)
def _zeros_digest(length: int) -> bytes:
    import xxhash

    return xxhash.xxh3_128(bytes(length)).digest()


def shard_checksums(path: Path) -> dict:
    """A shard's manifest entries beside file and samples: the size and checksum of the MindRecord file and of
    its .db index."""
    entries = {}
    for prefix, suffix in SHARD_FILES:
        file = Path(f"{path}{suffix}")
        entries.update({f"{prefix}bytes": file.stat().st_size, f"{prefix}{CHECKSUM}": file_checksum(file)})
    return entries


def has_checksums(manifest: dict) -> bool:
    return all(CHECKSUM in shard for shard in manifest["shards"])


def read_manifest(path: str | Path, key: str = "data.path") -> dict:
    """The manifest of a data folder (or of the manifest file itself), checked for its keys; `key` names the
    config key that gave the folder in errors."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"{key}={path} does not exist; create it with {PREPROCESS_HINT}"
            + (" or set data.path=synthetic" if key == "data.path" else "")
        )
    manifest_path = path / MANIFEST_NAME if path.is_dir() else path
    if path.is_dir() and not any(path.iterdir()):
        raise DataError(f"{key}={path} is empty; create it with {PREPROCESS_HINT}")
    if not manifest_path.is_file():
        raise DataError(
            f"{manifest_path} is missing; {path} was not written by tools/preprocess_data.py "
            "(re-run it into an empty folder)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{manifest_path} is not readable JSON ({exc}); re-run tools/preprocess_data.py")
    missing = [key for key in MANIFEST_KEYS if key not in manifest] if isinstance(manifest, dict) else MANIFEST_KEYS
    if missing:
        raise DataError(f"{manifest_path} lacks {list(missing)}; re-run tools/preprocess_data.py")
    if manifest["format_version"] != FORMAT_VERSION:
        raise DataError(
            f"{manifest_path} has format_version {manifest['format_version']}, this MindScale reads "
            f"{FORMAT_VERSION}; re-run tools/preprocess_data.py"
        )
    return manifest


def check_tokenizer(cfg: Config) -> Optional[str]:
    """sha256 of data.tokenizer (a .model file or a Hugging Face folder) after checking its vocabulary fits
    the model (None when unset)."""
    if not cfg.data.tokenizer:
        return None
    from mindscale.train.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"data.tokenizer={cfg.data.tokenizer} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size} "
            "or use a smaller tokenizer"
        )
    return tokenizer.sha256


def check_special_ids(cfg: Config, eos_id: int, pad_id: int, mode: str, where: str) -> None:
    """The data's EOS (and, for padded SFT data, pad) id must be the config's: generation stops on data.eos_id."""
    if eos_id != cfg.data.eos_id:
        raise DataError(f"{where} uses eos_id {eos_id} but data.eos_id={cfg.data.eos_id}; set data.eos_id={eos_id}")
    if mode == "sft" and pad_id != cfg.data.pad_id:
        raise DataError(f"{where} pads with id {pad_id} but data.pad_id={cfg.data.pad_id}; set data.pad_id={pad_id}")


def check_manifest(cfg: Config, manifest: dict, folder: Path) -> list[str]:
    """Match a manifest against the config; returns the shard files in stream order."""
    where = folder / MANIFEST_NAME
    if manifest["seq_length"] != cfg.model.seq_length:
        raise DataError(
            f"{where} has seq_length {manifest['seq_length']} but model.seq_length="
            f"{cfg.model.seq_length}; re-run tools/preprocess_data.py --seq-length "
            f"{cfg.model.seq_length} or set model.seq_length={manifest['seq_length']}"
        )
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise DataError(
            f"{where} was tokenized with a {manifest['vocab_size']}-token vocabulary but "
            f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {manifest['vocab_size']}"
        )
    tokenizer_hash = check_tokenizer(cfg)
    if tokenizer_hash is not None and tokenizer_hash != manifest["tokenizer"].get("sha256"):
        raise DataError(
            f"data.tokenizer={cfg.data.tokenizer} is not the tokenizer {where} was made with "
            f"({manifest['tokenizer'].get('path')}); point data.tokenizer at that one or re-run "
            "tools/preprocess_data.py with this tokenizer"
        )
    check_special_ids(cfg, manifest["eos_id"], manifest["pad_id"], manifest["mode"], str(where))
    if manifest["num_samples"] < 1:
        raise DataError(f"{where} lists no samples; re-run tools/preprocess_data.py with more text")
    files = []
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file() or not Path(f"{path}.db").is_file():
            raise DataError(
                f"shard {path} (or its .db index) listed in {where} is missing; re-run tools/preprocess_data.py"
            )
        _check_sizes(path, shard, where)
        files.append(str(path))
    return files


def _check_sizes(path: Path, shard: dict, where: Path) -> None:
    """A shard (and its .db) must have the size its manifest records, when it records one: a truncated file is
    found here, at no cost, rather than by MindSpore's reader, which crashes the process on it."""
    for prefix, suffix in SHARD_FILES:
        file, recorded = Path(f"{path}{suffix}"), shard.get(f"{prefix}bytes")
        if recorded is not None and file.stat().st_size != recorded:
            raise DataError(
                f"shard {file} holds {file.stat().st_size:,} bytes but {where} records {recorded:,}: "
                f"it was cut short or changed after preprocessing; {DAMAGED_FIX}"
            )


def verify_checksums(sources: list["DataSource"], split: str, say=print) -> None:
    """Hash every shard of `sources` (and its .db) and compare with its manifest (DataError naming the first
    that differs); one line says what was checked and what it cost, one more names the folders whose manifest
    records no checksums (they load unchecked)."""
    began, hashed, shards, unchecked = time.perf_counter(), 0, 0, []
    for source in sources:
        folder = Path(source.files[0]).parent
        if not has_checksums(source.manifest):
            unchecked.append(str(folder))
            continue
        for path, shard in zip(source.files, source.manifest["shards"]):
            for prefix, suffix in SHARD_FILES:
                file = Path(f"{path}{suffix}")
                if file_checksum(file) != shard[f"{prefix}{CHECKSUM}"]:
                    raise DataError(
                        f"shard {file} does not match its {CHECKSUM} checksum in {folder / MANIFEST_NAME}"
                        f": its bytes changed after preprocessing; {DAMAGED_FIX}"
                    )
                hashed += shard[f"{prefix}bytes"]
            shards += 1
    if shards:
        say(
            f"data ({split}): {shards} shard(s) match their checksums ({hashed / 1e9:.2f} GB in "
            f"{time.perf_counter() - began:.1f} s, {CHECKSUM})"
        )
    if unchecked:
        say(
            f"data ({split}): not checked, their manifest.json records no shard checksums (written before MindScale "
            f"kept them): {', '.join(unchecked)}; add them with tools/preprocess_data.py --add-checksums FOLDER"
        )


@dataclass(frozen=True)
class BatchPlan:
    """Which positions of the global sample stream this rank reads, `rows` at a time."""

    global_batch: int  # samples per optimizer step, all ranks and micro steps
    rows: int  # samples per batch yielded on one rank
    world: int
    rank: int

    def mine(self, positions: np.ndarray) -> np.ndarray:
        """The positions (ascending) that belong to this rank."""
        in_micro_step = (positions % self.global_batch) % (self.world * self.rows)
        return positions[in_micro_step // self.rows == self.rank]


def batch_plan(cfg: Config, rank: int, world: int) -> BatchPlan:
    """Rows per batch = Config.samples_per_step / (world x gradient_accumulation_steps).

    `world` is the data-parallel degree and `rank` a rank's data-parallel index (Layout.data_rank):
    the trainer feeds the model-parallel ranks of a group, and the ranks of every pipeline stage, the
    same rows, and MindSpore splits each input over data parallel only (dataset strategy (dp, 1)).
    With a pipeline that is micro_batch_size x micro_batch_num rows per step.
    """
    accumulation = cfg.parallel.gradient_accumulation_steps
    if not 0 <= rank < world:
        raise DataError(f"rank {rank} is outside a world of {world} workers")
    if cfg.samples_per_step % (world * accumulation):
        raise DataError(
            f"global batch {cfg.samples_per_step} does not split over {world} workers x "
            f"parallel.gradient_accumulation_steps={accumulation}; change train.micro_batch_size"
        )
    return BatchPlan(cfg.samples_per_step, cfg.samples_per_step // (world * accumulation), world, rank)


class DataStream:
    """Iterable of batches for one rank, starting at optimizer step `start_step`, to the end of the steps
    its index covers. `sources` (empty for synthetic data) and `index` say what it draws."""

    def __init__(
        self,
        plan: BatchPlan,
        rows: Iterator[dict],
        manifest: Optional[dict],
        sources: tuple = (),
        index: Optional[SampleIndex] = None,
    ):
        self.plan = plan
        self.manifest = manifest  # None for synthetic data; the first source's with a blend
        self.sources = sources
        self.index = index
        self._rows = rows

    def __iter__(self) -> Iterator[dict]:
        """The batches, read ahead on a thread of their own (`prefetched`): one iteration per stream. Stored
        batches have their token ids range-checked (`check_token_ids`) before they are handed over."""

        def batches():
            while True:
                rows = [next(self._rows) for _ in range(self.plan.rows)]
                batch = make_batch(rows)
                if self.sources:
                    self.check_token_ids(batch["tokens"], rows)
                yield batch

        micro_steps = self.plan.global_batch // (self.plan.world * self.plan.rows)
        return prefetched(batches(), PREFETCH_STEPS * micro_steps)

    def drawn(self, step: int) -> dict[str, int]:
        """Samples drawn from each source (by its config path) in steps 1..`step`; {} for synthetic data."""
        if self.index is None:
            return {}
        return {source.path: int(n) for source, n in zip(self.sources, self.index.drawn(step))}

    def describe(self) -> str:
        """One line for the run log: each source's share, samples and epochs over the indexed steps (MindRecord
        data only)."""
        total = self.drawn(self.index.steps)
        blend = len(self.sources) > 1
        parts = [
            f"{s.path} {f'{s.weight / sum(x.weight for x in self.sources):.1%} ' if blend else ''}"
            f"({total[s.path]} samples of {s.manifest['num_samples']}, "
            f"{total[s.path] / s.manifest['num_samples']:.2f} epochs)"
            for s in self.sources
        ]
        return (
            f"data: {'blend of ' if blend else ''}{'; '.join(parts)} over {self.index.steps} steps; "
            f"index {self.index.note}"
        )

    def check_token_ids(self, tokens: np.ndarray, rows: list[dict]) -> None:
        """Every id of a stored batch must lie in [0, vocab_size) of its manifest: an id outside would index past
        the embedding table. One vectorised pass (negative ids, seen as unsigned, are large); the offending
        sample is then named by its shard (DataError)."""
        vocab = self.manifest["vocab_size"]
        if int(tokens.view(np.uint32).max()) < vocab:
            return
        row = int(np.flatnonzero((tokens.view(np.uint32) >= vocab).any(axis=1))[0])
        k, stored = rows[row]["origin"]
        source = self.sources[k]
        shard, within = shard_of(source.manifest, stored)
        bad = int(tokens[row][(tokens[row] < 0) | (tokens[row] >= vocab)][0])
        raise DataError(
            f"sample {within} of shard {Path(source.files[0]).parent / shard} holds token id {bad}, "
            f"outside the vocabulary of {vocab} its manifest records: the shard is damaged or was "
            f"not written by tools/preprocess_data.py with that tokenizer; {DAMAGED_FIX}"
        )


def shard_of(manifest: dict, stored: int) -> tuple[str, int]:
    """(shard file, sample within it) of a folder's stored sample `stored`."""
    for shard in manifest["shards"]:
        if stored < shard["samples"]:
            return shard["file"], stored
        stored -= shard["samples"]
    raise IndexError(f"sample {stored} is past the folder's samples")


PREFETCH_STEPS = 2  # optimizer steps of batches a rank reads ahead


def prefetched(batches: Iterator[dict], depth: int) -> Iterator[dict]:
    """`batches` in the same order, read on a background thread at most `depth` ahead. MindSpore runs a
    step with the GIL released, so the next step's samples are read meanwhile and the training loop finds
    them ready: reading through MindDataset hands each row over between threads, and on a host whose cores
    the workers keep busy every hand-off can wait for a core (BENCHMARKS.md section 9). An exception of the
    reader (the DataError at the end of the stream) is raised here when its batch is due. Closing this
    generator (or dropping it) stops the thread and waits for it."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def offer(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for batch in batches:
                if not offer((batch, None)):
                    return
            offer((None, None))  # the end: the consumer returns, rather than wait for a batch never read
        except BaseException as exc:  # noqa: BLE001 -- handed to the consumer, raised there
            offer((None, exc))

    reader = threading.Thread(target=read, name="mindscale-data", daemon=True)
    reader.start()
    try:
        while True:
            batch, error = ready.get()
            if error is not None:
                raise error
            if batch is None:
                return
            yield batch
    finally:
        stop.set()
        # out of MindDataset before the caller goes on: a thread still inside it when the interpreter exits
        # crashed the process (SIGSEGV after a graceful stop, seen in tests/integration/test_training.py)
        reader.join(timeout=60)


def make_batch(rows: list[dict]) -> dict:
    """Stored [S+1] rows -> the step's inputs: tokens [rows, S+1] as stored (the loss network shifts them
    into inputs and labels, models.transformer.NextTokenLoss), and for SFT data a float loss mask [rows, S]
    aligned with the labels. Pretraining samples are packed without padding: every label is trained, and
    no mask is fed (each input of the step costs compile time per micro batch, docs/dryrun.md)."""
    batch = {"tokens": np.stack([row["input_ids"] for row in rows]).astype(np.int32)}
    if "loss_mask" in rows[0]:
        # the stored mask marks answer tokens; position t is trained when the token it predicts (t+1) is one
        mask = np.stack([row["loss_mask"] for row in rows])[:, 1:]
        batch["loss_mask"] = np.ascontiguousarray(mask, dtype=np.float32)
    if "segment_ids" in rows[0]:
        batch["segment_ids"] = np.ascontiguousarray(
            np.stack([row["segment_ids"] for row in rows])[:, :-1], dtype=np.int32
        )
    return batch


def step_rows(micro: list[dict], max_examples: Optional[int] = None) -> tuple[np.ndarray, ...]:
    """A step's inputs from its micro batches, each stacked along rows, in the order the train step (and the
    validation step) take them: tokens[, loss_mask][, segment_ids]. `max_examples`: the most packed
    examples a row may hold (Layout.packed_examples), else any number."""
    most = max(int(m["segment_ids"].max()) for m in micro) if "segment_ids" in micro[0] else 0
    if max_examples is not None and most > max_examples:  # packed examples are numbered 1, 2, ... in each row
        raise DataError(
            f"a packed sample holds {most} examples, more than data.max_packed_examples={max_examples} "
            "(the example ends flash attention's TND layout takes per row); raise it "
            "(train.micro_batch_size x (it + 1) <= 1024) or set model.attention=composite"
        )
    return tuple(
        np.concatenate([m[key] for m in micro]) for key in ("tokens", "loss_mask", "segment_ids") if key in micro[0]
    )


def _synthetic_rows(cfg: Config, plan: BatchPlan, start: int) -> Iterator[dict]:
    """Megatron-style mock data: sample at stream position p is random ids in [0, vocab) seeded by (seed, p)."""
    length, vocab = cfg.model.seq_length + 1, cfg.model.vocab_size
    chunk = plan.global_batch * 16
    for low in count(start, chunk):
        for position in plan.mine(np.arange(low, low + chunk)):
            rng = np.random.default_rng([cfg.run.seed, int(position)])
            yield {"input_ids": rng.integers(0, vocab, length, dtype=np.int32)}


def _open_mindrecord(files: list[str], fields: list[str], indices: Optional[np.ndarray] = None):
    import mindspore.dataset as ds

    sampler = ds.SubsetSampler(indices.tolist()) if indices is not None else None
    return ds.MindDataset(
        files, columns_list=fields, sampler=sampler, shuffle=False if sampler is None else None, num_parallel_workers=1
    )


@dataclass(frozen=True)
class DataSource:
    """One MindRecord folder of a stream, checked against the config."""

    key: str  # the config key that names it: data.path, data.blend[1].path, ...
    path: str  # as configured
    weight: float
    manifest: dict
    files: tuple

    def index_source(self) -> IndexSource:
        folder = Path(self.files[0]).parent
        return IndexSource(
            str(folder.resolve()),
            self.weight,
            self.manifest["num_samples"],
            fingerprint(folder, folder / MANIFEST_NAME, list(self.files)),
        )


def configured_sources(cfg: Config, split: str = "train") -> list[tuple[str, str, float]]:
    """(config key, path, weight) of each source of a split: data.blend / data.valid_blend entries, or the
    single folder data.path / data.valid_path with weight 1."""
    blend, single = ("blend", "path") if split == "train" else ("valid_blend", "valid_path")
    entries = getattr(cfg.data, blend)
    if entries:
        return [(f"data.{blend}[{i}].path", e.path, e.weight) for i, e in enumerate(entries)]
    return [(f"data.{single}", getattr(cfg.data, single), 1.0)]


def open_sources(cfg: Config, split: str = "train") -> list[DataSource]:
    """The split's sources, each checked against the config and, in a blend, against the first."""
    sources = []
    for key, path, weight in configured_sources(cfg, split):
        folder = Path(path)
        manifest = read_manifest(folder, key)
        folder = folder if folder.is_dir() else folder.parent
        files = _verified_shards(cfg, folder, manifest)
        if sources:
            _check_blendable(sources[0], key, path, manifest)
        sources.append(DataSource(key, path, weight, manifest, tuple(files)))
    return sources


def _check_blendable(first: DataSource, key: str, path: str, manifest: dict) -> None:
    """Sources of one blend must be made alike: mode, fields, sequence length and tokenizer."""
    for name, what in (
        ("mode", "mode"),
        ("fields", "fields"),
        ("seq_length", "seq_length"),
        ("vocab_size", "vocab_size"),
    ):
        if manifest[name] != first.manifest[name]:
            raise DataError(
                f"{key}={path} has {what} {manifest[name]} but {first.key}={first.path} has "
                f"{first.manifest[name]}; preprocess every source of a blend the same way"
            )
    ours, theirs = manifest["tokenizer"].get("sha256"), first.manifest["tokenizer"].get("sha256")
    if ours != theirs:
        raise DataError(
            f"{key}={path} was tokenized with {manifest['tokenizer'].get('path')} but {first.key}="
            f"{first.path} with {first.manifest['tokenizer'].get('path')} (sha256 differs); "
            "preprocess every source of a blend with one tokenizer"
        )


def _read_records(files: list[str], fields: list[str], indices: np.ndarray, num_samples: int) -> Iterator[dict]:
    """The records at `indices`, in that order; MindRecord's sampler takes at most num_samples indices per
    dataset (a small source wraps several times within a window)."""
    for low in range(0, len(indices), num_samples):
        dataset = _open_mindrecord(files, fields, indices[low : low + num_samples])
        yield from dataset.create_dict_iterator(output_numpy=True, num_epochs=1)


WINDOW = 1 << 16  # stream positions per index window (a few steps): what a rank maps and reads at a time


def _indexed_rows(sources: list[DataSource], index: SampleIndex, plan: BatchPlan, start_step: int) -> Iterator[dict]:
    """This rank's stored rows in stream order from `start_step`: a window of steps at a time, each source's
    records of the window read by one MindDataset (SubsetSampler over those indices), merged by position."""
    columns = plan.mine(np.arange(plan.global_batch))
    steps = max(1, WINDOW // plan.global_batch)
    fields = list(sources[0].manifest["fields"])
    for low in range(start_step, index.steps, steps):
        source, stored = index.window(low, min(low + steps, index.steps), columns)
        readers = [
            _read_records(list(s.files), fields, stored[source == k], s.manifest["num_samples"])
            for k, s in enumerate(sources)
        ]
        for k, index_in_source in zip(source.tolist(), stored.tolist()):
            record = next(readers[k])
            record["origin"] = (k, index_in_source)  # names the sample should its token ids be out of range
            yield record
    raise DataError(
        f"the data stream ends after the {index.steps} steps its index covers; raise train.steps "
        "(the index is rebuilt for the new length)"
    )


def stored_stream(source: DataSource, plan: BatchPlan, steps: int) -> DataStream:
    """This rank's batches of the first `steps` x G samples of one checked source in stored order, read
    without an index: a held-out blend's pass validates a source at a time (mindscale/train/loop/evaluate.py).
    The caller makes sure the source holds them."""

    def rows() -> Iterator[dict]:
        positions = plan.mine(np.arange(steps * plan.global_batch))
        records = _read_records(
            list(source.files), list(source.manifest["fields"]), positions, source.manifest["num_samples"]
        )
        for record, stored in zip(records, positions.tolist()):
            record["origin"] = (0, stored)
            yield record
        raise DataError(f"the held-out stream of {source.key}={source.path} ends after {steps} steps")

    return DataStream(plan, rows(), source.manifest, (source,))


def _verified_shards(cfg: Config, folder: Path, manifest: dict) -> list[str]:
    files = check_manifest(cfg, manifest, folder)
    try:
        stored = _open_mindrecord(files, list(manifest["fields"])).get_dataset_size()
    except RuntimeError as exc:
        raise DataError(
            f"cannot read the MindRecord shards in {folder} ({str(exc).strip().splitlines()[0]}); "
            "re-run tools/preprocess_data.py"
        )
    if stored != manifest["num_samples"]:
        raise DataError(
            f"{folder} holds {stored} samples but its manifest lists {manifest['num_samples']}; "
            "the folder was changed after preprocessing, re-run tools/preprocess_data.py"
        )
    return files


def build_dataset(
    cfg: Config, rank: int = 0, world: int = 1, start_step: int = 0, split: str = "train", say=print
) -> DataStream:
    """This rank's batches from optimizer step `start_step` on; checks the data against the config first
    (and the shards' sizes; their checksums when this process builds the split's index). split "train" reads
    data.path / data.blend for train.steps steps, "valid" data.valid_path / data.valid_blend for
    train.eval_steps (the caller turns shuffling off: evaluate.held_out_config)."""
    plan = batch_plan(cfg, rank, world)
    if split == "train" and cfg.data.path == SYNTHETIC and not cfg.data.blend:
        check_tokenizer(cfg)
        return DataStream(plan, _synthetic_rows(cfg, plan, start_step * plan.global_batch), None)
    sources = open_sources(cfg, split)
    steps = cfg.train.steps if split == "train" else cfg.train.eval_steps

    def verify() -> None:  # by the process that builds the index, before it does (a resume reuses both)
        if cfg.data.verify_checksums:
            verify_checksums(sources, split, say)

    index = SampleIndex.ensure(
        cfg.run_dir / "index",
        split,
        [s.index_source() for s in sources],
        cfg.run.seed,
        cfg.data.shuffle,
        plan.global_batch,
        steps,
        say,
        before_build=verify,
    )
    rows = _indexed_rows(sources, index, plan, start_step)
    return DataStream(plan, rows, sources[0].manifest, tuple(sources), index)
