"""Sample indexes of a run: built once into memory-mapped .npy files in the run folder, read by slices.

    index = SampleIndex.ensure(root, split, sources, seed, shuffle, global_batch, steps)
    source, stored = index.window(first_step, last_step, columns)   # a rank's positions of those steps

Folder `<run>/index/<split>-<digest>/` (split: train or valid; digest: of `key.json`):
- `key.json`: what the index was built from (seed, shuffle, global batch, steps, and per source its path,
  weight, sample count, manifest digest and each shard's size and mtime);
- `built.json`: when, in how long and why it was built: the run log says "built" for an index built since
  the process started (by any rank of the job) and "reused" for an earlier run's;
- `starts.npy`: int64 [steps + 1, K], draws of each source before each step (mindscale/train/data/blend.py);
- `order_<k>.npy` (when shuffled): uint32 (int64 past 2^32 samples), source k's whole epochs back to back (as
  many as the steps draw from it): draw j
  of source k reads stored sample order_k[j]. Epoch e is a permutation of the source's samples seeded by
  (run.seed, k, e); a source drawn past its end wraps into its next epoch.

One process builds (the holder of `<run>/index/.lock`, an flock; the others wait and then reuse), into a
hidden folder renamed when complete. A key that matches is reused; a different one is built under its own
digest, its difference named on one line, and the split's previous folder removed. A folder under this
key's digest that is not this key's index (another key.json, files of other shapes, draws off its weights:
another blend's files) is refused with a DataError, never read or removed. Readers keep their files open
and map only the rows they read (a window at a time), so a rank's resident index memory is its window,
not the run's length.

Permutations are generated in bounded memory and linear time: a source of up to 2^18 samples draws whole
epochs at a time (rows of numpy's `permuted`); a larger one is shuffled per epoch by buckets (each sample
to one of ceil(n / 2^18) random buckets, then each bucket permuted: Rao's method, uniformly random),
written a group of 16 buckets at a time (`_bucket_shuffle`). Files are written and read at offsets, never
mapped by the builder, so its memory is a few chunks (tens of MB) whatever n.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import psutil

from mindscale.io import DataError
from mindscale.train.data.blend import StepCounts, assign, normalized

INDEX_VERSION = 1
CHUNK = 1 << 22  # samples per generated block: the builder's memory
BUCKET = 1 << 18  # samples per shuffled bucket: 1 MiB of uint32 shuffles at ~30 ns a sample here, 4 MiB at ~120
GROUP = CHUNK // BUCKET  # buckets put in order and written together: about CHUNK samples
IOV_MAX = 1024  # buffers of one preadv call (Linux)
BUILT_NAME = "built.json"  # in an index folder: when it was built (time.time()), in how long and why
PROCESS_STARTED = psutil.Process().create_time()  # an index built after this was built by this job


@dataclass(frozen=True)
class IndexSource:
    """One source as the index sees it: its folder, weight and what identifies its contents."""

    path: str
    weight: float
    num_samples: int
    fingerprint: dict  # manifest digest and shard sizes/mtimes: a changed file changes it

    def key(self) -> dict:
        return {"path": self.path, "weight": self.weight, "num_samples": self.num_samples, **self.fingerprint}


def fingerprint(folder: Path, manifest_file: Path, shards: list[str]) -> dict:
    """What identifies a data folder's contents cheaply: the manifest's sha256, each shard's size and mtime."""
    stats = []
    for name in shards:
        for path in (Path(name), Path(f"{name}.db")):
            st = path.stat()
            stats.append([path.name, st.st_size, st.st_mtime_ns])
    return {"manifest_sha256": hashlib.sha256(manifest_file.read_bytes()).hexdigest(), "shards": stats}


def order_dtype(n: int):
    return np.uint32 if n < 2**32 else np.int64


class NpyFile:
    """A 1-D or 2-D .npy file written and read by rows at offsets (pwrite/pread), never mapped: the builder's
    resident memory is the block in hand, not the file."""

    def __init__(self, path: Path, dtype, shape: tuple):
        self.dtype, self.shape = np.dtype(dtype), shape
        self.row = int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        with open(path, "wb") as handle:
            np.lib.format.write_array_header_1_0(
                handle, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape}
            )
            self.offset = handle.tell()
            handle.truncate(self.offset + shape[0] * self.row)
        self.fd = os.open(path, os.O_RDWR)

    def write(self, row: int, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, self.dtype)
        if os.pwrite(self.fd, data, self.offset + row * self.row) != data.nbytes:
            raise OSError(f"short write at row {row}")

    def read(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo, *self.shape[1:]), self.dtype)
        self.scatter(lo, [out])
        return out

    def scatter(self, row: int, buffers: list) -> None:
        """The rows from `row` on into `buffers` one after the other (preadv, IOV_MAX buffers a call)."""
        offset = self.offset + row * self.row
        for first in range(0, len(buffers), IOV_MAX):
            batch = buffers[first : first + IOV_MAX]
            size = sum(memoryview(b).nbytes for b in batch)
            if os.preadv(self.fd, batch, offset) != size:
                raise OSError(f"short read at row {row}")
            offset += size

    def close(self) -> None:
        os.close(self.fd)


def _fill_orders(out: NpyFile, n: int, seed: int, source: int) -> None:
    """Whole epochs of a permutation of range(n) back to back into `out` (length a multiple of n), epoch e
    seeded by (seed, source, e) alone, so a longer run's file starts with a shorter one's; memory bounded
    by CHUNK samples."""
    epochs = out.shape[0] // n
    if n <= BUCKET:
        group = CHUNK // n  # epochs drawn by one generator, a function of n only
        for first in range(0, epochs, group):
            rng = np.random.default_rng([seed, source, first // group])
            # `permuted` shuffles row after row: the first rows do not depend on how many follow (tested)
            count = min(group, epochs - first)
            rows = rng.permuted(np.broadcast_to(np.arange(n, dtype=out.dtype), (count, n)), axis=1)
            out.write(first * n, rows.reshape(-1))
        return
    for epoch in range(epochs):
        _bucket_shuffle(out, epoch * n, n, (seed, source, epoch))


def _bucket_shuffle(out: NpyFile, base: int, n: int, seed: tuple) -> None:
    """A uniformly random permutation of range(n) into rows [base, base + n) of `out`, in memory O(CHUNK)
    and work O(n): each sample goes to one of ceil(n / BUCKET) random buckets (drawn CHUNK samples at a
    time, the draws regenerated rather than stored), bucket b holds its samples in ascending order, then
    each bucket is permuted (small buckets: a shuffle within the CPU's cache). Buckets are handled GROUP at
    a time (about CHUNK samples):

    1. count each chunk's samples per bucket;
    2. sort each chunk's samples by bucket (a stable radix sort of 16-bit draws) and write its share of
       each group into the group's region of `out`, after the earlier chunks' shares;
    3. read each group's region back with the pieces put bucket-major (one preadv: chunk c's piece of
       bucket b after the earlier chunks' pieces, so a bucket is in id order), permute each bucket, write
       the group back in one call.

    Each sample is written twice and read once, all within `out`: nothing else is written (the page cache
    flushes the output only). Calls: (n / CHUNK)^2 writes of a chunk's share of a group (CHUNK^2 / n samples
    each: 21,888 calls for bench/data_index.py's 10^9 samples) and n / CHUNK of whole groups; reads n / CHUNK
    groups, IOV_MAX pieces a call. The bucket-by-bucket writes this replaces numbered (n / CHUNK) x (n / BUCKET),
    16 times as many (bench/changes.md: their share of the time)."""
    buckets = -(-n // BUCKET)
    chunks = range(0, n, CHUNK)
    wide = np.empty(min(CHUNK, n), np.intp)  # numpy's bincount counts intp: cast once, into one buffer

    def draws(c, low):
        rng = np.random.default_rng([*seed, 0, c])
        return rng.integers(0, buckets, min(CHUNK, n - low), dtype=np.uint16 if buckets < 2**16 else np.int64)

    counts = np.empty((len(chunks), buckets), np.int64)  # [chunk, bucket]: samples of chunk c in bucket b
    for c, low in enumerate(chunks):
        drawn = draws(c, low)
        np.copyto(wide[: len(drawn)], drawn)
        counts[c] = np.bincount(wide[: len(drawn)], minlength=buckets)
    del wide
    bucket_start = np.concatenate([[0], np.cumsum(counts.sum(axis=0))])
    groups = [(first, min(first + GROUP, buckets)) for first in range(0, buckets, GROUP)]
    group_counts = np.add.reduceat(counts, [first for first, _ in groups], axis=1)  # [chunk, group]
    earlier = np.cumsum(group_counts, axis=0) - group_counts  # samples of the group from chunks before c
    run = np.empty(min(CHUNK, n), out.dtype)
    for c, low in enumerate(chunks):
        drawn = draws(c, low)
        np.add(np.argsort(drawn, kind="stable"), low, out=run[: len(drawn)], casting="unsafe")
        piece = 0
        for g, (first, _) in enumerate(groups):
            size = group_counts[c, g]
            out.write(base + bucket_start[first] + earlier[c, g], run[piece : piece + size])
            piece += size
    group = np.empty(int(max(bucket_start[last] - bucket_start[first] for first, last in groups)), out.dtype)
    places = memoryview(group)
    for first, last in groups:
        part = counts[:, first:last]  # [chunk, bucket of the group]
        at = bucket_start[first:last] - bucket_start[first] + np.cumsum(part, axis=0) - part  # piece (c, b)'s place
        out.scatter(
            base + bucket_start[first],
            [places[a : a + k] for a, k in zip(at.reshape(-1).tolist(), part.reshape(-1).tolist())],
        )
        for b in range(first, last):
            np.random.default_rng([*seed, 1, b]).shuffle(
                group[bucket_start[b] - bucket_start[first] : bucket_start[b + 1] - bucket_start[first]]
            )
        out.write(base + bucket_start[first], group[: bucket_start[last] - bucket_start[first]])


def _npy_header(handle) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of an open .npy file, which is left at its first row."""
    handle.seek(0)
    version = np.lib.format.read_magic(handle)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(handle)
    return shape, dtype


def _npy_rows(handle, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of an open .npy file, mapped for the copy only."""
    shape, dtype = _npy_header(handle)
    row = int(np.prod(shape[1:], dtype=np.int64))
    hi = min(hi, shape[0])
    if hi <= lo:
        return np.empty((0, *shape[1:]), dtype)
    mapped = np.memmap(
        handle, dtype, "r", offset=handle.tell() + lo * row * dtype.itemsize, shape=(hi - lo, *shape[1:])
    )
    rows = np.array(mapped)
    del mapped
    return rows


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _difference(old: dict, new: dict) -> str:
    """The first thing that differs between two index keys, in words."""
    names = {
        "seed": "run.seed",
        "shuffle": "data.shuffle",
        "global_batch": "the global batch",
        "steps": "the steps indexed (train.steps or train.eval_steps)",
    }
    for key, name in names.items():
        if old.get(key) != new.get(key):
            return f"{name} changed from {old.get(key)} to {new.get(key)}"
    old_sources, new_sources = old.get("sources", []), new.get("sources", [])
    if [s["path"] for s in old_sources] != [s["path"] for s in new_sources]:
        return f"the sources changed from {[s['path'] for s in old_sources]} to {[s['path'] for s in new_sources]}"
    for k, (a, b) in enumerate(zip(old_sources, new_sources)):
        if a["weight"] != b["weight"]:
            return f"source {k} ({b['path']}) weight changed from {a['weight']} to {b['weight']}"
        if a["num_samples"] != b["num_samples"]:
            return f"source {k} ({b['path']}) now holds {b['num_samples']} samples, not {a['num_samples']}"
        if a["manifest_sha256"] != b["manifest_sha256"]:
            return f"source {k} ({b['path']}): manifest.json changed"
        for x, y in zip(a["shards"], b["shards"]):
            if x != y:
                return f"source {k} ({b['path']}): shard {y[0]} changed (size or modification time)"
        if a["shards"] != b["shards"]:
            return f"source {k} ({b['path']}): its shard list changed"
    return "the index format changed"


class SampleIndex:
    """An index folder opened for reading; `window` gives a rank's stored samples step range by step range."""

    def __init__(self, folder: Path, key: dict, note: str):
        self.folder = folder
        self.key = key
        self.note = note  # "reused ..." or "built ..." for the run log
        self.num_samples = [s["num_samples"] for s in key["sources"]]
        self.global_batch = key["global_batch"]
        self.steps = key["steps"]
        # opened once: a rebuild elsewhere may remove the folder; open files stay readable. Reading moves a
        # file's position: the loader's thread (window) and the trainer's (drawn) take turns
        self._reading = threading.Lock()
        self._starts = open(folder / "starts.npy", "rb")
        self._orders = [
            open(folder / f"order_{k}.npy", "rb") if key["shuffle"] else None for k in range(len(self.num_samples))
        ]

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def ensure(
        cls,
        root: Path,
        split: str,
        sources: list[IndexSource],
        seed: int,
        shuffle: bool,
        global_batch: int,
        steps: int,
        say=print,
        before_build=lambda: None,
    ) -> "SampleIndex":
        """The index of this key under `root`, built by whichever process gets the lock first, which calls
        `before_build` first (the loader's checksum check: a failure there builds nothing)."""
        key = {
            "version": INDEX_VERSION,
            "split": split,
            "seed": seed,
            "shuffle": shuffle,
            "global_batch": global_batch,
            "steps": steps,
            "sources": [s.key() for s in sources],
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        folder = root / f"{split}-{digest}"
        with _locked(root / ".lock"):
            if folder.exists():  # named by its key's digest: another key.json or other files came from elsewhere
                _check_folder(folder, key)
                return cls(folder, key, _found_note(folder))
            current = root / f"{split}.json"  # which folder is the split's newest
            previous = json.loads(current.read_text()) if current.is_file() else None
            why = "no index yet" if previous is None else _difference(previous["key"], key)
            before_build()
            began = time.perf_counter()
            say(f"data index ({split}): {why}; building {folder}")
            _build(folder, key, sources, why, began)
            current.write_text(json.dumps({"folder": folder.name, "key": key}))
            if previous is not None and previous["folder"] != folder.name:
                shutil.rmtree(root / previous["folder"], ignore_errors=True)
            return cls(folder, key, _found_note(folder))

    # -- reading ----------------------------------------------------------------------------------
    def starts(self, lo: int, hi: int) -> np.ndarray:
        """Draws of each source before steps lo..hi-1 (int64 [hi - lo, K])."""
        with self._reading:
            return _npy_rows(self._starts, lo, hi)

    def drawn(self, step: int) -> np.ndarray:
        """Samples drawn from each source by the end of step `step` (1-based, i.e. before step index `step`)."""
        return self.starts(step, step + 1)[0]

    def window(self, lo: int, hi: int, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Steps [lo, hi), the in-step positions `columns`: (source, stored sample index), flat in stream order."""
        if hi > self.steps:
            raise IndexError(f"step {hi} is past the {self.steps} steps this index covers")
        source, draw = assign(self.starts(lo, hi + 1), columns)
        source, draw = source.reshape(-1), draw.reshape(-1)
        stored = np.empty(len(draw), np.int64)
        for k, n in enumerate(self.num_samples):
            mine = source == k
            if not mine.any():
                continue
            if self._orders[k] is None:
                stored[mine] = draw[mine] % n
            else:
                first = int(draw[mine].min())
                with self._reading:
                    rows = _npy_rows(self._orders[k], first, int(draw[mine].max()) + 1)
                stored[mine] = rows[draw[mine] - first]
        return source, stored

    def close(self) -> None:
        for handle in [self._starts, *self._orders]:
            if handle is not None:
                handle.close()

    def __del__(self):  # a validation pass opens a stream per pass: its files close with it
        self.close()


def _read_key(folder: Path) -> Optional[dict]:
    try:
        return json.loads((folder / "key.json").read_text())
    except (OSError, ValueError):
        return None


def _check_folder(folder: Path, key: dict) -> None:
    """An existing index folder must be this key's: its key.json, and files of the shapes the key implies with
    draw counts that follow its weights (every source within one sample of its share). An index folder of
    another blend in its place (copied or edited files) is refused in one line, never read or removed."""
    fix = f"delete {folder} and the next run builds it anew"
    found = _read_key(folder)
    if found != key:
        why = "is unreadable" if found is None else f"differs: {_difference(found, key)}"
        raise DataError(
            f"index folder {folder} is not this data's index (its key.json {why}); it was copied or edited: {fix}"
        )
    steps, sources = key["steps"], key["sources"]
    _check_header(folder, "starts.npy", (steps + 1, len(sources)), np.int64, fix)
    with open(folder / "starts.npy", "rb") as handle:
        total = _npy_rows(handle, steps, steps + 1)[0]
    if np.abs(total - normalized([s["weight"] for s in sources]) * steps * key["global_batch"]).max() >= 1:
        raise DataError(
            f"index folder {folder}: the draws in starts.npy do not follow its key.json's weights "
            f"(another blend's index?); {fix}"
        )
    for k, source in enumerate(sources if key["shuffle"] else ()):
        n = source["num_samples"]
        _check_header(folder, f"order_{k}.npy", (max(-(-int(total[k]) // n), 1) * n,), order_dtype(n), fix)


def _check_header(folder: Path, name: str, shape: tuple, dtype, fix: str) -> None:
    try:
        with open(folder / name, "rb") as handle:
            found, found_dtype = _npy_header(handle)
    except (OSError, ValueError) as exc:
        raise DataError(f"index folder {folder}: {name} is unreadable ({str(exc).splitlines()[0]}); {fix}")
    if (found, found_dtype) != (shape, np.dtype(dtype)):
        raise DataError(
            f"index folder {folder}: {name} holds {found} {found_dtype}, not the {shape} "
            f"{np.dtype(dtype)} its key.json implies (another blend's index?); {fix}"
        )


def _found_note(folder: Path) -> str:
    """The run log's word on an index folder: "built" when it was built since this process started (by it,
    or by another rank of the same job that took the lock first), else "reused" (an earlier run's)."""
    try:
        built = json.loads((folder / BUILT_NAME).read_text())
    except (OSError, ValueError):  # an index of an older MindScale: it predates this process
        built = None
    if built is None or built["at"] < PROCESS_STARTED:
        return f"reused {folder}"
    return f"built {folder} in {built['seconds']:.1f} s ({built['why']})"


def _build(folder: Path, key: dict, sources: list[IndexSource], why: str, began: float) -> None:
    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    partial.mkdir(parents=True)
    steps, k = key["steps"], len(sources)
    starts = NpyFile(partial / "starts.npy", np.int64, (steps + 1, k))
    row = 0
    for block in StepCounts([s.weight for s in sources], key["global_batch"]).starts(steps):
        starts.write(row, block)
        row += len(block)
    total = starts.read(steps, steps + 1)[0]
    starts.close()
    if key["shuffle"]:
        for k, source in enumerate(sources):
            n = source.num_samples
            epochs = max(-(-int(total[k]) // n), 1)  # whole epochs
            out = NpyFile(partial / f"order_{k}.npy", order_dtype(n), (epochs * n,))
            _fill_orders(out, n, key["seed"], k)
            out.close()
    (partial / "key.json").write_text(json.dumps(key))
    (partial / BUILT_NAME).write_text(
        json.dumps({"at": time.time(), "seconds": time.perf_counter() - began, "why": why})
    )
    partial.rename(folder)
