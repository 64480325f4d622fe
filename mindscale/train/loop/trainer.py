"""The pretraining / fine-tuning loop behind run_train.py. What it starts from, and every save, commit
and prune of its checkpoints: mindscale/train/checkpoints/checkpointer.py.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import numpy as np
from mindspore import Tensor

import models
from mindscale.config import Config, Layout, validate_packed
from mindscale.train.checkpoints import commit
from mindscale.train.checkpoints.checkpointer import Checkpointer, parameters_as_numpy
from mindscale.train.data.dataset import build_dataset, step_rows
from mindscale.train.loop.compile_cache import CompileCache
from mindscale.train.loop.evaluate import Evaluator
from mindscale.train.loop.metrics import MetricsLogger
from mindscale.train.loop.profiling import ProfileWindow
from mindscale.train.loop.runtime import Runtime, set_input_layout
from mindscale.train.loop.schedule import lr_at, schedule_change
from mindscale.train.loop.step import build_train_graph
from mindscale.train.resilience import faults
from mindscale.train.resilience.health import HealthGuard, LossSpikes, TrainingDiverged
from mindscale.train.resilience.heartbeat import Heartbeat
from mindscale.train.resilience.stop import StopRequest, StopVotes
from models.transformer import MOE_STATS, MTP_LOSS


@dataclass(frozen=True)
class StepResult:
    """One optimizer step as the host reads it after the compiled step returned."""

    step: int  # 1-based
    loss: float
    grad_norm: float
    overflow: bool  # non-finite gradients: the update was skipped
    loss_scale: float
    seconds: float  # the compiled step alone
    data_wait: float  # seconds the loop waited for the step's batch
    loss_limit: np.float32 | None  # train.loss_spike_factor's limit the graph compared the loss with


class Trainer:
    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg = cfg = models.resolve_model_dims(cfg)  # finetune.hf_dims
        self.rt = rt
        # the layout of the resolved dims (the runtime's parallel context depends on degrees only)
        self.layout = layout = Layout.of(cfg, rt.device_target, rt.world)
        self.run_dir = cfg.run_dir
        vote = commit.RankVote(rt.world, layout.sharded)  # a save's commit, and sharded runs' stop votes
        self.stop_schedule = StopVotes(vote, cfg.run.stop_vote_interval)
        self.heartbeat = Heartbeat.of_worker(rt.rank)  # under the launcher: hang watch and goodput
        graph = build_train_graph(cfg, layout)
        self.model, self.network, self.optimizer, self.step_cell = (
            graph.model,
            graph.network,
            graph.optimizer,
            graph.step,
        )
        self.moe_stats = next((p for p in graph.step.get_parameters() if p.name == MOE_STATS), None)
        self.mtp_loss = next((p for p in graph.step.get_parameters() if p.name == MTP_LOSS), None)
        self.checkpoints = Checkpointer(
            cfg, layout, rt, graph, self.run_dir / "checkpoints", self.heartbeat, vote, self._saved_state
        )
        start = self.checkpoints.read_start()
        self.start_step = start.step
        moved = schedule_change(start.config.get("train", {}), cfg.train, start.step) if start.checkpoint else None
        if moved:
            rt.say(moved)
        self.spikes = LossSpikes(cfg.train.loss_spike_factor, start.state.get("loss_history", ()))
        self.evaluator = (
            Evaluator(cfg, layout, self.model, layout.data_rank(rt.rank), self.heartbeat.alive)
            if cfg.train.eval_interval
            else None
        )
        self._open_data()
        if self.first_batch is not None and (layout.sharded or cfg.run.mode == "graph"):
            # sharded parameters take their local shapes when the step compiles: assign after that
            self._compile_step()
        self.checkpoints.assign_start(start)

    def _open_data(self) -> None:
        """This rank's batches from the start step (none when the run is already trained), and the first of
        them, read before the step compiles: the wait for it is the first step's data_wait_s."""
        if self.start_step < self.cfg.train.steps:
            self.stream = build_dataset(self.cfg, self.layout.data_rank(self.rt.rank), self.layout.dp, self.start_step)
        else:
            self.stream = None
        if self.stream is not None and self.stream.sources:
            self.rt.say(self.stream.describe())  # the run log's header: each source's share
        self.batches = self._batches()
        began = time.perf_counter()
        self.first_batch = next(self.batches) if self.stream is not None else None
        self.first_batch_wait = time.perf_counter() - began

    def _compile_step(self) -> None:
        """Compile the train step for the first batch (and, sharded, the validation step beside it). It is the
        process's first compile, the one MindSpore's compile cache holds (compile_cache.py)."""
        layout, rt = self.layout, self.rt
        if layout.sharded:
            set_input_layout(layout, len(self.first_batch))
        cache = CompileCache.of(self.cfg, layout, self.run_dir, rt.device_target, rt.rank)
        if cache.skipped:
            rt.say(f"compile cache off: {cache.skipped} (run.compile_cache)")
        with cache.compiling(self.step_cell) as compiled:
            self.step_cell.compile(*self.first_batch)
        self.heartbeat.compiled(compiled.seconds, compiled.cache)
        if compiled.cache != "off":
            rt.say(f"compiled the train step in {compiled.seconds:.1f} s (compile cache {compiled.cache})")
        if layout.sharded and self.evaluator is not None:
            self.evaluator.compile(self.step_cell)

    def _saved_state(self) -> dict:
        """The trainer's entries of a save's state.json: the loss-spike history, health since the previous save."""
        spikes = {"loss_history": list(self.spikes.history)} if self.spikes.enabled else {}
        return {**spikes, **self.guard.window.close()}

    # -- the loop ---------------------------------------------------------------------------------
    def _batches(self):
        """[rows, seq] tensors for each optimizer step, this rank's micro batches stacked (+ segment_ids
        when packed). Ranks read by their data-parallel index (Layout.data_rank)."""
        g = self.cfg.parallel.gradient_accumulation_steps
        source = iter(self.stream)
        try:
            while True:
                micro = [next(source) for _ in range(g)]
                if "segment_ids" in micro[0]:
                    validate_packed(self.cfg, self.layout)
                yield tuple(Tensor(rows) for rows in step_rows(micro, self.layout.packed_examples))
        finally:
            source.close()

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
        if (
            stop is not None
            and stop.requested
            and self.layout.data_parallel_mode
            and not self.step_cell.stop_flag.asnumpy()[0]
        ):
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
        self.rt.say(
            f"step {step}: loss {loss:.4f} > train.loss_spike_factor={self.spikes.factor} x the median of the "
            f"last {len(self.spikes.history)} updated steps = {limit:.4f}: optimizer update skipped"
        )
        return True

    def _validate(self, step: int, logger: MetricsLogger) -> None:
        """After step `step`, when train.eval_interval says so: a validation pass, logged with the step."""
        if self.evaluator is not None and self.evaluator.due(step):
            logger.validated(*self.evaluator.validate(self.step_cell))

    def _injected_fault(self, step: int, batch: tuple) -> tuple:
        """Fault injection for the tests: MINDSCALE_FAULT=loss_spike:STEP replaces that step's (1-based)
        tokens by random ids, a batch no training has seen: its loss spikes. kill:RANK:STEP and
        hang:RANK:STEP: mindscale/train/resilience/faults.py."""
        faults.before_step(self.run_dir, self.rt.rank, step)
        if os.environ.get("MINDSCALE_FAULT") != f"loss_spike:{step}":
            return batch
        tokens = np.random.default_rng(step).integers(0, self.cfg.model.vocab_size, batch[0].shape, np.int32)
        return (Tensor(tokens), *batch[1:])

    def train(self, stop: StopRequest | None = None) -> None:
        """Train to train.steps, or, when `stop` is requested on any rank, to the end of the step then
        running, and save there (mindscale/train/resilience/stop.py)."""
        try:
            self._train(stop)
        finally:
            self.batches.close()  # its read-ahead thread leaves MindDataset before the process exits

    def _train(self, stop: StopRequest | None) -> None:
        """The loop, in torchtitan's shape: the step, then the host's work after it."""
        if self.rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(self.cfg.to_yaml())
        logger = MetricsLogger(
            self.cfg,
            self.run_dir,
            self.rt.device_target,
            self.rt.rank == self.layout.logging_rank,
            self.start_step,
            self.stream.drawn if self.stream is not None else None,
        )
        profile = ProfileWindow(self.cfg.profile, self.run_dir / "profile")
        self.guard = HealthGuard(self.cfg, dynamic_scale=self.step_cell.scale_update is not None)
        done, stopped = None, False
        for step in range(self.start_step, self.cfg.train.steps):
            done = self._step(step, stop, profile)
            stopped = self._after_step(done, stop, logger)
            if stopped:
                break
        profile.close()
        logger.close()
        self._end(done.step if stopped else None, done.loss_scale if done is not None else 0.0)

    def _step(self, step: int, stop: StopRequest | None, profile: ProfileWindow) -> StepResult:
        """Optimizer step `step` (0-based): its batch, what the graph reads besides (this rank's stop vote, the
        loss limit), the compiled step, and its outputs on the host."""
        batch, data_wait = self._next_batch(step)
        batch = self._injected_fault(step + 1, batch)
        self.heartbeat.beat(step)
        profile.before(step)
        self._raise_stop_flag(stop)
        limit = self._set_loss_limit()
        began = time.perf_counter()
        loss, grad_norm, overflow, scale = self.step_cell(*batch)
        loss = float(loss.asnumpy())
        seconds = time.perf_counter() - began
        profile.after(step)
        return StepResult(
            step + 1,
            loss,
            float(grad_norm.asnumpy()),
            bool(overflow.asnumpy()),
            float(scale.asnumpy()),
            seconds,
            data_wait,
            limit,
        )

    def _next_batch(self, step: int) -> tuple[tuple, float]:
        """Step `step`'s batch and the seconds waited for it (the first was read before compiling)."""
        if step == self.start_step:
            return self.first_batch, self.first_batch_wait
        waited = time.perf_counter()
        batch = next(self.batches)
        return batch, time.perf_counter() - waited

    def _after_step(self, done: StepResult, stop: StopRequest | None, logger: MetricsLogger) -> bool:
        """The host's work after a step: the ranks' stop votes, loss spikes, validation, the metrics line,
        the health guards, the step's save. True: stop here (the end saves this step)."""
        asked = self._stop_votes(stop, done.seconds)
        spiked = self._spiked(done.step, done.loss, done.loss_limit, done.overflow)
        self._validate(done.step, logger)
        if self.moe_stats is not None:
            logger.routed(*(float(v) for v in self.moe_stats.asnumpy()))
        if self.mtp_loss is not None:
            logger.multi_token(float(self.mtp_loss.asnumpy()[0]))
        logger.step(
            done.step,
            done.loss,
            done.grad_norm,
            done.seconds,
            done.overflow,
            lr_at(done.step - 1, self.cfg.train),
            done.loss_scale,
            force=bool(asked),
            spiked=spiked,
            data_wait=done.data_wait,
        )
        self._check_health(done, spiked)
        if asked:
            self._say_stopping(done.step, asked, stop)
            return True
        blocked = self.checkpoints.after_step(done.step, done.loss_scale)
        if blocked is not None:
            logger.saved(blocked)
        return False

    def _check_health(self, done: StepResult, spiked: bool) -> None:
        """The divergence guards (TrainingDiverged stops the run); an earlier save still in flight was healthy,
        so it is committed first."""
        try:
            self.guard.check(done.step, done.loss, done.overflow, done.loss_scale, spiked)
        except TrainingDiverged:
            self.checkpoints.finish_saving()
            raise

    def _say_stopping(self, step: int, asked: int, stop: StopRequest) -> None:
        by = f"{stop.reason} here" if stop.requested else "a signal to another rank"
        self.rt.say(
            f"stopping after step {step} of {self.cfg.train.steps}: asked on {asked} of "
            f"{self.rt.world} rank(s) ({by}); the same command resumes from the checkpoint"
        )

    def _end(self, stopped: int | None, scale: float) -> None:
        """After the loop (`stopped`: the step a stop ended it after): the last save, and each rank's weights
        digest."""
        last = stopped or self.cfg.train.steps
        self.heartbeat.beat(last)
        self.checkpoints.end(
            last,
            scale,
            save=bool(stopped or self.cfg.checkpoint.save_at_end) and self.start_step < self.cfg.train.steps,
        )
        print(f"rank {self.rt.rank}: weights sha256 {self.weights_digest()}", flush=True)

    def weights_digest(self) -> str:
        """A digest of every weight, printed by each rank: data-parallel ranks must agree."""
        digest = hashlib.sha256()
        for name, value in sorted(parameters_as_numpy(self.checkpoints.held(self.model.get_parameters())).items()):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        return digest.hexdigest()[:16]
