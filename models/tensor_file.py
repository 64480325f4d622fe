"""Checkpoint tensors read in parts: safetensors files (MindScale, Hugging Face, MindFormers), for any
dtype they use.

Opening a file reads its header alone. Each tensor is then a lazy tensor: its `shape`, and `[index]`
reads that part and nothing else, one `pread` per contiguous run of bytes, so a sharded rank loading
a 70B checkpoint reads its share, not the whole file (the kernel counts those bytes in /proc/self/io
`rchar`; tests/integration/test_checkpoint.py measures them). An index is Ellipsis or one selection per dimension: a slice (step 1) or, in the
first dimension only, an array of row numbers; numpy arrays take the same indexes.

BF16, which numpy lacks and most HF checkpoints use, is read as its raw 16 bits and widened to fp32
after slicing, exactly (bf16 is the top half of an fp32); safetensors' own numpy reader cannot slice it.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from mindscale.io import CheckpointError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def full_index(index, shape: tuple) -> tuple:
    """`index` (Ellipsis, or one selection per dimension) as explicit [start, stop) slices, a row array as it is."""
    if index is Ellipsis:
        return tuple(slice(0, n) for n in shape)
    return tuple(np.asarray(s, np.int64) if isinstance(s, np.ndarray) else slice(*s.indices(n)[:2])
                 for s, n in zip(index, shape))


def extent(selection) -> int:
    """How many positions one dimension's selection takes."""
    return selection.stop - selection.start if isinstance(selection, slice) else len(selection)


def _consecutive(selection) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of consecutive positions a selection of one dimension makes."""
    if isinstance(selection, slice):
        return np.array([selection.start]), np.array([selection.stop - selection.start])
    breaks = np.flatnonzero(np.diff(selection) != 1) + 1
    return selection[np.r_[0, breaks]], np.diff(np.r_[0, breaks, len(selection)])


def byte_runs(shape: tuple, index: tuple, itemsize: int) -> list[tuple[int, int]]:
    """(offset, length) in bytes of each contiguous run of `index` in a row-major tensor of `shape`, in
    the order of the selected elements: the dimensions after the last partly selected one are whole, so
    each run is a consecutive stretch of that dimension times what follows it."""
    partial = [d for d, s in enumerate(index) if not (isinstance(s, slice) and s == slice(0, shape[d]))]
    if not partial:
        return [(0, math.prod(shape) * itemsize)]
    last = partial[-1]
    strides = [math.prod(shape[d + 1:]) for d in range(last + 1)]
    base = np.zeros(1, np.int64)  # the element offset of every combination of the dimensions before `last`
    for d, s in enumerate(index[:last]):
        positions = np.arange(s.start, s.stop) if isinstance(s, slice) else s
        base = (base[:, None] + positions[None, :] * strides[d]).reshape(-1)
    starts, lengths = _consecutive(index[last])
    offsets = (base[:, None] + starts[None, :] * strides[last]).reshape(-1) * itemsize
    return list(zip(offsets.tolist(), np.tile(lengths * strides[last] * itemsize, len(base)).tolist()))


class StoredTensor:
    """One tensor of an open file (`handle`) whose bytes lie at `extents`, (file offset, length) pieces in
    order (one for a safetensors tensor): `shape`, and `[index]` reads
    that part (BF16 widened)."""

    def __init__(self, handle, extents: list[tuple[int, int]], shape: tuple, dtype: str):
        self.handle, self.extents, self.shape = handle, extents, tuple(shape)
        self.dtype, self.bf16 = np.dtype(DTYPES[dtype]), dtype == "BF16"
        self.starts = [0]  # where each extent starts in the tensor's bytes
        for _, length in extents:
            self.starts.append(self.starts[-1] + length)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def _in_file(self, offset: int, length: int):
        """(file offset, length) of the pieces of the tensor's bytes [offset, offset + length)."""
        at = bisect.bisect_right(self.starts, offset) - 1  # the extent holding `offset`
        while length:
            start, size = self.extents[at]
            within = offset - self.starts[at]
            piece = min(length, size - within)
            yield start + within, piece
            offset, length, at = offset + piece, length - piece, at + 1

    def _read_into(self, view: memoryview, offset: int) -> None:
        while view:  # one read returns at most 2 GiB
            got = os.preadv(self.handle.fileno(), [view], offset)
            if not got:
                raise CheckpointError(f"{self.handle.name} ends inside a tensor; it is truncated")
            view, offset = view[got:], offset + got

    def __getitem__(self, index) -> np.ndarray:
        index = full_index(index, self.shape)
        part = np.empty(tuple(extent(s) for s in index), self.dtype)
        if part.size:
            buffer, at = memoryview(part.reshape(-1).view(np.uint8)), 0
            for run in byte_runs(self.shape, index, self.dtype.itemsize):
                for offset, length in self._in_file(*run):
                    self._read_into(buffer[at:at + length], offset)
                    at += length
        return (part.astype(np.uint32) << 16).view(np.float32) if self.bf16 else part


def _open(path: Path, problem: str):
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise CheckpointError(problem.format(exc))
    return handle, os.fstat(handle.fileno()).st_size


def open_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """The tensors of a .safetensors file, nothing read but its header. A truncated or foreign file is
    a CheckpointError (one line)."""
    path = Path(path)
    problem = f"{path} cannot be read as safetensors ({{}}); it is truncated or not a safetensors file"
    handle, size = _open(path, problem)
    head = os.pread(handle.fileno(), 8, 0)
    if len(head) < 8:
        raise CheckpointError(problem.format("shorter than its header"))
    (length,) = struct.unpack("<Q", head)
    try:
        header = json.loads(os.pread(handle.fileno(), length, 8)) if 8 + length <= size else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(problem.format("corrupt header"))
    body = 8 + length
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {meta['dtype']}, which is not read; "
                                  f"re-save it as one of {', '.join(DTYPES)}")
        start, end = meta["data_offsets"]
        tensor = StoredTensor(handle, [(body + start, end - start)], meta["shape"], meta["dtype"])
        if body + end > size or end - start != tensor.nbytes:
            raise CheckpointError(problem.format(f"tensor {name} lies outside the file"))
        tensors[name] = tensor
    return tensors
