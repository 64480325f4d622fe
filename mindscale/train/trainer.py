"""The pretraining / fine-tuning loop behind run_train.py.

Start order: the newest committed checkpoint in the run folder (mindscale/train/commit.py; a full
resume: weights, optimizer, loss scale, data position) -> `checkpoint.load_path` (weights only, for
fine-tuning) -> fresh init.
With LoRA (finetune.lora.rank > 0) checkpoints hold only the adapters: the frozen base always comes
from `checkpoint.load_path`, and a resume puts the saved adapters on top of it.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor

import models
from mindscale.train import checkpoint as ckpt, commit, faults
from mindscale.train.heartbeat import Heartbeat
from mindscale.config import Config, ConfigError
from mindscale.train.data import build_dataset, step_rows
from mindscale.train.evaluate import Evaluator
from mindscale.train.health import HealthGuard, LossSpikes, TrainingDiverged
from mindscale.train.metrics import MetricsLogger
from mindscale.train.schedule import lr_at
from mindscale.train.profiling import ProfileWindow
from mindscale.config import Layout
from mindscale.train.runtime import Runtime, set_input_layout
from mindscale.train.step import CONTROL, build_train_graph
from mindscale.train.stop import StopRequest, StopVotes


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def parameters_as_numpy(params, copy: bool = False) -> dict[str, np.ndarray]:
    """Parameter values by name; `copy`: arrays training cannot change (asnumpy may share memory)."""
    return {p.name: np.array(p.asnumpy(), copy=True) if copy else p.asnumpy() for p in params}


class Trainer:
    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg = cfg = models.resolve_model_dims(cfg)  # finetune.hf_dims
        self.rt = rt
        # the layout of the resolved dims (the runtime's parallel context depends on degrees only)
        self.layout = layout = Layout.of(cfg, rt.device_target, rt.world)
        self.run_dir = run_dir_of(cfg)
        # Sharded layouts (Ascend/GPU semi-auto parallel): every rank holds slices, so every rank writes
        # its own checkpoints (with MindSpore's strategy file in <run>/strategy/) and resumes from them.
        # A step is saved once every rank has written its part (mindscale/train/commit.py).
        self.ckpt_root = self.run_dir / "checkpoints"
        self.ckpt_dir = self.ckpt_root / f"rank_{rt.rank}" if layout.sharded else self.ckpt_root
        self.vote = commit.RankVote(rt.world, layout.sharded)
        self.stop_schedule = StopVotes(self.vote, cfg.run.stop_vote_interval)  # sharded runs' stop votes
        self.heartbeat = Heartbeat.of_worker(rt.rank)  # under the launcher: hang watch and goodput
        self.pending = None  # (step, this rank writes, its write, saved healthy) of a save not yet committed
        graph = build_train_graph(cfg, layout)
        self.model, self.network, self.optimizer, self.step_cell = graph.model, graph.network, graph.optimizer, graph.step
        latest = self._resume_point()
        self.start_step = ckpt.checkpoint_step(latest) if latest else 0
        # Read (and verify) what the run starts from before compiling: a bad checkpoint fails in seconds
        start = self._read_start(latest)
        self.spikes = LossSpikes(cfg.train.loss_spike_factor, (start[2] or {}).get("loss_history", ()))
        self.evaluator = Evaluator(cfg, layout, self.model, layout.data_rank(rt.rank), self.heartbeat.alive) \
            if cfg.train.eval_interval else None
        self.batches = self._batches()
        self.first_batch = next(self.batches) if self.start_step < cfg.train.steps else None
        if layout.sharded and self.first_batch is not None:
            # sharded parameters take their local shapes when the step compiles: assign after that
            set_input_layout(layout, len(self.first_batch))
            self.step_cell.compile(*self.first_batch)
            if self.evaluator is not None:
                self.evaluator.compile(self.step_cell)
        self._assign_start(latest, start)

    # -- what a rank holds and saves ------------------------------------------------------------------
    def _held(self, params) -> list:
        """The parameters this rank's graph holds: a pipeline stage compiles only its own (models.weights.held)."""
        return models.weights.held(params, self.step_cell.parameter_layout_dict, self.layout.pp)

    @property
    def saved_params(self) -> list:
        """What checkpoints hold: every weight, or only the trained adapters under LoRA (the base is frozen)."""
        return self._held(self.network.trainable_params() if models.lora_enabled(self.cfg)
                          else self.model.get_parameters())

    @property
    def optimizer_params(self) -> list:
        """Optimizer state to save: moments, step counter, a dynamic loss scale and its counters; not the LR
        table, which comes from the config (so a resumed run may change train.steps or the schedule), nor
        the accumulation buffers (empty between steps), nor what the host sets each step (control.*)."""
        not_state = ({p.name for p in self.model.get_parameters()}
                     | {p.name for p in self.optimizer.learning_rate.get_parameters()})
        return self._held(p for p in self.step_cell.get_parameters() if p.name not in not_state
                          and not p.name.startswith(("accu_grads.", f"{CONTROL}.")))

    def compiled_layouts(self, params) -> dict:
        """A sharded rank's compiled layout of each saved parameter (merged back by models.load_weights)."""
        held = self.step_cell.parameter_layout_dict
        return {p.name: models.weights.saved_layout(held[p.name]) for p in params if p.name in held}

    # -- start-up ---------------------------------------------------------------------------------
    def _resume_point(self) -> Path | None:
        c = self.cfg.checkpoint
        if not (c.resume or c.resume_step is not None):
            return None
        return commit.resume_point(self.ckpt_root, self.ckpt_dir, self.vote, self.rt.rank, c.resume_step)

    def _read_start(self, latest: Path | None):
        """(weights, optimizer state, trainer state, pretrained weights) to start from, read and checked."""
        pretrained = None
        if self.cfg.checkpoint.load_path and (latest is None or models.lora_enabled(self.cfg)):
            pretrained = models.load_pretrained(self.cfg.checkpoint.load_path, self.cfg, sliced=self.layout.sharded)
        if latest is None:
            return None, None, None, pretrained
        weights, optimizer_state, state = ckpt.load_checkpoint(latest, verified=True)
        saved_layout, ours = state.get("layout", {}), ckpt.layout_record(self.cfg, self.layout)
        if saved_layout != ours:
            raise ckpt.CheckpointError(
                f"{latest} was written under the layout {saved_layout or 'unsharded'}, this run is "
                f"{ours or 'unsharded'}; reshard it first: python tools/reshard.py --input {latest} --config "
                "<this run's config> --output <a new run>/checkpoints")
        return weights, optimizer_state, state, pretrained

    def _assign_start(self, latest: Path | None, start) -> None:
        weights, optimizer_state, state, pretrained = start
        layouts, rank = self.step_cell.parameter_layout_dict, self.rt.rank
        if pretrained is not None:
            models.load_weights_into(self.model, pretrained, layouts, rank, self.layout.pp)
        if latest is not None:
            ckpt.assign(self.saved_params, weights, str(latest), layouts, rank)
            if self.step_cell.scale_update is not None:
                # a checkpoint of a fixed-scale run holds no dynamic-scale state: start it at the scale it used
                fresh = {p.name: p.asnumpy() for p in self.step_cell.scale_update.get_parameters()}
                optimizer_state = {**fresh, "loss_scale": np.array(state["loss_scale"], np.float32), **optimizer_state}
            ckpt.assign(self.optimizer_params, optimizer_state, f"{latest} optimizer state", layouts, rank)
            self._say(f"resumed from {latest} at step {state['step']}")
        elif pretrained is not None:
            self._say(f"loaded weights from {self.cfg.checkpoint.load_path} (optimizer state and step start fresh)")

    def _say(self, text: str) -> None:
        if self.rt.is_main:
            print(text, flush=True)

    # -- the loop ---------------------------------------------------------------------------------
    def _batches(self):
        """[rows, seq] tensors for each optimizer step, this rank's micro batches stacked (+ segment_ids
        when packed). Ranks read by their data-parallel index (Layout.data_rank)."""
        g = self.cfg.parallel.gradient_accumulation_steps
        source = iter(build_dataset(self.cfg, self.layout.data_rank(self.rt.rank), self.layout.dp, self.start_step))
        while True:
            micro = [next(source) for _ in range(g)]
            if "segment_ids" in micro[0] and self.layout.attention == "flash":
                raise ConfigError("packed SFT data (segment_ids) needs model.attention=composite: flash attention "
                                  "here has no per-example mask; set it, or preprocess without --pack")
            yield tuple(Tensor(rows) for rows in step_rows(micro))

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
                     "layout": ckpt.layout_record(self.cfg, self.layout)}
            if self.spikes.enabled:
                state["loss_history"] = list(self.spikes.history)
            state.update(self.guard.window.close())  # "healthy" since the previous save
            healthy = state["healthy"]
            if self.layout.sharded:
                state["layouts"] = self.compiled_layouts([*self.saved_params, *self.optimizer_params])
            args = (self.ckpt_dir, step, parameters_as_numpy(self.saved_params, copy=background),
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
        commit.commit(self.ckpt_root, self.ckpt_dir if writes else None, step, self.vote, self.rt.rank,
                      self.cfg.checkpoint.keep_last, healthy)

    def _stop_votes(self, stop: StopRequest | None, step_s: float) -> int:
        """After a step: how many ranks were asked to stop (0: train on). A signal to any rank stops all
        after the same step. Data parallel: the step summed the flags raised before it (TrainStep.stop_flag);
        sharded: a vote every run.stop_vote_interval steps (StopVotes); one process asks itself."""
        if stop is None:
            return 0
        if self.rt.world == 1:
            return int(stop.requested)
        if self.layout.data_parallel_mode:
            return int(round(float(self.step_cell.stop_votes.asnumpy()[0])))
        return self.stop_schedule.after_step(stop.requested, step_s)

    def _raise_stop_flag(self, stop: StopRequest | None) -> None:
        """Before a data-parallel step: this rank's vote for the step's sum (once)."""
        if stop is not None and stop.requested and self.layout.data_parallel_mode \
                and not self.step_cell.stop_flag.asnumpy()[0]:
            self.step_cell.stop_flag.set_data(Tensor(np.ones(1, np.float32)))

    def _set_loss_limit(self) -> np.float32 | None:
        """Before a step, with train.loss_spike_factor: the limit its loss is compared with in the graph."""
        if not self.spikes.enabled:
            return None
        limit = self.spikes.limit()
        self.step_cell.loss_limit.set_data(Tensor(limit))
        return limit

    def _spiked(self, step: int, loss: float, limit: np.float32 | None, overflow: bool) -> bool:
        """After a step: whether the graph skipped its update for a loss over `limit` (said on one line)."""
        if limit is None or not self.spikes.after(loss, limit, overflow):
            return False
        self._say(f"step {step}: loss {loss:.4f} > train.loss_spike_factor={self.spikes.factor} x the median of the "
                  f"last {len(self.spikes.history)} updated steps = {limit:.4f}: optimizer update skipped")
        return True

    def _validate(self, step: int, logger: MetricsLogger) -> None:
        """After step `step`, when train.eval_interval says so: a validation pass, logged with the step."""
        if self.evaluator is not None and self.evaluator.due(step):
            logger.validated(*self.evaluator.validate(self.step_cell))

    def _injected_fault(self, step: int, batch: tuple) -> tuple:
        """Fault injection for the tests: MINDSCALE_FAULT=loss_spike:STEP replaces that step's (1-based)
        labels by random ids, a batch no training has seen: its loss spikes. kill:RANK:STEP and
        hang:RANK:STEP: mindscale/train/faults.py."""
        faults.before_step(self.run_dir, self.rt.rank, step)
        if os.environ.get("MINDSCALE_FAULT") != f"loss_spike:{step}":
            return batch
        labels = np.random.default_rng(step).integers(0, self.cfg.model.vocab_size, batch[1].shape, np.int32)
        return (batch[0], Tensor(labels), *batch[2:])

    def train(self, stop: StopRequest | None = None) -> list[dict]:
        """Train to train.steps, or, when `stop` is requested on any rank, to the end of the step then
        running, and save there (mindscale/train/stop.py)."""
        cfg = self.cfg
        if self.rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        # the loss exists on the last pipeline stage (the others compute zeros): its first rank logs
        logs = self.rt.rank == self.layout.stage_ranks(self.layout.pp - 1)[0]
        logger = MetricsLogger(cfg, self.run_dir, self.rt.device_target, logs, self.start_step)
        profile = ProfileWindow(cfg.profile, self.run_dir / "profile")
        self.guard = guard = HealthGuard(cfg, dynamic_scale=self.step_cell.scale_update is not None)
        records, scale, stopped = [], 0.0, None
        for step in range(self.start_step, cfg.train.steps):
            batch = self._injected_fault(step + 1, self.first_batch if step == self.start_step else next(self.batches))
            self.heartbeat.beat(step)
            profile.before(step)
            self._raise_stop_flag(stop)
            limit = self._set_loss_limit()
            began = time.perf_counter()
            loss, grad_norm, overflow, scale = self.step_cell(*batch)
            loss = float(loss.asnumpy())
            elapsed = time.perf_counter() - began
            profile.after(step)
            scale = float(scale.asnumpy())
            asked, overflow = self._stop_votes(stop, elapsed), bool(overflow.asnumpy())
            spiked = self._spiked(step + 1, loss, limit, overflow)
            self._validate(step + 1, logger)
            record = logger.step(step + 1, loss, float(grad_norm.asnumpy()), elapsed, overflow,
                                 lr_at(step, cfg.train), scale, force=bool(asked), spiked=spiked)
            if record:
                records.append(record)
            try:
                guard.check(step + 1, loss, overflow, scale, spiked)
            except TrainingDiverged:
                self.finish_saving()  # an earlier save in flight was healthy: commit it
                raise
            if asked:
                stopped = step + 1
                by = f"{stop.reason} here" if stop.requested else "a signal to another rank"
                self._say(f"stopping after step {stopped} of {cfg.train.steps}: asked on {asked} of "
                          f"{self.rt.world} rank(s) ({by}); the same command resumes from the checkpoint")
                break
            interval = cfg.checkpoint.save_interval
            if interval and (step + 1) % interval == 0 and step + 1 < cfg.train.steps:
                logger.saved(self.save(step + 1, scale))
        profile.close()
        logger.close()
        last = stopped or cfg.train.steps
        self.heartbeat.beat(last)
        if (stopped or cfg.checkpoint.save_at_end) and self.start_step < cfg.train.steps:
            blocked = self.save(last, scale)
            self.finish_saving()
            self._say(f"checkpoint: {self.ckpt_dir / ckpt.step_dir_name(last)} (training blocked {blocked:.2f} s)")
        self.finish_saving()
        print(f"rank {self.rt.rank}: weights sha256 {self.weights_digest()}", flush=True)
        return records

    def weights_digest(self) -> str:
        """A digest of every weight, printed by each rank: data-parallel ranks must agree."""
        digest = hashlib.sha256()
        for name, value in sorted(parameters_as_numpy(self._held(self.model.get_parameters())).items()):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        return digest.hexdigest()[:16]
