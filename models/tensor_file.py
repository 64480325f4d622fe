"""Safetensors tensors read in parts, for any dtype Hugging Face checkpoints use.

The file's header gives each tensor's dtype, shape and byte range; the file is memory-mapped and a
tensor is a numpy view of its range, so indexing one reads only the pages of that slice (a sharded
rank loading a 70B checkpoint reads its share, not the whole file). safetensors' own numpy reader
cannot slice BF16, which numpy lacks and most HF checkpoints use: here BF16 is read as its raw 16
bits and widened to fp32 after slicing, exactly (bf16 is the top half of an fp32).
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from mindscale.io import CheckpointError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def full_index(index, shape: tuple) -> tuple[slice, ...]:
    """`index` (Ellipsis, or a tuple of slices, one per dimension) as explicit [start, stop) slices."""
    if index is Ellipsis:
        return tuple(slice(0, n) for n in shape)
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


class StoredTensor:
    """One tensor of a mapped file: `shape`, and `[index]` copies out that part (BF16 widened)."""

    def __init__(self, view: np.ndarray, bf16: bool):
        self.view, self.bf16 = view, bf16
        self.shape = tuple(view.shape)

    def __getitem__(self, index) -> np.ndarray:
        part = np.array(self.view[full_index(index, self.shape)], copy=True)
        return (part.astype(np.uint32) << 16).view(np.float32) if self.bf16 else part


def open_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """The tensors of a .safetensors file, mapped, nothing read yet. A truncated or foreign file is a
    CheckpointError (one line)."""
    path = Path(path)
    problem = f"{path} cannot be read as safetensors ({{}}); it is truncated or not a safetensors file"
    try:
        with path.open("rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(problem.format(exc))
    if len(data) < 8:
        raise CheckpointError(problem.format("shorter than its header"))
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(problem.format("corrupt header"))
    body = 8 + size
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has dtype {meta['dtype']}, which is not read; "
                                  f"re-save it as one of {', '.join(DTYPES)}")
        start, end = meta["data_offsets"]
        count = int(np.prod(meta["shape"], dtype=np.int64))
        if body + end > len(data) or end - start != count * np.dtype(dtype).itemsize:
            raise CheckpointError(problem.format(f"tensor {name} lies outside the file"))
        view = np.frombuffer(data, dtype=dtype, count=count, offset=body + start).reshape(meta["shape"])
        tensors[name] = StoredTensor(view, meta["dtype"] == "BF16")
    return tensors
