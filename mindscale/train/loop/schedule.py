"""The learning-rate schedule and the weight-decay rule, free of MindSpore so that peers (the torch
benchmark) can follow exactly the same rules without importing it."""

from __future__ import annotations

import dataclasses

import numpy as np

from mindscale.config import TrainConfig


def lr_at(step, t: TrainConfig):
    """Learning rate used by optimizer step `step` (0-based): linear warm-up, then decay to min_lr. `step` is
    an int (a float comes back) or a numpy array of them (an array comes back: the whole run's table is one
    call, where a Python loop over the 1.2M steps of llama3_405b took seconds at every start)."""
    s = np.asarray(step, dtype=np.float64)
    if t.lr_schedule == "constant":
        after = np.full_like(s, t.lr)
    else:
        progress = np.minimum((s - t.warmup_steps) / max(t.steps - t.warmup_steps, 1), 1.0)
        after = (
            t.lr - (t.lr - t.min_lr) * progress
            if t.lr_schedule == "linear"
            else t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + np.cos(np.pi * progress))
        )
    lr = np.where(s < t.warmup_steps, t.lr * (s + 1) / max(t.warmup_steps, 1), after)
    return float(lr) if lr.ndim == 0 else lr


SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "steps", "lr_schedule")  # the train keys lr_at reads


def schedule_change(saved: dict, t: TrainConfig, step: int) -> str | None:
    """One line when resuming at optimizer step `step` (0-based: the next to run) under `t` gives another
    learning rate than the schedule the checkpoint was saved under (`saved`: its config's train keys);
    None when both give the same. The schedule is always the config's, recomputed over its train.steps:
    raising train.steps on resume moves a cosine's position, which this line says."""
    theirs = dataclasses.replace(t, **{key: saved[key] for key in SCHEDULE_KEYS if key in saved})
    now, before = lr_at(step, t), lr_at(step, theirs)
    if np.isclose(now, before, rtol=1e-6, atol=0.0):
        return None
    changed = ", ".join(
        f"train.{key} {getattr(theirs, key)} -> {getattr(t, key)}"
        for key in SCHEDULE_KEYS
        if getattr(theirs, key) != getattr(t, key)
    )
    return (
        f"learning rate: step {step + 1} runs at {now:.3e} on this config's schedule, {before:.3e} on the "
        f"checkpoint's ({changed}); the schedule is recomputed from the config's train keys"
    )


def decays(name: str, shape: tuple) -> bool:
    """Weight decay applies to matrices (linear and embedding weights), not to norms or biases."""
    return len(shape) >= 2 and "norm" not in name
