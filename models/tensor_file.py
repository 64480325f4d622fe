"""Checkpoint tensors read in parts: safetensors files (MindScale, Hugging Face, MindFormers) and
MindSpore .ckpt files (MindFormers), for any dtype they use.

Opening a file reads its header alone (a .ckpt: the few bytes before each tensor's contents). Each
tensor is then a lazy tensor: its `shape`, and `[index]` reads that part and nothing else, one
`pread` per contiguous run of bytes, so a sharded rank loading a 70B checkpoint reads its share, not
the whole file (the kernel counts those bytes in /proc/self/io `rchar`, which
tests/integration/test_checkpoint.py and tests/dryrun/test_dryrun.py measure). An index is Ellipsis
or one selection per dimension: a slice (step 1) or, in the first dimension only, an array of row
numbers (models/mf_convert.py's rows of a fused tensor); numpy arrays take the same indexes.

BF16, which numpy lacks and most HF checkpoints use, is read as its raw 16 bits and widened to fp32
after slicing, exactly (bf16 is the top half of an fp32); safetensors' own numpy reader cannot slice it.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mindscale.io import CheckpointError

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
# MindSpore's .ckpt tensor_type names of the same dtypes
CKPT_DTYPES = {
    "Float64": "F64",
    "Float32": "F32",
    "Float16": "F16",
    "BFloat16": "BF16",
    "Int64": "I64",
    "Int32": "I32",
    "Int16": "I16",
    "Int8": "I8",
    "UInt8": "U8",
    "Bool": "BOOL",
}


def full_index(index, shape: tuple) -> tuple:
    """`index` (Ellipsis, or one selection per dimension) as explicit [start, stop) slices, a row array as it is."""
    if index is Ellipsis:
        return tuple(slice(0, n) for n in shape)
    return tuple(
        np.asarray(s, np.int64) if isinstance(s, np.ndarray) else slice(*s.indices(n)[:2]) for s, n in zip(index, shape)
    )


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
    strides = [math.prod(shape[d + 1 :]) for d in range(last + 1)]
    base = np.zeros(1, np.int64)  # the element offset of every combination of the dimensions before `last`
    for d, s in enumerate(index[:last]):
        positions = np.arange(s.start, s.stop) if isinstance(s, slice) else s
        base = (base[:, None] + positions[None, :] * strides[d]).reshape(-1)
    starts, lengths = _consecutive(index[last])
    offsets = (base[:, None] + starts[None, :] * strides[last]).reshape(-1) * itemsize
    return list(zip(offsets.tolist(), np.tile(lengths * strides[last] * itemsize, len(base)).tolist()))


class StoredTensor:
    """One tensor of an open file (`handle`) whose bytes lie at `extents`, (file offset, length) pieces in
    order (one for a safetensors tensor; a large .ckpt tensor has several): `shape`, and `[index]` reads
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
                    self._read_into(buffer[at : at + length], offset)
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
            raise CheckpointError(
                f"{path}: tensor {name} has dtype {meta['dtype']}, which is not read; "
                f"re-save it as one of {', '.join(DTYPES)}"
            )
        start, end = meta["data_offsets"]
        tensor = StoredTensor(handle, [(body + start, end - start)], meta["shape"], meta["dtype"])
        if body + end > size or end - start != tensor.nbytes:
            raise CheckpointError(problem.format(f"tensor {name} lies outside the file"))
        tensors[name] = tensor
    return tensors


class _Fields:
    """Protobuf fields of a file, parsed from small reads (a 256-byte window, moved as parsing goes)."""

    WINDOW = 256

    def __init__(self, handle):
        self.handle, self.start, self.data = handle, 0, b""

    def _byte(self, at: int) -> int:
        if not self.start <= at < self.start + len(self.data):
            self.start, self.data = at, os.pread(self.handle.fileno(), self.WINDOW, at)
            if not self.data:
                raise ValueError(f"ends at byte {at} inside a field")
        return self.data[at - self.start]

    def varint(self, at: int) -> tuple[int, int]:
        value, shift = 0, 0
        while True:
            byte = self._byte(at)
            value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
            if byte < 0x80:
                return value, at
            if shift > 63:
                raise ValueError(f"a varint at byte {at} is too long")

    def field(self, at: int) -> tuple[int, int, int, int]:
        """(field number, wire type, value or payload length, where its payload starts) of the field at `at`."""
        key, at = self.varint(at)
        number, wire = key >> 3, key & 7
        if wire in (0, 2):
            value, payload = self.varint(at)
            return number, wire, value, payload
        if wire in (1, 5):
            return number, wire, 0, at
        raise ValueError(f"wire type {wire} at byte {at}")

    @staticmethod
    def end(wire: int, value: int, payload: int) -> int:
        return {0: payload, 1: payload + 8, 2: payload + value, 5: payload + 4}[wire]

    def read(self, at: int, length: int) -> bytes:
        return os.pread(self.handle.fileno(), length, at)


def _ckpt_tensor(fields: _Fields, at: int, end: int) -> tuple[list[int], str, int, int]:
    """(dims, tensor_type, contents offset, contents length) of a TensorProto in [at, end)."""
    dims, kind, contents = [], None, None
    while at < end:
        number, wire, value, payload = fields.field(at)
        if number == 1 and wire == 0:
            dims.append(value)
        elif number == 1 and wire == 2:  # packed dims
            inner = payload
            while inner < payload + value:
                dim, inner = fields.varint(inner)
                dims.append(dim)
        elif number == 2 and wire == 2:
            kind = fields.read(payload, value).decode()
        elif number == 3 and wire == 2:
            contents = (payload, value)
        at = fields.end(wire, value, payload)
    if kind is None or contents is None:
        raise ValueError("a tensor without its type or contents")
    return dims, kind, *contents


def open_ckpt(path: str | Path, keep: Callable[[str], bool]) -> dict[str, StoredTensor]:
    """The tensors of a MindSpore .ckpt file whose names `keep` accepts, nothing read but headers.

    The file is a protobuf Checkpoint: one Value {tag, TensorProto {dims, tensor_type, tensor_content}}
    after another (MindSpore's checkpoint.proto), a tensor over 512 MB as several Values of one tag whose
    contents follow one another, and maybe a CRC trailer. Each Value's key and length are read, and for a
    kept tensor the bytes before its contents: the rest (an optimizer's moments, say) is skipped
    unread. An encrypted, truncated or foreign file is a CheckpointError (one line)."""
    path = Path(path)
    problem = f"{path} cannot be read as a MindSpore checkpoint ({{}}); it is truncated, encrypted or not a .ckpt"
    handle, size = _open(path, problem)
    fields = _Fields(handle)
    end = size - 17 if size >= 17 and fields.read(size - 17, 7) == b"crc_num" else size
    found: dict[str, tuple[list[int], str, list[tuple[int, int]]]] = {}
    at = 0
    try:
        while at < end:
            number, wire, length, value = fields.field(at)
            if (number, wire) != (1, 2) or value + length > end:
                raise ValueError(f"byte {at} does not start a checkpoint value")
            at = value + length
            number, wire, tag_length, tag = fields.field(value)
            if (number, wire) != (1, 2):
                raise ValueError(f"the value at byte {value} has no name")
            name = fields.read(tag, tag_length).decode()
            if not keep(name):
                continue
            number, wire, tensor_length, tensor = fields.field(tag + tag_length)
            if (number, wire) != (2, 2):  # a map tensor
                continue
            dims, kind, contents, contents_length = _ckpt_tensor(fields, tensor, tensor + tensor_length)
            found.setdefault(name, (dims, kind, []))[2].append((contents, contents_length))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(problem.format(exc))
    return {name: _ckpt_chunks(path, handle, name, *entry) for name, entry in found.items()}


def _ckpt_chunks(
    path: Path, handle, name: str, dims: list[int], kind: str, chunks: list[tuple[int, int]]
) -> StoredTensor:
    """One .ckpt tensor from the contents of its Values, in order."""
    if kind not in CKPT_DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name} has type {kind}, which is not read; re-save it as one of {', '.join(CKPT_DTYPES)}"
        )
    shape = () if dims == [0] else tuple(dims)  # MindSpore writes a scalar's dims as [0]
    tensor = StoredTensor(handle, chunks, shape, CKPT_DTYPES[kind])
    if tensor.starts[-1] != tensor.nbytes:
        raise CheckpointError(
            f"{path}: tensor {name}'s contents do not fill its shape {list(shape)}; "
            "the file is truncated or not a MindSpore checkpoint"
        )
    return tensor
