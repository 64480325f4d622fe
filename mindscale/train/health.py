"""Health guards: an unattended run that cannot recover stops with exit 1 and one line naming the
cause, instead of training on garbage until its allocation ends.

- `train.max_skipped_steps` consecutive steps skipped for non-finite gradients (the step skips the
  optimizer update then, mindscale/train/step.py): a fixed fp16 loss scale that overflows every
  step, or a dynamic one that halves without finding a usable scale, or a diverged run.
- A non-finite loss without a dynamic loss scale: nothing will bring it back.

Both are decided from values every rank shares (the step's loss and gradient norm are global), so
every rank stops at the same step without a vote; the weights are those of the last good step.
"""
from __future__ import annotations

import math

from mindscale.config import Config


class TrainingDiverged(RuntimeError):
    """The run cannot go on. One line naming the cause; run_train.py exits 1 (not bad input)."""


class HealthGuard:
    def __init__(self, cfg: Config, dynamic_scale: bool):
        self.max_skipped = cfg.train.max_skipped_steps
        self.loss_scale = cfg.train.loss_scale
        self.dynamic = dynamic_scale
        self.skipped_in_a_row = 0

    def check(self, step: int, loss: float, overflow: bool, scale: float) -> None:
        """After optimizer step `step` (1-based): raise TrainingDiverged when the run must stop."""
        if not math.isfinite(loss) and not self.dynamic:
            raise TrainingDiverged(
                f"step {step}: the loss is {loss} and there is no dynamic loss scale to recover it (train.loss_scale="
                f"{'null' if self.loss_scale is None else self.loss_scale}); lower train.lr or check the data and the "
                "model's init, and resume from a committed checkpoint")
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if overflow else 0
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            raise TrainingDiverged(
                f"step {step}: {self.skipped_in_a_row} steps in a row skipped for non-finite gradients (train."
                f"max_skipped_steps={self.max_skipped}, loss scale {scale:g}); the loss scale cannot recover or the "
                "run diverged: use a dynamic loss scale, lower train.lr, or train in bf16/fp32")
