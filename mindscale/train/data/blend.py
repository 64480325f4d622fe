"""Weighted blends: which source each position of the global sample stream draws from (docs/data.md).

The rule is decided per optimizer step of G samples (the global batch), because the promise is about
step boundaries: after step s the count drawn from source k is within one sample of w_k * s * G, for
every s and k (w normalised to sum 1). Each step gives source k its whole part floor(w_k * G); the
R = G - sum(floor(w_k * G)) remaining samples of a step go, one at a time, to the sources in the order of
one sequence over the fractional parts f_k = w_k * G - floor(w_k * G) (weights f_k / R): Tijdeman's
"chairman assignment" rule (R. Tijdeman, The chairman assignment problem, Discrete Math. 32 (1980)),
earliest deadline first among the sources that may take one more. That sequence keeps every count
within 1 - 1/(2K' - 2) of its share at every point (K' sources with a fractional part), so the step
counts are within that of w_k * s * G, strictly below one sample.

Megatron's rule (each sample to the source furthest below its share) was measured here to break the
one-sample bound: 1.09 samples with 5 sources of weights (0.597, 0.0015, 0.358, 0.0106, 0.0322)
(tests/unit/test_blend.py keeps that case). Tijdeman's rule is Megatron's in the common case and
bounded in all.

Inside a step the G positions interleave the sources evenly (source k's i-th sample of the step at
key (i + 1/2) / g_k, ties by source), the same layout for every step with the same counts.

Everything here is numpy and a Python loop over R picks per step (R < K); nothing per sample runs in
Python. mindscale/train/data/index.py writes the counts into the run folder; this module is the math.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

SNAP = 1e-9  # w_k * G this close to an integer is that integer (0.7 * 10 is 6.999999999999999)


def normalized(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or not len(w) or (w <= 0).any() or not np.isfinite(w).all():
        raise ValueError(f"blend weights must be positive and finite, got {list(weights)}")
    return w / w.sum()


class StepCounts:
    """Samples of each source in each optimizer step, step after step (`take`), for weights w and batch G."""

    def __init__(self, weights: Sequence[float], global_batch: int):
        self.weights = normalized(weights)
        share = self.weights * global_batch
        whole = np.floor(share + SNAP)
        fraction = np.where(share - whole > SNAP, share - whole, 0.0)
        self.base = whole.astype(np.int64)
        self.extra = int(global_batch - self.base.sum())  # R: samples a step hands out one at a time
        self.global_batch = global_batch
        self._picks = ChairmanSequence(fraction / fraction.sum()) if self.extra else None

    def take(self, steps: int) -> np.ndarray:
        """int64 [steps, K]: the next `steps` steps' sample counts per source; each row sums to G."""
        counts = np.broadcast_to(self.base, (steps, len(self.base))).copy()
        if self._picks is not None:
            picks = self._picks.take(steps * self.extra).reshape(steps, self.extra)
            for column in picks.T:  # R < K columns
                np.add.at(counts, (np.arange(steps), column), 1)
        return counts

    def starts(self, steps: int, chunk: int = 1 << 16) -> Iterator[np.ndarray]:
        """Draws of each source before step s, s = 0..steps (int64 [chunk, K] blocks, steps + 1 rows in all)."""
        total = np.zeros(len(self.base), np.int64)
        yield total[None].copy()
        for low in range(0, steps, chunk):
            block = np.cumsum(self.take(min(chunk, steps - low)), axis=0) + total
            total = block[-1].copy()
            yield block


class ChairmanSequence:
    """Tijdeman's sequence for weights v (sum 1): at t = 1, 2, ... the source, among those with
    v_k t - c_k >= 1 - sigma (one more keeps it at most sigma ahead), whose deadline (c_k + sigma) / v_k
    (when it would fall sigma behind) comes first; sigma = 1 - 1 / (2K - 2) over the K sources with v_k > 0.
    Then |c_k(t) - v_k t| <= sigma for all t and k. `take(n)` continues the sequence."""

    def __init__(self, v: np.ndarray):
        self.active = [int(k) for k in np.flatnonzero(v > 0)]
        self.v = [float(x) for x in v]
        self.sigma = 1 - 1 / (2 * len(self.active) - 2) if len(self.active) > 1 else 0.0
        self.count = [0] * len(v)
        self.t = 0

    def take(self, n: int) -> np.ndarray:
        out = np.empty(n, np.int16)
        if len(self.active) == 1:
            out[:] = self.active[0]
            self.count[self.active[0]] += n
            self.t += n
            return out
        v, count, sigma, active = self.v, self.count, self.sigma, self.active
        floor = 1 - sigma - SNAP
        t = self.t
        for i in range(n):
            t += 1
            best, deadline = -1, float("inf")
            for k in active:
                if v[k] * t - count[k] >= floor:
                    due = (count[k] + sigma) / v[k]
                    if due < deadline:
                        best, deadline = k, due
            if best < 0:  # not reached in exact arithmetic (Tijdeman); the furthest behind, should rounding err
                best = max(active, key=lambda k: v[k] * t - count[k])
            count[best] += 1
            out[i] = best
        self.t = t
        return out


_LAYOUTS: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}


def step_layout(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For one step's counts g (int64 [K]): (source, draw within the step) of each of its G positions, the
    sources interleaved evenly: source k's i-th sample at key (i + 1/2) / g_k, ties by source."""
    key = counts.tobytes()
    if key not in _LAYOUTS:
        source = np.repeat(np.arange(len(counts), dtype=np.int16), counts)
        occurrence = np.arange(len(source)) - np.repeat(np.cumsum(counts) - counts, counts)
        order = np.lexsort((source, (occurrence + 0.5) / counts[source]))
        _LAYOUTS[key] = (source[order], occurrence[order])
    return _LAYOUTS[key]


def assign(starts: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For consecutive steps whose draw counts before each step are `starts` (int64 [W + 1, K]) and the
    in-step positions `columns` (a rank's, ascending): (source, draw number) [W, len(columns)] of each."""
    counts = np.diff(starts, axis=0)
    unique, inverse = np.unique(counts, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    layouts = [step_layout(row) for row in unique]
    source = np.stack([layout[0][columns] for layout in layouts])[inverse]
    within = np.stack([layout[1][columns] for layout in layouts])[inverse]
    draw = np.take_along_axis(starts[:-1], source.astype(np.int64), axis=1) + within
    return source, draw
