"""What the lazy-loading tests check of a checkpoint read as SlicedWeights: every rank's slice of every
tensor, over a 2 x 2 device matrix, equals the same slice of the tensor read whole (models.weights)."""

import numpy as np

import models

LAYOUTS = {
    1: [[0], [-1]],
    2: [[1, 0], [0, 1], [1, -1], [-1, 0]],  # tensor maps over a 2 x 2 device matrix
    3: [[1, 0, -1], [1, -1, -1], [-1, 0, -1], [1, -1, 0]],
}  # stacked experts: over ep, tp or both


def assert_every_slice_matches(lazy, whole: dict) -> int:
    """For each tensor, tensor map, with and without the optimizer shard, and rank: lazy.local equals
    take_slice of the whole tensor. Returns how many slices were compared."""
    checked = 0
    for name, full in whole.items():
        for tensor_map in LAYOUTS[full.ndim]:
            for group in ("", "dp"):
                layout = ([2, 2], tensor_map, None, 1, True, group, list(full.shape))
                for rank in range(4):
                    np.testing.assert_array_equal(
                        lazy.local(name, layout, rank), models.weights.take_slice(full, layout, rank), err_msg=name
                    )
                    checked += 1
    return checked
