"""A mixture-of-experts feed-forward (Shazeer et al. 2017; GShard, Switch Transformer; Mixtral, Qwen3-MoE),
written as dense, static-shape MindSpore primitives that the semi-auto parallel compiler can shard.

    router      logits = x Wr^T [N, E]; p = softmax(logits) in fp32; the k largest p per token, renormalised
                to sum to 1 when norm_topk_prob (Mixtral always, Qwen3-MoE by its config); or DeepSeek-V3's
                sigmoid router with its correction bias and group limit (models/router.py, `routing`)
    capacity    the N tokens form G groups of T (G = the data x context-parallel ranks under semi-auto
                parallel, else 1: one rank's tokens). Expert e takes at most C tokens of a group, C =
                MoeConfig.capacity(T) (T: dropless). Priority: every token's first choice before any
                second choice, then token order; a token beyond an expert's C passes that expert by
    dispatch    the C tokens of each (group, expert) are found by TopK over a priority score [G, E, T]; a
                batched Gather copies them into the slots [G, E*C, h] (no [T, E*C] one-hot: its BatchMatMuls
                cost twice the experts' FLOPs at Qwen3-30B-A3B's size)
    experts     E SwiGLU experts as batched weights w1, w3 [E, F, h] and w2 [E, h, F], applied to [E, G*C, h]
    combine     each (choice, token) gathers its slot back, found by a cumulative count in the same priority
                order, and weighs it by its routing probability: y [G, T, h]
    shared      optionally a shared SwiGLU expert every token passes (DeepSeek-style, no gate), added

Expert parallel (the `expert` style): the gathered [G, E, C, h], viewed as [ep, G/ep, E, C, h], is transposed
to [E, G/ep, ep, C, h]; the dispatch ops split G over dp and the expert matmuls split E over ep (and G over
dp/ep, F over tp), so the compiler turns the change of split into one AlltoAll over the ranks of each
expert-parallel group and back after w2, as MindFormers' strategy-based MoE (mindformers/modules/transformer/
moe.py, its MoEV2's five-dimensional transposes) does. (Transposed as [E, G, C, h] directly, the target's G
split does not line up with the source's, and MindSpore 2.9 compiled two AlltoAlls for 1 < ep < dp.) The
expert weights [E/ep, F/tp, h] are replicated over dp/ep ranks, whose gradients the compiler reduces
(Megatron's expert-data-parallel group) and whose optimizer shard splits them.

Dropless by GroupedMatmul with dynamic token counts per expert (MindFormers 1.9's parallel_core path,
Megatron's) is `GroupedExperts` (model.moe.dispatch: grouped): the router and statistics are this layer's, the
experts run over each rank's tokens sorted by expert, under expert parallel inside a self-defined shard with
AlltoAllV, because as a strategy op MindSpore 2.9 splits GroupedMatmul's tokens but never its experts
(docs/evidence/dryrun.md, "Dropless by GroupedMatmul"). Otherwise dropless is the capacity T, exact and
static, at E/k times the expert compute and slot buffers of capacity factor 1 (docs/models.md, "Mixture of
experts"; tools/plan.py states the factor).

The layer returns (y [N, h], stats [3]): stats = (the load-balancing loss E sum_e f_e P_e, with f_e the
fraction of tokens choosing e and P_e its mean probability (Switch; Mixtral's form), the busiest expert's
token count over the mean, DeepSeek-V3's sequence-wise balance loss (its report's eq. 17-20: the same sum per
sequence of `seq` tokens, f_e scaled by E/k, averaged over the sequences)). All are computed over the tokens
the loss trains (every group, under semi-auto parallel): the `mask` [B, S] the layer is given, the training
loss's own mask, or all N tokens without one (pretraining, generation).

Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2) counts, in training, how many tokens chose each expert:
the training step attaches a counter `expert_loads` [E] (attach_load_counter; not a weight of the model), to
which every call (micro batch) adds the count of its tokens. Under semi-auto parallel that sum over the tokens
is split like the tokens, so the compiler all-reduces it over the data x context-parallel ranks, once per
layer and micro batch, as it does `token_fraction` of the statistics (a per-rank counter summed once in the
step would not do: under pipeline stages MindSpore 2.9 inserts no collective in the step's update, so each
stage would have moved its biases by its own rows' counts). The step moves the router's bias by the summed
counts (mindscale/train/loop/step.py, ExpertBalance).

Why the loss mask. Padding must not count: a pad token's routing would enter the balance loss, whose gradient
then trains the pad's embedding row and, through the norm of that row (zero in Hugging Face checkpoints, so
scaled by 1/sqrt(eps)), swamps the gradient norm that clipping divides by. transformers'
load_balancing_loss_func takes a mask for the same reason; its models pass their attention_mask, which also
counts the prompt tokens of SFT data. The loss mask is the one mask every batch carries (pretraining: none,
every token trained; SFT, padded or packed: loss_mask), and it needs no input of its own (each input costs
compile time per micro batch, docs/dryrun.md): padded SFT data does not say where an example ends when the
tokenizer pads with its EOS id (preprocess.pad_id_of), so a real-token mask is not at hand. The balance
loss thus weighs the routing of the tokens the cross entropy trains, as the cross entropy does; the prompt
tokens still route and pass their experts. Given the same mask, transformers' function computes this layer's
numbers (tests/models/test_moe_sft_parity.py).
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.ops.auto_generate import GroupedMatmul, SiLU
from mindspore.ops.operations import Morph
from mindspore.parallel import Layout as DeviceMesh

from models.layers import Linear, SwiGLU


class Experts(nn.Cell):
    """E SwiGLU experts as batched weights: construct(x [E, M, h]) -> w2(silu(w1 x) * w3 x) [E, M, h], with
    w1, w3 [E, F, h] and w2 [E, h, F] stored [out, in] per expert as Hugging Face stores each expert's."""

    SELECTIVE_RECOMPUTE = ("act", "gate_mul")

    def __init__(self, num_experts: int, hidden: int, ffn: int, std: float, out_std: float, param_dtype, compute_dtype):
        super().__init__()
        self.w1 = Parameter(initializer(Normal(std), (num_experts, ffn, hidden), param_dtype), name="w1")
        self.w3 = Parameter(initializer(Normal(std), (num_experts, ffn, hidden), param_dtype), name="w3")
        self.w2 = Parameter(initializer(Normal(out_std), (num_experts, hidden, ffn), param_dtype), name="w2")
        self.matmul_w1 = ops.BatchMatMul(transpose_b=True)
        self.matmul_w3 = ops.BatchMatMul(transpose_b=True)
        self.act = SiLU()
        self.gate_mul = ops.Mul()
        self.matmul_w2 = ops.BatchMatMul(transpose_b=True)
        self.cast = ops.Cast()
        self.compute_dtype = compute_dtype
        self.cast_weights = param_dtype != compute_dtype

    def weights(self):
        """w1, w3, w2 in the compute dtype."""
        if not self.cast_weights:
            return self.w1, self.w3, self.w2
        return (
            self.cast(self.w1, self.compute_dtype),
            self.cast(self.w3, self.compute_dtype),
            self.cast(self.w2, self.compute_dtype),
        )

    def construct(self, x):
        w1, w3, w2 = self.weights()
        return self.matmul_w2(self.gate_mul(self.act(self.matmul_w1(x, w1)), self.matmul_w3(x, w3)), w2)

    PARAMETER_INPUTS = {"w1": ("matmul_w1", 1), "w3": ("matmul_w3", 1), "w2": ("matmul_w2", 1)}

    def shard_strategies(self, style: str, layout) -> dict:
        """Experts over ep, the tokens they hold over the other dp/ep ranks of their group, F over tp."""
        ep, tp = layout.ep, layout.tp
        x, inner = (ep, layout.token_rows // ep, 1), (ep, layout.token_rows // ep, tp)
        return {
            "matmul_w1": ((x, (ep, tp, 1)), None),
            "matmul_w3": ((x, (ep, tp, 1)), None),
            "act": ((inner,), None),
            "gate_mul": ((inner, inner), None),
            "matmul_w2": ((inner, (ep, 1, tp)), None),
        }


def _same_as_first(*args):
    """Morph's shape and dtype inference: the output is like the first input (the tokens [T, h])."""
    return args[0]


_EXPERT_GROUPS: set[str] = set()


def expert_group(ranks: list[int]) -> str:
    """The communication group of these expert-parallel ranks, created once per process that joined the
    cluster (the planner builds models outside it, to size them, and compiles nothing)."""
    from mindspore.communication import create_group
    from mindspore.communication._comm_helper import GlobalComm

    name = "moe_ep_" + "_".join(str(r) for r in ranks)
    if GlobalComm.INITED and name not in _EXPERT_GROUPS:
        create_group(name, list(ranks))
        _EXPERT_GROUPS.add(name)
    return name


class GroupedExperts(Experts):
    """Dropless experts over each rank's own tokens sorted by expert (model.moe.dispatch: grouped), the same
    w1, w3, w2 [E, F, h]: construct(x [N, h], experts [N, k], weights [N, k] fp32) -> sum_k weight x expert(x).

    Per rank: sort the N·k choices by expert, gather their rows; under expert parallel send each expert's rows
    to its rank (an AlltoAll of the counts, an AlltoAllV of the rows and of their expert ids) and sort what
    arrives by local expert; GroupedMatmul over the rows with the cumulative counts as group_list (an Ascend
    kernel; on CPU, where MindSpore has none, a loop over the experts masking rows, numerically the same and
    E times the work); then back by the same steps reversed. Sharded, the body is one Morph with
    self_define_shard: MindSpore's parallel pass cannot split GroupedMatmul's experts, so the body sees one
    rank's slices (rows [N/dp, h], experts [E/ep, F, h]) and its collectives are written out
    (docs/evidence/dryrun.md, "Dropless by GroupedMatmul")."""

    PARAMETER_INPUTS = {"w1": ("dispatch", 3), "w3": ("dispatch", 4), "w2": ("dispatch", 5)}

    def __init__(
        self, num_experts, top_k, hidden, ffn, std, out_std, param_dtype, compute_dtype, sharded, ep, group, kernel
    ):
        """sharded: semi-auto parallel (the body runs as a Morph); group: the ep ranks' communication group
        (ep > 1); kernel: GroupedMatmul (Ascend, the dry run), else the CPU loop."""
        super().__init__(num_experts, hidden, ffn, std, out_std, param_dtype, compute_dtype)
        self.num_experts, self.top_k, self.sharded, self.ep, self.kernel = num_experts, top_k, sharded, ep, kernel
        self.local_experts = num_experts // ep
        self.gmm = GroupedMatmul(split_item=3, group_type=0)  # refuses transpose_b: weights go [E, in, out]
        self.dispatch = Morph(self.local, _same_as_first, _same_as_first).add_prim_attr("self_define_shard", True)
        if ep > 1:
            self.counts_to_experts = ops.AlltoAll(ep, 0, 0, group=group)
            self.rows_to_experts = ops.AlltoAllV(group=group)
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, x, experts, weights):
        w1, w3, w2 = self.weights()
        if self.sharded:
            return self.dispatch(x, experts, weights, w1, w3, w2)
        return self.local(x, experts, weights, w1, w3, w2)

    def local(self, x, experts, weights, w1, w3, w2):
        """One rank's tokens x [T, h], their experts and weights [T, k]; w1, w3, w2 its experts [E/ep, ...]."""
        t, h, k = x.shape[0], x.shape[1], self.top_k
        chosen = experts.reshape(-1).astype(ms.float32)
        ids, order = ops.sort(chosen)  # [T*k]: the choices by expert
        rows = ops.gather(x, ops.floor_divide(order, k), 0)  # [T*k, h]
        counts = ops.one_hot(experts.reshape(-1), self.num_experts, self.on, self.off).sum(0)  # [E]
        if self.ep > 1:
            rows, ids, counts, back, send, recv = self.exchange(rows, ids, counts, h)
        out = self.compute(rows, ids, counts, w1, w3, w2)
        if self.ep > 1:
            out = ops.gather(out, back, 0)
            out = self.rows_to_experts(out.reshape(-1), recv * h, send * h).reshape(-1, h)
        out = ops.gather(out, ops.argsort(order.astype(ms.float32)), 0).reshape(t, k, h)
        return (out * weights.astype(out.dtype).reshape(t, k, 1)).sum(1)

    def exchange(self, rows, ids, counts, h):
        """Send each expert's rows to the rank holding it; what arrives, sorted by local expert, with its ids
        and the counts of each local expert, the permutation back and the AlltoAllV's row counts."""
        el = self.local_experts
        arrive = self.counts_to_experts(counts.reshape(self.ep, el))  # [ep sources, E/ep]
        send = counts.reshape(self.ep, el).sum(-1).astype(ms.int64)
        recv = arrive.sum(-1).astype(ms.int64)
        rows = self.rows_to_experts(rows.reshape(-1), send * h, recv * h).reshape(-1, h)
        ids = self.rows_to_experts(ids, send, recv)
        ids = ids - ops.floor_divide(ids, float(el)) * el  # local expert
        ids, order = ops.sort(ids)
        back = ops.argsort(order.astype(ms.float32))
        return ops.gather(rows, order, 0), ids, arrive.sum(0), back, send, recv

    def compute(self, rows, ids, counts, w1, w3, w2):
        """SwiGLU of each row by its expert: GroupedMatmul over the sorted rows, or on CPU a masked loop."""
        if self.kernel:
            group_list = ops.cumsum(counts.astype(ms.int32), 0).astype(ms.int64)
            w1, w3, w2 = (ops.transpose(w, (0, 2, 1)) for w in (w1, w3, w2))
            gate = self.gmm([rows], [w1], None, None, None, None, None, group_list)[0]
            up = self.gmm([rows], [w3], None, None, None, None, None, group_list)[0]
            return self.gmm([self.gate_mul(self.act(gate), up)], [w2], None, None, None, None, None, group_list)[0]
        out = ops.zeros_like(rows)
        for e in range(w1.shape[0]):
            hidden = self.gate_mul(self.act(ops.matmul(rows, w1[e].T)), ops.matmul(rows, w3[e].T))
            out = out + ops.matmul(hidden, w2[e].T) * (ids == e).astype(rows.dtype).reshape(-1, 1)
        return out

    def shard_strategies(self, style: str, layout) -> dict:
        """The Morph's rows over the data-parallel ranks as (dp/ep, ep), the experts over the inner ep."""
        ep = layout.ep
        mesh = DeviceMesh((layout.dp // ep, ep), ("outer", "inner"))
        rows = mesh(("outer", "inner"), "None")
        experts = mesh("inner", "None", "None")
        return {"dispatch": ((rows, rows, rows, experts, experts, experts), (rows,))}


def expert_capacity(tokens: int, top_k: int, factor, experts: int) -> int:
    """Slots per expert for `tokens` tokens of a group: ceil(top_k x tokens x factor / experts), at most all of
    them; `factor` None = dropless (all). Plain arithmetic, so a compiled construct can call it on shapes."""
    if factor is None:
        return tokens
    exact = top_k * tokens * factor / experts
    slots = int(exact)
    if slots < exact:
        slots = slots + 1
    return min(slots, tokens)


class MoE(nn.Cell):
    """construct(x [N, h], mask [B, S] fp32 or None) -> (y [N, h], stats [2] fp32: aux loss, max load / mean
    load, over the tokens `mask` marks (all with None))."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        capacity_factor,
        groups: int,
        expert_parallel: int,
        shared_ffn: int,
        std: float,
        out_std: float,
        param_dtype,
        compute_dtype,
        routing: nn.Cell | None = None,
        grouped: GroupedExperts | None = None,
    ):
        """routing: the cell choosing experts from the router's fp32 logits (models/router.py's SigmoidRouting),
        or None for the softmax top-k; grouped: the experts, dropless over sorted tokens (model.moe.dispatch:
        grouped), in place of the capacity dispatch's batched experts."""
        super().__init__()
        self.routing = routing
        self.expert_parallel = expert_parallel  # ranks of an expert-parallel group (1 unsharded)
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.norm_topk_prob, self.capacity_factor, self.groups = norm_topk_prob, capacity_factor, groups
        self.compute_dtype = compute_dtype
        self.router = Linear(hidden, num_experts, False, std, param_dtype, compute_dtype)
        self.experts = grouped or Experts(num_experts, hidden, ffn, std, out_std, param_dtype, compute_dtype)
        self.grouped = grouped is not None
        self.shared_expert = (
            SwiGLU(hidden, shared_ffn, std, out_std, param_dtype, compute_dtype) if shared_ffn else None
        )
        self.cast = ops.Cast()
        # router: [N, E] fp32
        self.router_fp32 = ops.Cast()
        self.softmax = ops.Softmax(-1)
        self.topk = ops.TopK(sorted=True)
        self.topk_sum = ops.ReduceSum(keep_dims=True)
        self.topk_norm = ops.RealDiv()
        self.choice_onehot = ops.OneHot()  # [N, k, E]
        self.chosen = ops.ReduceSum()  # [N, E]: 1 where chosen
        self.number_choices = ops.Mul()
        self.slots = ops.ReduceSum()  # [N, E]: which of its k choices e is (0 = first)
        self.slot_rank = ops.Mul()
        self.order_sub = ops.Sub()
        self.token_sub = ops.Sub()
        self.priority_mask = ops.Mul()
        self.transpose_priority = ops.Transpose()
        self.take = ops.TopK(sorted=True)  # [G, E, C]: each expert's C tokens, first priority first
        self.filled = ops.Greater()  # a slot some token fills (priority > 0)
        self.gather_tokens = ops.Gather(batch_dims=1)  # [G, T, h] at [G, E*C] -> [G, E*C, h]
        self.fill_mask = ops.Mul()
        self.to_experts = ops.Transpose()  # [ep, G/ep, E, C, h] -> [E, G/ep, ep, C, h]: the AlltoAll
        self.from_experts = ops.Transpose()  # and back
        self.transpose_ranked = ops.Transpose()  # choices [G, T, k, E] -> [G, k, T, E]: priority order
        self.count_before = ops.CumSum(exclusive=True)
        self.position_mul = ops.Mul()
        self.position = ops.ReduceSum()  # [G, k*T]: each choice's rank among its expert's tokens
        self.kept = ops.Less()  # the rank is within the capacity
        self.transpose_experts = ops.Transpose()
        self.transpose_weights = ops.Transpose()
        self.slot_base = ops.Mul()
        self.slot_offset = ops.Minimum()
        self.slot_add = ops.Add()
        self.keep_weights = ops.Mul()
        self.gather_slots = ops.Gather(batch_dims=1)  # [G, E*C, h] at [G, k*T] -> [G, k*T, h]
        self.weigh_outputs = ops.Mul()
        self.sum_choices = ops.ReduceSum()
        self.shared_add = ops.Add()
        # statistics over all tokens (no mask) or the masked ones
        self.token_fraction = ops.ReduceMean()
        self.mean_prob = ops.ReduceMean()
        self.mask_choices = ops.Mul()
        self.mask_probs = ops.Mul()
        self.masked_choices = ops.ReduceSum()
        self.masked_probs = ops.ReduceSum()
        self.masked_tokens = ops.ReduceSum()
        self.at_least_one = ops.Maximum()
        self.fraction_div = ops.RealDiv()
        self.prob_div = ops.RealDiv()
        self.balance_mul = ops.Mul()
        self.balance_sum = ops.ReduceSum()
        self.load_max = ops.ReduceMax()
        # the sequence-wise loss: per sequence [B, S, E] -> [B, E]
        self.seq_mask_choices = ops.Mul()
        self.seq_mask_probs = ops.Mul()
        self.seq_choices = ops.ReduceSum()
        self.seq_probs = ops.ReduceSum()
        self.seq_tokens = ops.ReduceSum(keep_dims=True)
        self.seq_at_least_one = ops.Maximum()
        self.seq_fraction_div = ops.RealDiv()
        self.seq_prob_div = ops.RealDiv()
        self.seq_balance_mul = ops.Mul()
        self.seq_balance_sum = ops.ReduceSum()
        self.seq_mean = ops.ReduceMean()
        # the counts of auxiliary-loss-free balancing, when the training step attaches its counter
        self.expert_loads = None
        self.load_count = ops.ReduceSum()
        self.load_add = ops.AssignAdd()
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
        self.choice_numbers = Tensor(np.arange(top_k, dtype=np.float32).reshape(1, top_k, 1))

    def construct(self, x, mask=None, seq=None):
        return self.forward(x, self.capacity_factor, mask, seq)

    def attach_load_counter(self, counter: Parameter) -> None:
        """Count each expert's tokens into `counter` [G, E] (owned by the training step, so that the model's
        parameters stay the checkpoint's weights): a reference the graph reads, not a parameter of this cell."""
        object.__setattr__(self, "expert_loads", counter)

    def forward(self, x, capacity_factor, mask=None, seq=None):
        """The layer with this capacity factor (None: dropless; generation passes None, as HF routes), its
        statistics over the tokens `mask` marks (None: all), the sequence-wise loss over sequences of `seq`
        tokens (None: 0)."""
        n, h, e, k, g = x.shape[0], self.hidden, self.num_experts, self.top_k, self.groups
        t = n // g
        c = expert_capacity(t, k, capacity_factor, e)
        weights, experts, probs = self.route(x)  # [N, k], [N, E]
        choices = self.choice_onehot(experts, e, self.on, self.off)  # [N, k, E]
        chosen = self.chosen(choices, 1)  # [N, E]
        if self.expert_loads is not None:  # every routed token, as the experts compute them
            chosen = ops.depend(chosen, self.load_add(self.expert_loads, self.load_count(chosen, 0)))
        if self.grouped:
            y = self.experts(x, experts, weights)
            if self.shared_expert is not None:
                y = self.shared_add(y, self.shared_expert(x))
            return y, self.statistics(probs, chosen, mask, seq)
        # priority of (token, expert): k*T - slot*T - token_in_group > 0 where chosen, 0 elsewhere
        slot = self.slots(self.number_choices(choices, self.choice_numbers), 1)  # [N, E]
        order = self.order_sub(k * t, self.slot_rank(slot, t)).reshape(g, t, e)
        order = self.token_sub(order, self.token_numbers(t))
        priority = self.transpose_priority(self.priority_mask(order, chosen.reshape(g, t, e)), (0, 2, 1))
        top, taken = self.take(priority, c)  # [G, E, C]
        filled = self.cast(self.filled(top, 0.0), self.compute_dtype).reshape(g, e * c, 1)
        routed = self.fill_mask(self.gather_tokens(x.reshape(g, t, h), taken.reshape(g, e * c), 1), filled)
        # groups as [ep, G/ep]: each expert-parallel group's ranks swap the group split for an expert split in
        # one AlltoAll ([E, G/ep, ep, C, h] keeps the inner G/ep split where the data-parallel split had it)
        ep = self.expert_parallel
        routed = self.to_experts(routed.reshape(ep, g // ep, e, c, h), (2, 1, 0, 3, 4)).reshape(e, g * c, h)
        out = self.experts(routed).reshape(e, g // ep, ep, c, h)
        out = self.from_experts(out, (2, 1, 0, 3, 4)).reshape(g, e * c, h)
        # combine: each (choice, token) reads its slot, expert x C + its rank among the expert's tokens in the
        # same priority order (choices before choices of a later rank, then token order) as `take`
        ranked = self.transpose_ranked(choices.reshape(g, t, k, e), (0, 2, 1, 3)).reshape(g, k * t, e)
        position = self.position(self.position_mul(self.count_before(ranked, 1), ranked), -1)  # [G, k*T]
        kept = self.kept(position, c)
        chosen_experts = self.transpose_experts(experts.reshape(g, t, k), (0, 2, 1)).reshape(g, k * t)
        index = self.slot_add(self.slot_base(chosen_experts, c), self.slot_offset(self.cast(position, ms.int32), c - 1))
        weights = self.transpose_weights(weights.reshape(g, t, k), (0, 2, 1)).reshape(g, k * t)
        weights = self.cast(self.keep_weights(weights, self.cast(kept, ms.float32)), self.compute_dtype)
        picked = self.weigh_outputs(self.gather_slots(out, index, 1), weights.reshape(g, k * t, 1))
        y = self.sum_choices(picked.reshape(g, k, t, h), 1).reshape(n, h)
        if self.shared_expert is not None:
            y = self.shared_add(y, self.shared_expert(x))
        return y, self.statistics(probs, chosen, mask, seq)

    def route(self, x):
        """(weights [N, k] fp32, experts [N, k], the probabilities [N, E] the statistics read)."""
        logits = self.router_fp32(self.router(x), ms.float32)
        if self.routing is not None:
            return self.routing(logits)
        probs = self.softmax(logits)
        weights, experts = self.topk(probs, self.top_k)
        if self.norm_topk_prob:
            weights = self.topk_norm(weights, self.topk_sum(weights, -1))
        return weights, experts, probs

    def token_numbers(self, t: int) -> Tensor:
        """[1, T, 1]: each token's index in its group."""
        return Tensor(np.arange(t, dtype=np.float32).reshape(1, t, 1))

    def statistics(self, probs, chosen, mask, seq=None):
        """[aux loss E sum_e f_e P_e, max_e f_e / mean_e f_e, the sequence-wise loss (sequence_balance)]: f_e the tokens choosing e over the tokens counted
        (summing to k), P_e the mean router probability of e over them; the tokens counted are those `mask`
        [B, S] marks, all without one. mean_e f_e is k/E whenever a token counts (each chooses k experts), so
        the load is max_e f_e x E/k: 0, not 0/0, for a batch that trains no token."""
        if mask is None:
            fraction = self.token_fraction(chosen, 0)  # [E]
            prob = self.mean_prob(probs, 0)
        else:
            weights = mask.reshape(-1, 1)  # [N, 1]
            count = self.at_least_one(self.masked_tokens(weights), 1.0)
            fraction = self.fraction_div(self.masked_choices(self.mask_choices(chosen, weights), 0), count)
            prob = self.prob_div(self.masked_probs(self.mask_probs(probs, weights), 0), count)
        aux = self.balance_sum(self.balance_mul(fraction, prob)) * self.num_experts
        load = self.load_max(fraction) * (self.num_experts / self.top_k)
        return ops.stack((aux, load, self.sequence_balance(probs, chosen, mask, seq)))

    def sequence_balance(self, probs, chosen, mask, seq):
        """DeepSeek-V3's sequence-wise balance loss without its alpha (eq. 17-20): per sequence b of T_b
        counted tokens, f_e = E/(k T_b) x its tokens choosing e, P_e = their mean normalised score of e, the
        loss sum_e f_e P_e; the mean over the B sequences. T_b counts what `mask` [B, S] marks (all S
        without one; a sequence with none adds 0). seq None: 0 (a caller without sequences)."""
        if seq is None:
            return ops.zeros((), ms.float32)
        b, e = probs.shape[0] // seq, self.num_experts
        choices, scores = chosen.reshape(b, seq, e), probs.reshape(b, seq, e)
        if mask is None:
            fraction = self.seq_choices(choices, 1) * (e / (self.top_k * seq))  # [B, E]
            prob = self.seq_probs(scores, 1) * (1.0 / seq)
        else:
            weights = mask.reshape(b, seq, 1)
            tokens = self.seq_at_least_one(self.seq_tokens(weights, 1).reshape(b, 1), 1.0)  # [B, 1]
            fraction = self.seq_fraction_div(self.seq_choices(self.seq_mask_choices(choices, weights), 1), tokens)
            fraction = fraction * (e / self.top_k)
            prob = self.seq_prob_div(self.seq_probs(self.seq_mask_probs(scores, weights), 1), tokens)
        return self.seq_mean(self.seq_balance_sum(self.seq_balance_mul(fraction, prob), 1))

    def shard_strategies(self, style: str, layout) -> dict:
        """Router ops split tokens over the data x context-parallel rows; dispatch and combine split the G
        groups over them; the expert matmuls split experts over ep, the groups over dp/ep and F over tp."""
        rows, ep = layout.token_rows, layout.ep
        tokens, per_token, groups, slots = (rows, 1), (rows, 1, 1), (rows, 1, 1), (rows, 1, 1, 1)
        sequences, per_sequence = (layout.dp, layout.cp, 1), (layout.dp, 1)  # [B, S, E] and [B, E]
        rules = {
            "router_fp32": ((tokens,), None),
            "softmax": ((tokens,), None),
            "topk": ((tokens,), None),
            "topk_sum": ((tokens,), None),
            "topk_norm": ((tokens, tokens), None),
            "choice_onehot": ((per_token, (), ()), None),  # OneHot's strategy is its output's
            "chosen": ((per_token,), None),
            "number_choices": ((per_token, (1, 1, 1)), None),
            "slots": ((per_token,), None),
            "slot_rank": ((tokens, ()), None),
            "order_sub": (((), tokens), None),
            "token_sub": ((groups, (1, 1, 1)), None),
            "priority_mask": ((groups, groups), None),
            "transpose_priority": ((groups,), None),
            "take": ((groups,), None),
            "filled": ((groups, ()), None),
            "gather_tokens": ((groups, (rows, 1)), None),
            "fill_mask": ((groups, groups), None),
            "to_experts": (((ep, rows // ep, 1, 1, 1),), None),
            "from_experts": (((ep, rows // ep, 1, 1, 1),), None),
            "transpose_ranked": ((slots,), None),
            "count_before": ((groups,), None),
            "position_mul": ((groups, groups), None),
            "position": ((groups,), None),
            "kept": ((tokens, ()), None),
            "transpose_experts": ((groups,), None),
            "transpose_weights": ((groups,), None),
            "slot_base": ((tokens, ()), None),
            "slot_offset": ((tokens, ()), None),
            "slot_add": ((tokens, tokens), None),
            "keep_weights": ((tokens, tokens), None),
            "gather_slots": ((groups, (rows, 1)), None),
            "weigh_outputs": ((groups, groups), None),
            "sum_choices": ((slots,), None),
            "token_fraction": ((tokens,), None),
            "mean_prob": ((tokens,), None),
            "mask_choices": ((tokens, tokens), None),
            "mask_probs": ((tokens, tokens), None),
            "masked_choices": ((tokens,), None),
            "masked_probs": ((tokens,), None),
            "masked_tokens": ((tokens,), None),
            "at_least_one": (((), ()), None),
            "fraction_div": (((1,), ()), None),
            "prob_div": (((1,), ()), None),
            "balance_mul": (((1,), (1,)), None),
            "balance_sum": (((1,),), None),
            "load_max": (((1,),), None),
            "seq_mask_choices": ((sequences, sequences[:2] + (1,)), None),
            "seq_mask_probs": ((sequences, sequences[:2] + (1,)), None),
            "seq_choices": ((sequences,), None),
            "seq_probs": ((sequences,), None),
            "seq_tokens": ((sequences[:2] + (1,),), None),
            "seq_at_least_one": ((per_sequence[:1] + (1,), ()), None),
            "seq_fraction_div": ((per_sequence, per_sequence[:1] + (1,)), None),
            "seq_prob_div": ((per_sequence, per_sequence[:1] + (1,)), None),
            "seq_balance_mul": ((per_sequence, per_sequence), None),
            "seq_balance_sum": ((per_sequence,), None),
            "seq_mean": (((layout.dp,),), None),
            "load_count": ((tokens,), None),  # [E] of every rank's tokens: the all-reduce over the token split
            "load_add": (((1,), (1,)), None),
        }
        if self.shared_expert is not None:
            rules["shared_add"] = ((tokens, tokens), None)
        return rules
