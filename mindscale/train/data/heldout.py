"""The held-out split of tools/preprocess_data.py --valid-fraction F (docs/data.md): whole documents.

Document i (0-based, in input order, empty documents not counted) is held out when
floor((i + 1) F) > floor(i F): exactly floor(n F) of the first n documents, spread evenly over the
inputs (which are often sorted by source, so a contiguous tail would be one source), and the same
documents for the same inputs and F whatever the tokenizer threads or shard size. A held-out
document never reaches a training sample: the two folders are packed separately.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

VALID_DIR = "valid"  # the held-out folder inside the output folder: data.valid_path=<output>/valid


def held_out(index: int, fraction: float) -> bool:
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def split_documents(chunks: Iterable[list], fraction: float, hold: Callable[[list], object]) -> Iterator[list]:
    """The training documents of each batch; the held-out ones go to `hold` (in order) as they come."""
    index = 0
    for docs in chunks:
        keep, out = [], []
        for doc in docs:
            (out if held_out(index, fraction) else keep).append(doc)
            index += 1
        if out:
            hold(out)
        yield keep
