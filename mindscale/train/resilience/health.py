"""Health guards: an unattended run that cannot recover stops with exit 1 and one line naming the
cause, instead of training on garbage until its allocation ends.

- `train.max_skipped_steps` consecutive steps skipped for non-finite gradients (the step skips the
  optimizer update then, mindscale/train/loop/step.py): a fixed fp16 loss scale that overflows every
  step, or a dynamic one that halves without finding a usable scale, or a diverged run.
- A non-finite loss without a dynamic loss scale: nothing will bring it back. Checked only without
  pipeline stages: with them only the last stage holds the loss (the others see 0), and a guard that
  fired on some ranks would leave the others waiting in a collective. There the non-finite gradients
  it causes are skipped on every rank, and `max_skipped_steps` stops the run.

- `train.loss_spike_factor` (optional, LossSpikes): a step whose loss exceeds that factor times the
  median of recent losses does not update the weights. The compiled step decides (TrainStep.loss_limit),
  before its update; the host sets the limit and, comparing the same float32 values, names the step.

Each checkpoint's state.json says whether the run was healthy since the previous save (SaveWindow),
and a resume prefers a healthy checkpoint (mindscale/train/checkpoints/commit.py).

All are decided from values every rank shares (the gradient norm is global, and so is the loss
without pipeline stages), so every rank acts at the same step without a vote; the weights are those
of the last good step.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from mindscale.config import Config

SPIKE_WINDOW = 50  # updated steps whose median is the reference
SPIKE_MIN_HISTORY = 10  # no limit before this many
UNHEALTHY_SKIP_STREAK = 3  # consecutive skipped updates that make a save window unhealthy


class TrainingDiverged(RuntimeError):
    """The run cannot go on. One line naming the cause; run_train.py exits 1 (not bad input)."""


class HealthGuard:
    def __init__(self, cfg: Config, dynamic_scale: bool):
        self.loss_everywhere = cfg.parallel.pipeline_stage == 1
        self.max_skipped = cfg.train.max_skipped_steps
        self.loss_scale = cfg.train.loss_scale
        self.dynamic = dynamic_scale
        self.skipped_in_a_row = 0
        self.window = SaveWindow()

    def check(self, step: int, loss: float, overflow: bool, scale: float, spiked: bool = False) -> None:
        """After optimizer step `step` (1-based): raise TrainingDiverged when the run must stop."""
        self.window.add(loss, overflow or spiked)
        if self.loss_everywhere and not math.isfinite(loss) and not self.dynamic:
            raise TrainingDiverged(
                f"step {step}: the loss is {loss} and there is no dynamic loss scale to recover it (train.loss_scale="
                f"{'null' if self.loss_scale is None else self.loss_scale}); lower train.lr or check the data and the "
                "model's init, and resume from a committed checkpoint"
            )
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if overflow or spiked else 0
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            raise TrainingDiverged(
                f"step {step}: {self.skipped_in_a_row} steps in a row skipped for non-finite gradients or loss spikes "
                f"(train.max_skipped_steps={self.max_skipped}, loss scale {scale:g}); the loss scale cannot recover or "
                "the run diverged: use a dynamic loss scale, lower train.lr, or train in bf16/fp32"
            )


class LossSpikes:
    """train.loss_spike_factor on the host: the limit the next step compares its loss with, and which
    steps went over it. `history` (the losses of recent updated steps) is saved in state.json, so a
    resumed run applies the same limits as one never stopped."""

    def __init__(self, factor: float | None, history=()):
        self.factor = factor
        self.history = deque(history, maxlen=SPIKE_WINDOW)

    @property
    def enabled(self) -> bool:
        return self.factor is not None

    def limit(self) -> np.float32:
        """factor x median of the recent losses, as the step compares it (float32); inf while too few."""
        if len(self.history) < SPIKE_MIN_HISTORY:
            return np.float32("inf")
        return np.float32(self.factor * float(np.median(self.history)))

    def after(self, loss: float, limit: np.float32, overflow: bool) -> bool:
        """Whether the step with this (float32) loss went over `limit`, i.e. skipped its update for it."""
        spiked = bool(np.float32(loss) > limit)
        if not (spiked or overflow) and math.isfinite(loss):
            self.history.append(float(loss))
        return spiked


class SaveWindow:
    """Whether the steps since the previous save (of this process) were healthy, for state.json.

    Healthy: every loss was finite, and no UNHEALTHY_SKIP_STREAK or more consecutive updates were
    skipped (for non-finite gradients or loss spikes; a streak that began before the window counts
    whole). A single skipped update is normal (a dynamic loss scale probing upwards, one bad batch
    caught by the spike guard) and leaves the weights as they were. The loss-scale search at the start
    of an fp16 run can make its first save unhealthy; a resume then still takes it when no healthy one
    exists."""

    def __init__(self):
        self.steps = self.non_finite = self.skipped = self.longest_streak = self.streak = 0

    def add(self, loss: float, skipped: bool) -> None:
        self.steps += 1
        self.non_finite += not math.isfinite(loss)
        self.skipped += skipped
        self.streak = self.streak + 1 if skipped else 0
        self.longest_streak = max(self.longest_streak, self.streak)

    def close(self) -> dict:
        """The state.json entries of a save now ("healthy", "health"); the next window starts."""
        health = {
            "steps": self.steps,
            "non_finite_losses": self.non_finite,
            "skipped_updates": self.skipped,
            "longest_skip_streak": self.longest_streak,
        }
        healthy = self.non_finite == 0 and self.longest_streak < UNHEALTHY_SKIP_STREAK
        self.steps = self.non_finite = self.skipped = self.longest_streak = 0  # self.streak may go on
        return {"healthy": healthy, "health": health}


def describe_health(health: dict) -> str:
    """'2 non-finite losses, 4 updates in a row skipped in 6 steps' for a line about a checkpoint."""
    return (
        f"{health.get('non_finite_losses', 0)} non-finite loss(es), {health.get('longest_skip_streak', 0)} "
        f"update(s) in a row skipped in the {health.get('steps', '?')} steps before it"
    )
