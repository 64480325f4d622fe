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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

import models
from mindscale.config import Config, Layout
from mindscale.train.checkpoints import folder as ckpt, commit
from mindscale.train.checkpoints.batch import check_global_batch


def parameters_as_numpy(params, copy: bool = False) -> dict[str, np.ndarray]:
    """Parameter values by name; `copy`: arrays training cannot change (asnumpy may share memory)."""
    return {p.name: np.array(p.asnumpy(), copy=True) if copy else p.asnumpy() for p in params}


@dataclass
class Start:
    """What a run starts from, read and checked before the step compiles (a bad checkpoint fails in seconds)."""

    checkpoint: Path | None = None  # the committed step folder resumed from
    weights: dict | None = None
    optimizer_state: dict | None = None
    state: dict = field(default_factory=dict)  # its state.json
    config: dict = field(default_factory=dict)  # its config.yaml (the resolved config that saved it)
    pretrained: Mapping | None = None  # checkpoint.load_path's weights (headers only until assigned)

    @property
    def step(self) -> int:
        return ckpt.checkpoint_step(self.checkpoint) if self.checkpoint else 0


def saved_config(path: Path) -> dict:
    """The config.yaml beside a checkpoint's weights (a step folder, or a file in one); {} when there is none."""
    path = Path(path)
    file = (path if path.is_dir() else path.parent) / ckpt.CONFIG
    return (yaml.safe_load(file.read_text()) or {}) if file.is_file() else {}


def _flat(tree: dict, prefix: str) -> dict:
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def model_differences(saved: dict, cfg: Config) -> list[str]:
    """The model keys in which a checkpoint's config (`saved`, its config.yaml) differs from cfg."""
    theirs, ours = _flat(saved.get("model", {}), "model."), _flat(cfg.to_dict()["model"], "model.")
    return [f"{key}={theirs[key]} (this run {ours[key]})" for key in ours if key in theirs and theirs[key] != ours[key]]


def _same_shape(a: tuple, b: tuple) -> bool:
    """Equal shapes; safetensors stores a 0-d scalar as shape (1,)."""
    return a == b or (len(a) <= 1 and len(b) <= 1 and int(np.prod(a)) == int(np.prod(b)) == 1)


def check_fit(
    source: str, stored: dict[str, tuple], model: dict[str, tuple], complete: bool, saved: dict, cfg: Config, fix: str
) -> None:
    """Raise WeightsMismatch (one line) unless the tensors a checkpoint holds (`stored`: name -> full shape,
    from its headers) fit the model's parameters (`model`: name -> shape); `complete`: it must hold every
    one of them. The line names the first parameter that differs, both shapes, the model keys in which the
    checkpoint's own config (`saved`) differs, and `fix`."""
    wrong = [n for n in model if n in stored and not _same_shape(tuple(stored[n]), model[n])]
    unexpected = [n for n in stored if n not in model]
    missing = [n for n in model if n not in stored] if complete else []

    def more(items: list) -> str:
        return f" (and {len(items) - 1} more)" if len(items) > 1 else ""

    if wrong:
        problem = f"{wrong[0]} is {tuple(stored[wrong[0]])} there, {model[wrong[0]]} here{more(wrong)}"
    elif unexpected:
        problem = f"it holds {unexpected[0]}{more(unexpected)}, which this model has not"
    elif missing:
        problem = f"it lacks {missing[0]}{more(missing)}"
    else:
        return
    differ = model_differences(saved, cfg)
    keys = f"; its config.yaml has {', '.join(differ[:3])}" if differ else ""
    raise models.WeightsMismatch(f"{source} does not fit this model: {problem}{keys}: {fix}")


@dataclass
class PendingSave:
    """A save written (or being written, `job`) and not yet committed; `began`: when training stopped for it,
    `blocked`: how long it did, once known (a background write's copies; a synchronous save's when committed)."""

    step: int
    writes: bool  # this rank writes a part
    job: ckpt.BackgroundSave | None
    healthy: bool  # saved healthy
    began: float
    blocked: float | None = None


class Checkpointer:
    """Every rank builds one and calls it: `read_start` before the step compiles, `assign_start` after,
    `after_step` once per optimizer step, `end` when training ends (`finish_saving` when it diverges)."""

    def __init__(
        self,
        cfg: Config,
        layout: Layout,
        rt,
        graph,
        root: Path,
        heartbeat,
        vote: commit.RankVote,
        trainer_state: Callable[[], dict],
    ):
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
        self.pending: PendingSave | None = None

    # -- what a rank holds and saves ------------------------------------------------------------------
    def held(self, params) -> list:
        """The parameters this rank's graph holds: a pipeline stage compiles only its own (models.weights.held)."""
        return models.weights.held(params, self.graph.step.parameter_layout_dict, self.layout.pp)

    @property
    def saved_params(self) -> list:
        """What checkpoints hold: every weight, or only the trained adapters under LoRA (the base is frozen)."""
        return self.held(
            self.graph.network.trainable_params()
            if models.lora_enabled(self.cfg)
            else self.graph.model.get_parameters()
        )

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
        """The resume point (checkpoint.resume, checkpoint.resume_step) and checkpoint.load_path, read and
        checked against this run (layout, global batch, names and shapes) before the step compiles."""
        checkpoint = self.cfg.checkpoint
        ours = ckpt.layout_record(self.cfg, self.layout)
        latest = (
            commit.resume_point(self.root, self.own_dir, self.vote, self.rt.rank, checkpoint.resume_step, layout=ours)
            if checkpoint.resume or checkpoint.resume_step is not None
            else None
        )
        pretrained = None
        if checkpoint.load_path and (latest is None or models.lora_enabled(self.cfg)):
            # lazy: nothing read but headers until assign_start (a sharded rank then reads only its slices)
            pretrained = models.load_pretrained(checkpoint.load_path, self.cfg, sliced=True)
            base = {
                p.name: tuple(p.shape)
                for p in self.graph.model.get_parameters()  # LoRA adapters may be absent
                if p.name in pretrained or not models.lora.is_adapter(p.name)
            }
            check_fit(
                f"checkpoint.load_path={checkpoint.load_path}",
                pretrained.shapes,
                base,
                True,
                saved_config(checkpoint.load_path),
                self.cfg,
                "use the model config it was trained with",
            )
        if latest is None:
            return Start(pretrained=pretrained)
        state, saved = ckpt.read_state(latest), saved_config(latest)
        saved_layout = state.get("layout", {})
        if not ckpt.same_layout(saved_layout, ours):
            raise ckpt.reshard_refusal(latest, saved_layout, ours)
        check_global_batch(latest, state, self.cfg, self.rt.device_target, self.rt.world, saved_layout)
        self._check_resumed_shapes(latest, state, saved)
        weights, optimizer_state, state = ckpt.load_checkpoint(latest, verified=True)
        return Start(latest, weights, optimizer_state, state, saved, pretrained)

    def _check_resumed_shapes(self, folder: Path, state: dict, saved: dict) -> None:
        """The names and full shapes of the weights a rank resumes, from its file's header (a sharded rank's
        slices by the full shapes of its state.json layouts), against this model before it compiles. A
        pipeline stage holds only its own parameters, which the compile decides: then only the names it
        holds are checked here, the rest when they are assigned."""
        layouts = state.get("layouts", {})
        stored = {
            n: tuple(layouts[n][6]) if n in layouts else tuple(t.shape)
            for n, t in models.tensor_file.open_tensors(Path(folder) / ckpt.WEIGHTS).items()
        }
        params = (
            self.graph.network.trainable_params()
            if models.lora_enabled(self.cfg)
            else self.graph.model.get_parameters()
        )
        check_fit(
            str(folder),
            stored,
            {p.name: tuple(p.shape) for p in params},
            self.layout.pp == 1,
            saved,
            self.cfg,
            "resume with the model keys it was saved with (its config.yaml)",
        )

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
                optimizer_state = {
                    **fresh,
                    "loss_scale": np.array(start.state["loss_scale"], np.float32),
                    **optimizer_state,
                }
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
        if save:
            self.save(step, loss_scale)
        self.finish_saving()

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
            state = {
                "loss_scale": loss_scale,
                "seed": self.cfg.run.seed,
                "samples_consumed": step * self.cfg.samples_per_step,
                "layout": ckpt.layout_record(self.cfg, self.layout),
                **self.trainer_state(),
            }
            healthy = state["healthy"]
            if self.layout.sharded:
                state["layouts"] = self.compiled_layouts([*self.saved_params, *self.optimizer_params])
            args = (
                self.own_dir,
                step,
                parameters_as_numpy(self.saved_params, copy=background),
                parameters_as_numpy(self.optimizer_params, copy=background),
                state,
                self.cfg.to_yaml(),
            )
            if background:
                job = ckpt.BackgroundSave(*args)
            else:
                ckpt.save_checkpoint(*args)
        self.pending = PendingSave(step, writes, job, healthy, began)
        if not background:
            self.finish_saving()
        blocked = time.perf_counter() - began
        if background:
            self.pending.blocked = blocked
        self.heartbeat.saved(blocked)
        return blocked

    def finish_saving(self) -> None:
        """Commit the pending save, after its background write if it has one (a heartbeat before and after
        the join: it may come after the last beat, at the end or on a divergence), and say where it is."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.job is not None:
            self.heartbeat.alive()
            pending.job.join()
            self.heartbeat.alive()
        commit.commit(
            self.root,
            self.own_dir if pending.writes else None,
            pending.step,
            self.vote,
            self.rt.rank,
            self.cfg.checkpoint.keep_last,
            pending.healthy,
        )
        where = self.root / ("rank_*" if self.layout.sharded else "") / ckpt.step_dir_name(pending.step)
        blocked = time.perf_counter() - pending.began if pending.blocked is None else pending.blocked
        background = "written in the background, " if pending.job is not None else ""
        self.rt.say(f"checkpoint: {where} ({background}training blocked {blocked:.2f} s)")
