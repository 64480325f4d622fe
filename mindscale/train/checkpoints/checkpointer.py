"""A run's checkpoints as the trainer uses them (torchtitan's CheckpointManager): what a rank saves,
the resume at start, a save every checkpoint.save_interval steps (written in the background with
checkpoint.async_save), its commit by every rank and the pruning to checkpoint.keep_last.

Start order: the newest committed checkpoint in the run folder (mindscale/train/checkpoints/commit.py; a full
resume: weights, optimizer, loss scale, data position) -> `checkpoint.load_path` (weights only, for
fine-tuning) -> fresh init.
With LoRA (finetune.lora.rank > 0) checkpoints hold only the adapters: the frozen base always comes
from `checkpoint.load_path`, and a resume puts the saved adapters on top of it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import models
from mindscale.config import Config, Layout
from mindscale.train.checkpoints import folder as ckpt, commit


def parameters_as_numpy(params, copy: bool = False) -> dict[str, np.ndarray]:
    """Parameter values by name; `copy`: arrays training cannot change (asnumpy may share memory)."""
    return {p.name: np.array(p.asnumpy(), copy=True) if copy else p.asnumpy() for p in params}


@dataclass
class Start:
    """What a run starts from, read and checked before the step compiles (a bad checkpoint fails in seconds)."""
    checkpoint: Path | None = None         # the committed step folder resumed from
    weights: dict | None = None
    optimizer_state: dict | None = None
    state: dict = field(default_factory=dict)  # its state.json
    pretrained: dict | None = None         # checkpoint.load_path's weights

    @property
    def step(self) -> int:
        return ckpt.checkpoint_step(self.checkpoint) if self.checkpoint else 0


class Checkpointer:
    """Every rank builds one and calls it: `read_start` before the step compiles, `assign_start` after,
    `after_step` once per optimizer step, `end` when training ends (`finish_saving` when it diverges)."""

    def __init__(self, cfg: Config, layout: Layout, rt, graph, root: Path, heartbeat, vote: commit.RankVote,
                 trainer_state: Callable[[], dict]):
        """`rt`: the Runtime (rank, world, say); `graph`: the TrainGraph trained; `root`: the run folder's
        checkpoints/; `trainer_state`: the trainer's entries of a save's state.json, called once per save
        by the ranks that write."""
        self.cfg, self.layout, self.rt, self.graph = cfg, layout, rt, graph
        self.heartbeat, self.vote, self.trainer_state = heartbeat, vote, trainer_state
        # Sharded layouts (Ascend/GPU semi-auto parallel): every rank holds slices, so every rank writes
        # its own checkpoints (with MindSpore's strategy file in <run>/strategy/) and resumes from them.
        # A step is saved once every rank has written its part (mindscale/train/checkpoints/commit.py).
        self.root = root
        self.own_dir = root / f"rank_{rt.rank}" if layout.sharded else root
        self.pending = None  # (step, this rank writes, its write, saved healthy) of a save not yet committed

    # -- what a rank holds and saves ------------------------------------------------------------------
    def held(self, params) -> list:
        """The parameters this rank's graph holds: a pipeline stage compiles only its own (models.weights.held)."""
        return models.weights.held(params, self.graph.step.parameter_layout_dict, self.layout.pp)

    @property
    def saved_params(self) -> list:
        """What checkpoints hold: every weight, or only the trained adapters under LoRA (the base is frozen)."""
        return self.held(self.graph.network.trainable_params() if models.lora_enabled(self.cfg)
                         else self.graph.model.get_parameters())

    @property
    def optimizer_params(self) -> list:
        """The optimizer state checkpoints hold (TrainGraph.optimizer_state), of this rank's graph."""
        return self.held(self.graph.optimizer_state())

    def compiled_layouts(self, params) -> dict:
        """A sharded rank's compiled layout of each saved parameter (merged back by models.load_weights)."""
        held = self.graph.step.parameter_layout_dict
        return {p.name: models.weights.saved_layout(held[p.name]) for p in params if p.name in held}

    # -- start-up ---------------------------------------------------------------------------------
    def read_start(self) -> Start:
        """The resume point (checkpoint.resume, checkpoint.resume_step) and checkpoint.load_path, read and checked."""
        c = self.cfg.checkpoint
        latest = commit.resume_point(self.root, self.own_dir, self.vote, self.rt.rank, c.resume_step) \
            if c.resume or c.resume_step is not None else None
        pretrained = None
        if c.load_path and (latest is None or models.lora_enabled(self.cfg)):
            pretrained = models.load_pretrained(c.load_path, self.cfg, sliced=self.layout.sharded)
        if latest is None:
            return Start(pretrained=pretrained)
        weights, optimizer_state, state = ckpt.load_checkpoint(latest, verified=True)
        saved_layout, ours = state.get("layout", {}), ckpt.layout_record(self.cfg, self.layout)
        if not ckpt.same_layout(saved_layout, ours):
            raise ckpt.CheckpointError(
                f"{latest} was written under the layout {saved_layout or 'unsharded'}, this run is "
                f"{ours or 'unsharded'}; reshard it first: python tools/reshard.py --input {latest} --config "
                "<this run's config> --output <a new run>/checkpoints")
        return Start(latest, weights, optimizer_state, state, pretrained)

    def assign_start(self, start: Start) -> None:
        """Put what `read_start` read into the compiled graph (sharded parameters have their local shapes)."""
        step_cell, rank = self.graph.step, self.rt.rank
        layouts, optimizer_state = step_cell.parameter_layout_dict, start.optimizer_state
        if start.pretrained is not None:
            models.load_weights_into(self.graph.model, start.pretrained, layouts, rank, self.layout.pp)
        if start.checkpoint is not None:
            ckpt.assign(self.saved_params, start.weights, str(start.checkpoint), layouts, rank)
            if step_cell.scale_update is not None:
                # a checkpoint of a fixed-scale run holds no dynamic-scale state: start it at the scale it used
                fresh = {p.name: p.asnumpy() for p in step_cell.scale_update.get_parameters()}
                optimizer_state = {**fresh, "loss_scale": np.array(start.state["loss_scale"], np.float32),
                                   **optimizer_state}
            ckpt.assign(self.optimizer_params, optimizer_state, f"{start.checkpoint} optimizer state", layouts, rank)
            self.rt.say(f"resumed from {start.checkpoint} at step {start.state['step']}")
        elif start.pretrained is not None:
            self.rt.say(f"loaded weights from {self.cfg.checkpoint.load_path} (optimizer state and step start fresh)")

    # -- saving -------------------------------------------------------------------------------------
    def after_step(self, step: int, loss_scale: float) -> float | None:
        """After optimizer step `step` (1-based): save it when checkpoint.save_interval says so (the last
        step is `end`'s). Returns the seconds training was blocked, None when nothing was saved."""
        interval = self.cfg.checkpoint.save_interval
        if interval and step % interval == 0 and step < self.cfg.train.steps:
            return self.save(step, loss_scale)
        return None

    def end(self, step: int, loss_scale: float, save: bool) -> None:
        """When training ends at `step`: with `save`, save it; commit what is still pending."""
        blocked = self.save(step, loss_scale) if save else None
        self.finish_saving()
        if save:
            self.rt.say(f"checkpoint: {self.own_dir / ckpt.step_dir_name(step)} (training blocked {blocked:.2f} s)")

    def save(self, step: int, loss_scale: float) -> float:
        """Every rank calls it: the writing ranks write their part, then all commit the step together.
        With checkpoint.async_save the part is written on a thread from copies, and committed at the
        next save or the end (finish_saving), so every rank's collectives stay in one order. Returns
        the seconds training was blocked."""
        began = time.perf_counter()
        self.finish_saving()
        writes = self.rt.is_main or self.layout.sharded
        background = self.cfg.checkpoint.async_save
        job, healthy = None, True
        if writes:
            state = {"loss_scale": loss_scale, "seed": self.cfg.run.seed,
                     "samples_consumed": step * self.cfg.global_batch_size,
                     "layout": ckpt.layout_record(self.cfg, self.layout), **self.trainer_state()}
            healthy = state["healthy"]
            if self.layout.sharded:
                state["layouts"] = self.compiled_layouts([*self.saved_params, *self.optimizer_params])
            args = (self.own_dir, step, parameters_as_numpy(self.saved_params, copy=background),
                    parameters_as_numpy(self.optimizer_params, copy=background), state, self.cfg.to_yaml())
            if background:
                job = ckpt.BackgroundSave(*args)
            else:
                ckpt.save_checkpoint(*args)
        self.pending = (step, writes, job, healthy)
        if not background:
            self.finish_saving()
        blocked = time.perf_counter() - began
        self.heartbeat.saved(blocked)
        return blocked

    def finish_saving(self) -> None:
        """Commit the pending save, after its background write if it has one (a heartbeat before and after
        the join: it may come after the last beat, at the end or on a divergence)."""
        if self.pending is None:
            return
        step, writes, job, healthy = self.pending
        self.pending = None
        if job is not None:
            self.heartbeat.alive()
            job.join()
            self.heartbeat.alive()
        commit.commit(self.root, self.own_dir if writes else None, step, self.vote, self.rt.rank,
                      self.cfg.checkpoint.keep_last, healthy)
