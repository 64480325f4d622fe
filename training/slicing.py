"""A parameter's slice on one rank, from its compiled layout (an entry of `Cell.parameter_layout_dict`).

After a sharded graph compiles, MindSpore gives each parameter (dev_matrix, tensor_map, slice_shape,
field_size, uniform_split, opt_shard_group, full_shape, ...). Dimension d of the tensor is split
tensor_map[d] >= 0 ways along device-matrix axis (len(dev_matrix) - 1 - tensor_map[d]) (-1: whole);
a rank's coordinate in the device matrix is its index read row-major (the last axis fastest), so
the ranks of every pipeline stage map alike. With the optimizer shard (opt_shard_group set) the
first dimension of that slice is cut again among the ranks that hold it (the device-matrix axes the
tensor map does not use), in rank order. MindSpore's own loader (mindspore.parallel._tensor) slices
a full tensor the same way; this gives the index ranges instead, so a reader takes only its slice.
"""
from __future__ import annotations

import math

import numpy as np


def _coordinate(rank: int, dev_matrix: list[int]) -> list[int]:
    coordinate = [0] * len(dev_matrix)
    for axis in reversed(range(len(dev_matrix))):
        coordinate[axis] = rank % dev_matrix[axis]
        rank //= dev_matrix[axis]
    return coordinate


def local_slice(layout: tuple, rank: int) -> tuple[slice, ...]:
    """Index ranges of `rank`'s slice of the full tensor, per dimension."""
    dev_matrix, tensor_map, full_shape, opt_group = list(layout[0]), list(layout[1]), list(layout[6]), layout[5]
    if any(isinstance(k, (list, tuple)) for k in tensor_map):
        raise ValueError(f"tensor map {tensor_map} splits one dimension over several axes; not supported")
    coordinate = _coordinate(rank, dev_matrix)
    axis_of = {k: len(dev_matrix) - 1 - k for k in tensor_map if k >= 0}
    index = []
    for size, k in zip(full_shape, tensor_map):
        parts, at = (dev_matrix[axis_of[k]], coordinate[axis_of[k]]) if k >= 0 else (1, 0)
        step = size // parts
        index.append(slice(at * step, (at + 1) * step))
    if opt_group and index:
        free = [axis for axis in range(len(dev_matrix)) if axis not in axis_of.values()]
        holders = math.prod(dev_matrix[axis] for axis in free)
        at = 0
        for axis in free:  # this rank's place among the ranks holding the same slice, in rank order
            at = at * dev_matrix[axis] + coordinate[axis]
        first = index[0]
        step = (first.stop - first.start) // holders
        index[0] = slice(first.start + at * step, first.start + (at + 1) * step)
    return tuple(index)


def take_slice(full: np.ndarray, layout: tuple | None, rank: int) -> np.ndarray:
    """`full` as `rank` holds it (the whole tensor when the parameter has no layout: not sharded)."""
    if layout is None or not layout[1]:
        return full
    return np.ascontiguousarray(full.reshape(layout[6])[local_slice(layout, rank)])
