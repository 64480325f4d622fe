"""One optimizer step as one graph: micro batches, one gradient reduction, unscale, norm, clip, update.

    graph = build_train_graph(cfg, layout)     # model (recompute marked), plan, optimizer, step: what run_train compiles
    loss, grad_norm, overflow, scale = graph.step(tokens[, loss_mask][, segment_ids])

The inputs are the rows as stored, tokens [rows, seq + 1] (the loss network shifts them into inputs and
labels: models.transformer.NextTokenLoss), with SFT data loss_mask [rows, seq], with packed data
segment_ids [rows, seq]; rows = micro_batch_size x micro_steps: a rank's micro batches stacked. With micro_steps > 1 the loss network is wrapped in MicroBatches, which slices the rows into
micro batches inside the graph, as MindSpore's micro-batch cells (`Pipeline` with pipeline stages, else
`GradAccumulation`) do, and returns the sum of their losses. Under semi-auto parallel those marks
make the compiler accumulate each parameter's gradient into an `accu_grads.*` buffer and reduce
it once per step (MindSpore's _MirrorMicroStepOperator); the step reads those buffers and zeroes
them, or, with the optimizer shard, reads the reduce-scattered gradients (MindFormers'
MFPipelineWithLossScaleCell does the same). In a data-parallel run (CPU) the gradients of the
summed loss are reduced once by DistributedGradReducer.

The global gradient norm (clipping, the overflow test of a dynamic loss scale, the logged
grad_norm) must cover every shard. Under semi-auto parallel it is written as MindSpore's parallel
compiler expects: Square, ReduceSum, Cast, and ExpandDims marked `grad_scale`; the compiler divides
each replicated parameter's share by its replica count and all-reduces the sum over the stage's
ranks and across stages. On CPU the squared norm is a 1 x n . n x 1 MatMul (6x faster there than
Square + ReduceSum, measured on the peer config). Either squares in fp32.

A step overflows when that norm is not finite, or, where fp16 saturates instead of giving inf
(an Ascend 910A: `saturates_fp16`), when the device's float status says so (`FloatStatus`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero, initializer
from mindspore.communication import get_group_size
from mindspore.ops.composite import add_flags
from mindspore.ops.operations.math_ops import NPUClearFloatStatusV2, NPUGetFloatStatusV2

import models
from mindscale.config import Config, Layout
from mindscale.train.loop.optim import build_optimizer
from models.moe import MoE
from models.transformer import MOE_STATS, MTP_LOSS

DYNAMIC_SCALE_START = 2.0**16
CONTROL = "control"  # prefix of the step's parameters the host sets each step: control, not state
DYNAMIC_SCALE_WINDOW = 1000
SATURATION_MODE = "SATURATION_MODE"  # MS_ASCEND_CHECK_OVERFLOW_MODE's value that makes a 910B saturate fp16 too


def _loss_scale(cfg: Config) -> tuple[float, bool]:
    """(initial scale, dynamic?) from train.loss_scale; 'auto' = dynamic only for fp16."""
    value = cfg.train.loss_scale
    if value == "auto":
        value = "dynamic" if cfg.model.compute_dtype == "float16" else None
    if value == "dynamic":
        return DYNAMIC_SCALE_START, True
    return (1.0 if value is None else float(value)), False


def saturates_fp16(cfg: Config, layout: Layout, environ=os.environ) -> bool:
    """Whether fp16 overflow on the step's device saturates (to ±65504) instead of giving inf/nan, so that a
    finite gradient norm does not prove there was none and the step reads the device's float status too: an
    Ascend 910A (hardware.soc_version ascend910), or any Ascend under MS_ASCEND_CHECK_OVERFLOW_MODE=
    SATURATION_MODE (MindSpore's own test in amp.all_finite and nn.TrainOneStepWithLossScaleCell). The hardware
    profile decides, not the chip MindSpore reports (none under the dry run), so the dry run compiles what a
    910A runs."""
    return layout.device == "Ascend" and (
        cfg.hardware.soc_version == "ascend910" or environ.get("MS_ASCEND_CHECK_OVERFLOW_MODE") == SATURATION_MODE
    )


class FloatStatus(nn.Cell):
    """Whether any op overflowed since the last read, from Ascend's float-status register; with `reduce`, on
    any rank (summed over all of them, so that every rank skips the same step). Read after `after` and
    cleared once read, for the next step, in MindSpore's order (nn.TrainOneStepWithLossScaleCell): the clear
    after the all-reduce, so that an overflow of the all-reduce itself does not count against the next step."""

    def __init__(self, reduce: bool):
        super().__init__()
        self.zeros = Tensor([0] * 8, ms.int32)  # the primitives' input: it only orders them
        self.read = NPUGetFloatStatusV2()
        self.clear = NPUClearFloatStatusV2()
        self.sum = ops.AllReduce() if reduce else None

    def construct(self, after):
        status = self.read(ops.depend(self.zeros, after))
        if self.sum is not None:
            status = self.sum(status)
        cleared = self.clear(ops.depend(self.zeros, status))
        return ops.depend(ops.not_equal(status, 0).any(), cleared)


_dot_squared_norm = ops.MultitypeFuncGraph("dot_squared_norm")
_grad_scale_squared_norm = ops.MultitypeFuncGraph("grad_scale_squared_norm")
_unscale_and_clear = ops.MultitypeFuncGraph("unscale_and_clear")
_grad_scale_expand = ops.ExpandDims().add_prim_attr("grad_scale", True)


@_dot_squared_norm.register("Function", "Tensor")
def _dot_squared_norm_of(dot, grad):
    """sum(g²) as a 1×n·n×1 MatMul, shape [1]. Mapped with HyperMap: a Python comprehension is
    unrolled into nested graph calls, which doubled compile time and broke the call-depth limit at 80 layers."""
    flat = ops.cast(grad, ms.float32).reshape(1, -1)
    return dot(flat, flat).reshape((1,))


@_grad_scale_squared_norm.register("Tensor")
def _grad_scale_squared_norm_of(grad):
    """sum(g²) of this rank's slice, shape [1], in the pattern the parallel compiler completes over shards.
    Squared in fp32: an fp16 gradient's square overflows from |g| > 255 and its sum soon after."""
    return _grad_scale_expand(ops.reduce_sum(ops.square(ops.cast(grad, ms.float32))), 0)


@_unscale_and_clear.register("Tensor", "Bool", "Tensor", "Tensor")
def _unscale_and_clear_buffer(inverse, read_buffer, grad, buffer):
    """The step's gradient x inverse (a new tensor), then the accumulation buffer is zeroed for the next
    step. The gradient is the buffer, or with the optimizer shard the reduce-scattered `grad`."""
    buffer = ops.depend(buffer, grad)  # read after the backward pass (and, for MindSpore, after micro batch 0)
    value = (buffer if read_buffer else grad) * ops.cast(inverse, grad.dtype)
    buffer = ops.depend(buffer, value)
    # zeros computed from the buffer, as MindFormers does: ops.zeros_like would be folded into a constant
    # as large as the buffer (measured: +4 GiB of host memory per 4 LLaMA-7B layers at compile), and
    # buffer * 0 keeps a NaN that an fp16 overflow left behind
    zeros = ops.cast(ops.equal(buffer, buffer), buffer.dtype) * 0
    return ops.depend(value, ops.assign(buffer, zeros))


PIPELINE_END = "pipeline_end"  # the marks of MindSpore's Pipeline cell
GRAD_ACCUMULATION_END = "forward_end"  # and of its GradAccumulation cell


class MicroBatches(nn.Cell):
    """(tokens[, loss_mask][, segment_ids]), each a step's rows stacked [micro_steps x rows, ...] ->
    the sum of `network`'s outputs over the micro batches, micro batch i being rows [i*rows, (i+1)*rows).

    It puts in the graph what MindSpore's micro-batch cells do (parallel.nn's Pipeline and GradAccumulation,
    over nn's _MicroBatch), the same primitives with the same marks: a StridedSlice of every input per micro
    batch, and an Add per micro batch after the first, marked `end_mark` (PIPELINE_END or GRAD_ACCUMULATION_END;
    none for inference). It is written out rather than built from those cells because theirs pass the inputs
    as a varargs tuple into one cell per micro batch, which builds each slice's bounds in a loop: the
    compiler's bookkeeping of those tuples grew faster than the micro-batch count (docs/dryrun.md, "Compile
    time against micro batches": 74.8 -> 47.2 s at 256 micro batches)."""

    def __init__(self, network: nn.Cell, layout: Layout, end_mark: str | None):
        super().__init__(auto_prefix=False)
        self.network = network
        self.micro_steps = layout.micro_steps
        self.slices = []
        self.adds = []
        for i in range(self.micro_steps):
            slice_op = ops.StridedSlice()
            if end_mark == GRAD_ACCUMULATION_END:
                slice_op.add_prim_attr("grad_accu_num", self.micro_steps)
            if layout.sharded:
                slice_own_rows(slice_op, layout.dp)
            self.slices.append(slice_op)
            self.adds.append(ops.Add() if end_mark is None else ops.Add().add_prim_attr(end_mark, i))
        self._get_attr_from_cell(network)

    def construct(self, tokens, loss_mask=None, segment_ids=None):
        rows, length = tokens.shape[0] // self.micro_steps, tokens.shape[1]
        total = None
        for i in range(self.micro_steps):
            begin, strides = (i * rows, 0), (1, 1)
            micro = self.slices[i](tokens, begin, ((i + 1) * rows, length), strides)
            if loss_mask is None:  # the network takes only the arguments fed: each costs compile time
                out = self.network(micro)
            else:
                end = ((i + 1) * rows, length - 1)
                mask = self.slices[i](loss_mask, begin, end, strides)
                if segment_ids is None:
                    out = self.network(micro, mask)
                else:
                    out = self.network(micro, mask, self.slices[i](segment_ids, begin, end, strides))
            total = out if total is None else self.adds[i](total, out)
        return total


def micro_batched(loss_network: nn.Cell, layout: Layout, copies: int = 1) -> nn.Cell:
    """The loss network the step differentiates: with several micro batches a step, MicroBatches, marked
    for the pipeline or for accumulation. Sharded, micro batch i of a rank is rows [i*mbs, (i+1)*mbs) of
    its own feed (slice_own_rows). With `copies` > 1 (communication.micro_batch_interleave) each micro batch
    runs the loss network on that many slices of its rows (MindSpore's MicroBatchInterleaved, inside the micro
    batches as MindFormers wraps it), whose losses it sums."""
    if copies > 1:
        loss_network = nn.MicroBatchInterleaved(loss_network, copies)
    if layout.pp > 1:
        return MicroBatches(loss_network, layout, PIPELINE_END)
    if layout.micro_steps > 1:
        return MicroBatches(loss_network, layout, GRAD_ACCUMULATION_END)
    return loss_network


def slice_own_rows(slice_op: ops.Primitive, dp: int) -> None:
    """Make a micro-batch StridedSlice take the rank's own rows. Unmarked, MindSpore gives it strategy (1, 1):
    every rank all-gathers the step's whole global batch of each input and slices the micro batch from it
    (docs/dryrun.md, "Which rows a rank computes on"). Split (dp, 1) and not redistributed, the compiler
    divides the row range by dp instead, and no row moves. A pipeline stage's slices take their strategy
    from the pipeline pass, which reads `out_shard_size` under PIPELINE_SLICE_SKIP_REDISTRIBUTION=1
    (train/loop/runtime.py sets it)."""
    slice_op.shard(((dp, 1),))
    slice_op.add_prim_attr("skip_redistribution", True)
    slice_op.add_prim_attr("out_shard_size", dp)


EXPERT_LOAD = "expert_load"  # prefix of ExpertBalance's token counters: zero between steps, not state


class BiasUpdate(nn.Cell):
    """One expert layer's auxiliary-loss-free update: construct(apply) moves the router bias by
    rate x sign(mean load - load) of its counter when `apply`, and zeroes the counter either way.

    Under pipeline stages it needs no stage of its own: the bias and the counter belong to the stage whose
    layer reads them in the forward, and MindSpore's pipeline pass keeps in each stage's step only the ops on
    the parameters that stage holds, as it does the optimizer's updates (its ElimParameter, in MindSpore's
    pipeline_transformer.cc; tests/dryrun/test_expert_balance.py reads it from both stages' compiled graphs)."""

    def __init__(self, counter: Parameter, bias: Parameter, rate: float, sum_ranks: bool):
        super().__init__(auto_prefix=False)
        # read and assigned here, not owned: the counter is ExpertBalance's, the bias a weight of the model
        object.__setattr__(self, "counter", counter)
        object.__setattr__(self, "bias", bias)
        self.rate = rate
        self.sum_ranks = ops.AllReduce() if sum_ranks else None
        self.mean = ops.ReduceMean(keep_dims=True).shard(((1,),))
        self.below_mean = ops.Sub().shard(((1,), (1,)))
        self.sign = ops.Sign().shard(((1,),))
        self.move = ops.Mul().shard(((1,), ()))
        self.add = ops.Add().shard(((1,), (1,)))
        self.keep = ops.Select().shard(((), (1,), (1,)))
        self.assign = ops.Assign().shard(((1,), (1,)))
        self.zero = ops.Mul().shard(((1,), ()))
        self.clear = ops.Assign().shard(((1,), (1,)))

    def construct(self, apply):
        load = self.counter * 1.0  # read before the counter is zeroed below
        if self.sum_ranks is not None:
            load = self.sum_ranks(load)
        step = self.move(self.sign(self.below_mean(self.mean(load, 0), load)), self.rate)
        bias = self.keep(apply, self.add(self.bias, step), self.bias)
        moved = self.assign(self.bias, bias)
        counter = ops.depend(self.counter, moved)
        return ops.depend(moved, self.clear(counter, self.zero(counter, 0.0)))


class ExpertBalance(nn.Cell):
    """DeepSeek-V3's auxiliary-loss-free load balancing (its report §2.1.2; Megatron's moe_router_enable_expert_bias):
    after an optimizer step, each sigmoid router's bias b [E] moves by rate x sign(mean_e load_e - load_e),
    load_e the tokens that chose expert e over the whole global batch.

    Each mixture-of-experts layer adds its tokens' counts to a counter [E] of this cell every micro batch
    (models.moe.MoE.attach_load_counter). Under semi-auto parallel each count is already the global micro
    batch's: the parallel compiler all-reduces it in the forward over the ranks that split the tokens (data x
    context parallel; the tensor-parallel ranks route the same tokens). In a data-parallel run each layer's
    BiasUpdate sums its counter over the workers by an AllReduce of its own. Every rank then adds the same step
    to the same bias, when the step applies its update, and the counters start the next step at 0. Under
    pipeline stages each stage counts and moves the biases of its own layers; `apply` comes from the global
    gradient norm, all-reduced across stages, so every stage skips the same steps."""

    def __init__(self, network: nn.Cell, rate: float, layout: Layout):
        super().__init__(auto_prefix=False)
        layers = [c for _, c in network.cells_and_names() if isinstance(c, MoE) and c.routing is not None]
        self.counters = ms.ParameterTuple(
            Parameter(
                initializer(Zero(), (moe.num_experts,), ms.float32),
                name=f"{EXPERT_LOAD}.{moe.routing.router_bias.name}",  # expert_load.layers.3.feed_forward...
                requires_grad=False,
            )
            for moe in layers
        )
        for counter, moe in zip(self.counters, layers):
            moe.attach_load_counter(counter)
        self.updates = nn.CellList(
            [
                BiasUpdate(counter, moe.routing.router_bias, rate, layout.data_parallel_mode)
                for counter, moe in zip(self.counters, layers)
            ]
        )

    def construct(self, apply):
        done = None
        for update in self.updates:
            moved = update(apply)
            done = moved if done is None else ops.depend(done, moved)
        return done


class TrainStep(nn.Cell):
    """(tokens[, loss_mask][, segment_ids]) -> (loss, grad_norm, overflow, loss scale). The update is
    skipped when the gradients are not finite (`overflow`) or the loss exceeds `loss_limit` (when set)."""

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, cfg: Config, layout: Layout):
        super().__init__(auto_prefix=False)
        self.network = network
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        # the network's output sums one loss per micro batch and copy (communication.micro_batch_interleave)
        self.summed_losses = layout.micro_steps * cfg.communication.micro_batch_interleave
        self.grad_clip = cfg.train.grad_clip
        self.grad_fn = ops.GradOperation(get_by_list=True, sens_param=True)
        scale, dynamic = _loss_scale(cfg)
        # A fixed scale is a constant of the graph; only a dynamic one is state (a Parameter, checkpointed).
        self.loss_scale = (
            Parameter(Tensor(scale, ms.float32), name="loss_scale", requires_grad=False)
            if dynamic
            else Tensor(scale, ms.float32)
        )
        self.scale_update = nn.DynamicLossScaleUpdateCell(scale, 2.0, DYNAMIC_SCALE_WINDOW) if dynamic else None
        # the factor is identically 1 without clipping or loss scale: skip the pass over the gradients
        self.rescale = cfg.train.grad_clip > 0 or (not layout.accumulates_in_graph and (dynamic or scale != 1.0))
        self.hyper_map = ops.HyperMap()
        self.accumulated = layout.accumulates_in_graph
        self.read_buffers = self.accumulated and not layout.optimizer_shard
        if self.accumulated:
            self.accu_grads = self.weights.clone(prefix="accu_grads", init="zeros")
        self.cpu_norm = layout.cpu_kernels
        self.float_status = (
            FloatStatus(reduce=layout.sharded or layout.data_parallel_mode) if saturates_fp16(cfg, layout) else None
        )
        self.dot = ops.MatMul(transpose_b=True)
        # train.loss_spike_factor: the host sets the step's limit (factor x recent median, health.LossSpikes);
        # the step compares its global loss with it before the update, so a spiking batch never updates
        self.loss_limit = (
            None
            if cfg.train.loss_spike_factor is None
            else Parameter(Tensor(float("inf"), ms.float32), name=f"{CONTROL}.loss_limit", requires_grad=False)
        )
        self.data_parallel = layout.data_parallel_mode
        self.reducer = nn.DistributedGradReducer(self.weights, mean=True) if self.data_parallel else nn.Identity()
        if self.data_parallel:
            self.loss_sum = ops.AllReduce()
            self.world = get_group_size()
            # The graceful-stop vote (mindscale/train/resilience/stop.py) rides on the loss's all-reduce: the host
            # raises stop_flag, the step sums it over the ranks into stop_votes. A vote graph of its own
            # after every step cost ~9 ms of host time per step on the 2-worker CPU tests (25-60 ms steps).
            # (Sharded graphs vote with RankVote: their step holds no all-reduce of its own to share.)
            self.stop_flag = Parameter(Tensor([0.0], ms.float32), name=f"{CONTROL}.stop_flag", requires_grad=False)
            self.stop_votes = Parameter(Tensor([0.0], ms.float32), name=f"{CONTROL}.stop_votes", requires_grad=False)
        rate = cfg.model.moe.bias_update_rate
        self.balance = ExpertBalance(network, rate, layout) if rate else None

    def squared_norms(self, grads):
        if self.cpu_norm:
            return self.hyper_map(ops.partial(_dot_squared_norm, self.dot), grads)
        return self.hyper_map(_grad_scale_squared_norm, grads)

    @add_flags(has_effect=True)
    def construct(self, *inputs):
        # The forward comes first: under semi-auto accumulation MindSpore tags the first op that reads a
        # parameter as the end of micro batch 0's backward, so it must be an op of the network.
        loss = self.network(*inputs)
        # the micro-batch cell sums micro-batch losses: the sens averages them
        sens = ops.ones_like(loss) * ops.cast(self.loss_scale, loss.dtype) / self.summed_losses
        grads = self.grad_fn(self.network, self.weights)(*inputs, sens)
        scale = ops.cast(self.loss_scale, ms.float32)  # this step's scale (the update below may change it)
        inverse = 1.0 / scale
        if self.accumulated:  # read out of the buffers unscaled (a copy: the buffers are zeroed)
            grads = self.hyper_map(ops.partial(_unscale_and_clear, inverse, self.read_buffers), grads, self.accu_grads)
            factor = 1.0
        else:  # still scaled: unscaled and clipped in one pass below (the norm of the scaled ones x inverse)
            grads = self.reducer(grads)
            factor = inverse
        grad_norm = ops.sqrt(ops.addn(self.squared_norms(grads))).reshape(()) * factor
        overflow = ops.logical_not(ops.isfinite(grad_norm))
        if self.float_status is not None:  # read after the norm: the whole backward (and the norm) ran
            overflow = ops.logical_or(overflow, self.float_status(grad_norm))
        if self.scale_update is not None:
            overflow = self.scale_update(self.loss_scale, overflow)
        if self.grad_clip > 0:
            factor = factor * (self.grad_clip / ops.maximum(grad_norm, self.grad_clip))
        if self.rescale:
            grads = self.hyper_map(ops.partial(ops.mul, factor), grads)
        loss = loss / self.summed_losses
        if self.data_parallel:  # the global batch's loss, not this rank's share
            sums = self.loss_sum(ops.concat((ops.cast(loss, ms.float32).reshape((1,)), self.stop_flag)))
            loss = ops.depend(ops.cast(sums[0], loss.dtype) / self.world, ops.assign(self.stop_votes, sums[1:]))
        skip = overflow
        if self.loss_limit is not None:
            skip = ops.logical_or(overflow, ops.cast(loss, ms.float32) > self.loss_limit)
        if not skip:
            loss = ops.depend(loss, self.optimizer(grads))
        if self.balance is not None:  # under the same condition: a skipped step leaves the biases too
            loss = ops.depend(loss, self.balance(ops.logical_not(skip)))
        return loss, grad_norm, overflow, scale


@dataclass
class TrainGraph:
    model: nn.Cell  # CausalLM: parameters by their checkpoint names
    network: nn.Cell  # what the step differentiates (the loss network, micro-batched)
    optimizer: nn.Optimizer
    step: TrainStep

    def optimizer_state(self) -> list:
        """The step's parameters a checkpoint saves as optimizer state: moments, step counter, a dynamic
        loss scale and its counters; not the weights, nor a mixture of experts' router statistics or the multi-token
        prediction's loss term, nor the LR table, which comes from the config (so a
        resumed run may change train.steps or the schedule), nor the accumulation buffers (empty between
        steps), nor what the host sets each step (control.*), nor the expert token counters (expert_load.*, zero
        between steps; the router biases they move are weights of the model)."""
        not_state = {p.name for p in self.model.get_parameters()} | {
            p.name for p in self.optimizer.learning_rate.get_parameters()
        }
        return [
            p
            for p in self.step.get_parameters()
            if p.name not in not_state
            and p.name not in (MOE_STATS, MTP_LOSS)
            and not p.name.startswith(("accu_grads.", f"{CONTROL}.", f"{EXPERT_LOAD}."))
        ]


def build_train_graph(cfg: Config, layout: Layout) -> TrainGraph:
    """The graph run_train.py trains and tools/dryrun.py compiles: one function, so they cannot differ."""
    model = models.build_model(cfg, layout)
    network = micro_batched(
        models.build_train_network(cfg, model, layout), layout, cfg.communication.micro_batch_interleave
    )
    models.apply_sharding_plan(model, cfg, layout)
    optimizer = build_optimizer(network.trainable_params(), cfg.train)
    step = TrainStep(network, optimizer, cfg, layout)
    step.set_train(True)
    return TrainGraph(model, network, optimizer, step)
