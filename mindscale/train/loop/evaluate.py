"""Validation loss during training (train.eval_interval): a forward-only graph over held-out data.

    evaluator = Evaluator(cfg, layout, model, data_rank)   # checks data.valid_path before anything compiles
    if evaluator.due(step): val_loss, seconds, by_source = evaluator.validate(train_step)

The held-out set is the first train.eval_steps x global_batch_size sequences of data.valid_path in
stored order (never shuffled). A data.valid_blend of several sources is validated a source at a time, so
that each has a loss of its own: source k gives the first e_k x global_batch_size sequences of its folder,
in stored order, e_k its weight's share of train.eval_steps rounded to whole steps and at least one
(`steps_per_source`); the pass's val_loss is over all of them. A pass feeds them as training feeds its
steps: a step's rows per call and data-parallel rank (its micro batches stacked, sliced in the graph:
EvalStep), in the stream order of mindscale/train/data/dataset.py (shuffle off, from position 0), so
rank r reads its share of every micro batch and the set is the same whatever the world size. Each
micro batch gives the sum of its token losses and its token count; a call adds them over its micro
batches and its ranks (data parallel: one all-reduce; sharded: the loss is already the global micro
batch's mean and the compiler reduces the count over data parallel); the pass's loss is the sum of the
sums over the sum of the counts, a token-weighted mean, so 1 and 2 workers agree; a source's loss is the
same over its own calls (every call holds one source's rows).

The graph is compiled once, at the first pass (sharded layouts: at start-up, next to the training
step), and reused: every call has the same shapes. It reads the training weights and writes nothing,
and reads its own data stream, so training numbers and the data position of a resume do not change.
"""

from __future__ import annotations

import dataclasses
import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindscale.config import Config, ConfigError, Layout
from mindscale.train.data.blend import normalized
from mindscale.train.data.dataset import (
    SYNTHETIC,
    batch_plan,
    build_dataset,
    configured_sources,
    read_manifest,
    step_rows,
    stored_stream,
)
from mindscale.train.loop.step import MicroBatches, micro_batched
from models.transformer import NextTokenLoss


def held_out_config(cfg: Config) -> Config:
    """The config whose "valid" data stream is the held-out set: data.valid_path or data.valid_blend, in
    stored order."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shuffle=False))


class HeldOutLoss(nn.Cell):
    """One micro batch -> [sum of token losses, token count], float32 [2]: of this rank's rows, or sharded
    of the global micro batch (the model's loss is then already the global mean)."""

    def __init__(self, model: nn.Cell, layout: Layout):
        super().__init__(auto_prefix=False)
        # the model's own masked mean next-token loss (no multi-token-prediction or balance term), fed as training is
        self.network = NextTokenLoss(model, layout, training=False)
        self.count = ops.ReduceSum()
        if layout.sharded:  # the count of the global batch: a sum over the data-parallel split
            self.count.shard(((layout.dp, 1),))

    def construct(self, tokens, loss_mask=None, segment_ids=None):
        if loss_mask is None:  # every label: the (static) token count, the global batch's when sharded
            loss = ops.cast(self.network(tokens), ms.float32)
            count = ops.scalar_to_tensor(float(tokens.shape[0] * (tokens.shape[1] - 1)), ms.float32)
        else:
            loss = ops.cast(self.network(tokens, loss_mask, segment_ids), ms.float32)
            count = self.count(loss_mask)
        return ops.concat(((loss * count).reshape((1,)), count.reshape((1,))))


class ReusedHeldOutLoss(HeldOutLoss):
    """HeldOutLoss compiled once and called per micro batch, as the training step's loss network is in the
    same layouts (Layout.graph_reuse "model", models.transformer.ReusedNextTokenLoss)."""

    @ms.lazy_inline(attrs="graph_key")
    def __init__(self, model: nn.Cell, layout: Layout):
        super().__init__(model, layout)
        self.graph_key = "held-out loss"


class EvalStep(nn.Cell):
    """A step's rows (tokens[, loss_mask][, segment_ids]) -> [sum of token losses, token count] over
    all ranks, float32 [2]. The micro batches go through the micro-batch cell the training step uses
    (mindscale.train.loop.step.micro_batched), which adds their sums, or with pipeline stages through
    MicroBatches unmarked: forward only, MindSpore 2.9's pattern for pipeline inference (a plain loop over
    the micro batches through the lazy_inline loss network, as in the example of
    mindspore.parallel.sync_pipeline_shared_parameters), since its Pipeline cell is for training only. The
    sums are those of the last stage, whose first rank logs them. Sharded layouts with gradient accumulation are refused (validate.py): under the dry
    run MindSpore 2.9 compiled such a forward graph neither plainly ("Cannot find micro info for node") nor
    in GradAccumulation or a loop ("Current not support predict with grad_accu")."""

    def __init__(self, model: nn.Cell, layout: Layout):
        super().__init__(auto_prefix=False)
        if layout.pp > 1:
            loss = (ReusedHeldOutLoss if layout.graph_reuse == "model" else HeldOutLoss)(model, layout)
            self.network = MicroBatches(loss, layout, end_mark=None)
        else:
            self.network = micro_batched(HeldOutLoss(model, layout), layout)
        self.data_parallel = layout.data_parallel_mode
        self.sum_ranks = ops.AllReduce() if self.data_parallel else None

    def construct(self, *inputs):
        sums = self.network(*inputs)
        if self.data_parallel:
            sums = self.sum_ranks(sums)
        return sums


class Evaluator:
    """Validation passes of one rank; every rank runs each pass (it holds collectives)."""

    def __init__(self, cfg: Config, layout: Layout, model: nn.Cell, data_rank: int, alive=lambda: None):
        self.cfg = cfg
        self.alive = alive  # Heartbeat.alive: a pass runs between two training heartbeats
        self.layout = layout
        self.data_rank = data_rank
        self.held_out = held_out_config(cfg)
        self._check_data()
        self.step = EvalStep(model, layout)

    def _check_data(self) -> None:
        """The held-out folders match the model (build_dataset's checks, and their checksums when it builds the
        split's index), hold the training data's fields and enough sequences: a short pass (or a source read
        past its end) would silently change what val_loss means."""
        stream = build_dataset(self.held_out, self.data_rank, self.layout.dp, split="valid")
        self.sources = stream.sources
        self.steps = steps_per_source([s.weight for s in self.sources], self.cfg.train.eval_steps)
        t, batch = self.cfg.train, self.cfg.samples_per_step
        trained = (
            stream.manifest["fields"]
            if self.cfg.data.path == SYNTHETIC and not self.cfg.data.blend
            else read_manifest(configured_sources(self.cfg)[0][1])["fields"]
        )
        first = stream.sources[0]
        if trained != first.manifest["fields"]:
            raise ConfigError(
                f"{first.key}={first.path} holds {first.manifest['fields']} but the training data "
                f"holds {trained}; preprocess both the same way (tools/preprocess_data.py "
                "--valid-fraction writes a matching split)"
            )
        needed = t.eval_steps * batch
        for source, steps in zip(stream.sources, self.steps):
            held = source.manifest["num_samples"]
            if held >= steps * batch:
                continue
            if len(stream.sources) > 1:
                raise ConfigError(
                    f"{source.key}={source.path} holds {held} sequences but its share of train."
                    f"eval_steps={t.eval_steps}, {steps} step(s) x global batch {batch}, needs "
                    f"{steps * batch}; lower train.eval_steps or its weight, or hold out more"
                )
            # train.eval_steps must be >= 1 (validate.py): below one global batch only more held-out data helps
            fix = (
                f"set train.eval_steps <= {held // batch} or hold out more"
                if held >= batch
                else f"hold out at least {batch} sequences, one global batch"
            )
            raise ConfigError(
                f"{source.key}={source.path} holds {held} sequences but train.eval_steps="
                f"{t.eval_steps} x global batch {batch} needs {needed}; {fix} (raise "
                "tools/preprocess_data.py --valid-fraction)"
            )

    def due(self, step: int) -> bool:
        """After optimizer step `step` (1-based): every train.eval_interval steps and after the last."""
        interval = self.cfg.train.eval_interval
        return bool(interval) and (step % interval == 0 or step == self.cfg.train.steps)

    def batches(self):
        """(source, the call's tensors) of this rank's held-out calls, from the start every time: a step's
        micro batches stacked, as the trainer feeds them. One source: its stream through the split's index;
        a blend: each source's own calls in turn (stored_stream)."""
        g = self.cfg.parallel.gradient_accumulation_steps
        if len(self.sources) == 1:
            streams = [build_dataset(self.held_out, self.data_rank, self.layout.dp, split="valid")]
        else:
            plan = batch_plan(self.held_out, self.data_rank, self.layout.dp)
            streams = (stored_stream(source, plan, steps) for source, steps in zip(self.sources, self.steps))
        for k, (stream, steps) in enumerate(zip(streams, self.steps)):
            batches = iter(stream)
            try:
                for _ in range(steps):
                    micro = [next(batches) for _ in range(g)]  # as the trainer
                    yield k, tuple(Tensor(rows) for rows in step_rows(micro, self.layout.packed_examples))
            finally:
                batches.close()

    def compile(self, train_step: nn.Cell) -> None:
        """Compile the graph now (sharded layouts, after the training step: the weights are sliced by then)."""
        self.step.set_train(False)
        calls = self.batches()
        self.step.compile(*next(calls)[1])
        calls.close()
        train_step.set_train(True)

    def validate(self, train_step: nn.Cell) -> tuple[float, float, dict | None]:
        """(token-weighted mean loss over the held-out set, seconds the pass took, and for a blend of several
        sources each one's loss by its configured path, else None). `train_step` is set back to training mode
        afterwards: the model's cells are shared, and their mode is per cell. A heartbeat (`alive`) before each
        call and after the last keeps the hang watch from taking the pass for a hang."""
        began = time.perf_counter()
        self.step.set_train(False)
        sums = np.zeros((len(self.sources), 2), np.float64)  # per source: [sum of token losses, tokens]
        for k, batch in self.batches():
            self.alive()  # before each call: the first compiles the graph (unsharded layouts)
            sums[k] += self.step(*batch).asnumpy()
        self.alive()
        train_step.set_train(True)
        total = sums.sum(axis=0)
        by_source = (
            {source.path: float(s / max(n, 1.0)) for source, (s, n) in zip(self.sources, sums)}
            if len(self.sources) > 1
            else None
        )
        return float(total[0] / max(total[1], 1.0)), time.perf_counter() - began, by_source


def steps_per_source(weights: list[float], eval_steps: int) -> list[int]:
    """Calls of each source in a held-out pass: all train.eval_steps for one source; in a blend, each source's
    weight share of them rounded to whole steps (halves up), at least one."""
    if len(weights) == 1:
        return [eval_steps]
    return [max(1, int(np.floor(share * eval_steps + 0.5))) for share in normalized(weights)]
