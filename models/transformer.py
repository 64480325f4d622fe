"""One pre-norm decoder for every architecture; what a family changes is the traits of its entry in
models/archs/ (models/spec.py's ArchSpec: norm, MLP, biases, positions).

Parameter names (stable; checkpoints and the Hugging Face table in models/hf_convert.py use them):

    tok_embeddings.weight                 [V, h]
    pos_embeddings.weight                 [S, h]       GPT only
    layers.{i}.attention_norm.weight/.bias             (.bias: GPT)
    layers.{i}.attention.w{q,k,v,o}.weight/.bias       (.bias: GPT; Qwen2 wq/wk/wv)
    layers.{i}.ffn_norm.weight/.bias
    layers.{i}.feed_forward.w1/.w2(/.w3).weight/.bias  (w3: LLaMA gate, .bias: GPT)
    norm.weight/.bias
    output.weight                         [V, h]       absent when tied
    mtp.{k}.enorm/.hnorm/.norm.weight, mtp.{k}.eh_proj.weight, mtp.{k}.block.*   multi-token prediction
                                                       (model.mtp_depth; models/mtp.py)

Init: normal(0, init_std) for every matrix; the projections that write into the residual stream
(attention.wo, feed_forward.w2) use init_std / sqrt(2 L) as in GPT-2; norms start at 1, biases at 0.
"""

from __future__ import annotations

import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from models.attention import Attention, CompositeAttention, FlashAttention
from models.cpu_kernels import SplitCausalAttention, expand_broadcasts
from models.layers import (
    DTYPES,
    Embedding,
    FusedRMSNorm,
    GeluMLP,
    LayerNorm,
    OutputHead,
    RMSNorm,
    SwiGLU,
    WidthSplitRMSNorm,
    stream_split,
)
from models.mla import MLAttention
from models.moe import GroupedExperts, MoE, expert_group
from models.mtp import MTPModule
from models.router import SigmoidRouting
from models.spec import ArchSpec
from mindscale.config import Layout, ModelConfig

MOE_STATS = "moe_stats"  # CausalLMLoss's record of the router statistics: [aux loss, max load / mean load,
# sequence-wise loss]
MTP_LOSS = "mtp_loss"  # CausalLMLoss's record of the multi-token-prediction term it added: [lambda / D x sum CE_k]


def norm_class(spec: ArchSpec, layout: Layout) -> type:
    """The family's norm; the fused RmsNorm kernel in place of RMSNorm where the hardware has it; under 2D tensor
    parallel the RMSNorm of a width-split stream."""
    if not spec.rms_norm:
        return LayerNorm
    if layout.nd_tp:
        return WidthSplitRMSNorm
    return FusedRMSNorm if layout.fused_norm else RMSNorm


def dense_layer(m: ModelConfig, index: int) -> bool:
    """Whether layer `index` has a dense MLP: every layer of a dense family, and of a mixture of experts the first
    model.moe.dense_layers (DeepSeek-V3's first_k_dense_replace)."""
    return not m.spec.moe or index < m.moe.dense_layers


def layer_graph_keys(layout: Layout, m: ModelConfig) -> list[str]:
    """Per layer, the key of the compiled graph it shares: its pipeline stage, recompute mode, offload, whether
    it regathers its inputs, and in a mixture of experts whether its MLP is dense (a graph of other cells)."""
    recomputed, offloaded, regathered = set(layout.recomputed), set(layout.offloaded), set(layout.regathered)
    return [
        f"stage {stage}, recompute {layout.recompute if i in recomputed else 'none'}"
        + (", offloaded" if i in offloaded else "")
        + (", regathered" if i in regathered else "")
        + (", dense" if m.spec.moe and dense_layer(m, i) else "")
        for i, stage in enumerate(layout.stages_of_layers)
    ]


def attention_core(m: ModelConfig, layout: Layout) -> nn.Cell:
    """The attention kernel of the layout: flash, the composite one, or its CPU fast path."""
    head_dim = m.head_size
    if layout.attention == "flash":
        return FlashAttention(
            m.num_heads,
            m.kv_heads,
            head_dim,
            (layout.tp, layout.cp) if layout.ulysses else None,
            layout.packed_examples + 1,
            layout.row_blocks,
            layout.recomputes_attention_view,
        )
    core = SplitCausalAttention if layout.cpu_kernels else CompositeAttention
    return core(m.num_heads, m.kv_heads, head_dim, m.seq_length, DTYPES[m.compute_dtype])


def listed_members(block: nn.Cell, listing: str):
    """The members every layer of `block` names in its class attribute `listing` (SELECTIVE_RECOMPUTE,
    REGATHERED_INPUT); naming one the layer does not have is an error."""
    for path, cell in block.cells_and_names():
        for name in getattr(type(cell), listing, ()):
            member = getattr(cell, name, None)
            if member is None:
                raise AttributeError(
                    f"{type(cell).__name__}.{listing} names {name!r}, which {path or 'the block'} does not have"
                )
            yield member


def mark_selective_recompute(block: nn.Cell) -> None:
    """Primitive.recompute() on the ops every layer of `block` lists in its SELECTIVE_RECOMPUTE."""
    for op in listed_members(block, "SELECTIVE_RECOMPUTE"):
        op.recompute()


def mark_regathered_inputs(block: nn.Cell) -> None:
    """regather_input() on the Linears every layer of `block` lists in its REGATHERED_INPUT: the column-parallel
    matmuls whose input sequence parallel all-gathers."""
    for linear in listed_members(block, "REGATHERED_INPUT"):
        linear.regather_input()


def attention_layer(m: ModelConfig, spec: ArchSpec, layout: Layout, out_std: float) -> nn.Cell:
    """The family's attention: multi-head latent attention (DeepSeek-V3), else multi-head/GQA."""
    pdt, cdt = DTYPES[m.param_dtype], DTYPES[m.compute_dtype]
    if spec.mla:
        return MLAttention(
            m.hidden_size,
            m.num_heads,
            m.mla,
            m.seq_length,
            m.rope_theta,
            core=attention_core(m, layout),
            std=m.init_std,
            out_std=out_std,
            param_dtype=pdt,
            compute_dtype=cdt,
            sharded=layout.sharded,
        )
    return Attention(
        m.hidden_size,
        m.num_heads,
        m.kv_heads,
        m.head_size,
        m.seq_length,
        bias=spec.bias,
        qkv_bias=spec.qkv_bias,
        qk_norm_eps=m.norm_eps if spec.qk_norm else None,
        rope=(m.rope_theta, m.rope_scaling_params) if spec.rotary else None,
        core=attention_core(m, layout),
        std=m.init_std,
        out_std=out_std,
        param_dtype=pdt,
        compute_dtype=cdt,
    )


def mixture_of_experts(m: ModelConfig, layout: Layout, out_std: float) -> MoE:
    """The MoE feed-forward of model.moe, with DeepSeek-V3's sigmoid router when model.moe.router says so."""
    moe = m.moe
    routing = (
        SigmoidRouting(
            moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups, moe.norm_topk_prob, moe.routed_scaling_factor
        )
        if moe.router == "sigmoid"
        else None
    )
    return MoE(
        m.hidden_size,
        moe.expert_ffn(m.ffn_hidden_size),
        moe.num_experts,
        moe.top_k,
        moe.norm_topk_prob,
        moe.capacity_factor,
        layout.token_rows if layout.sharded else 1,
        layout.ep if layout.sharded else 1,
        moe.shared_expert_ffn_hidden_size,
        m.init_std,
        out_std,
        DTYPES[m.param_dtype],
        DTYPES[m.compute_dtype],
        routing,
        grouped_experts(m, layout, out_std) if moe.dispatch == "grouped" else None,
    )


def grouped_experts(m: ModelConfig, layout: Layout, out_std: float) -> GroupedExperts:
    """model.moe.dispatch grouped: the experts over sorted tokens, with this rank's expert-parallel group."""
    ep = layout.ep if layout.sharded else 1
    group = None
    if ep > 1:
        from mindspore.communication import get_rank

        group = expert_group(layout.expert_ranks(get_rank()))
    return GroupedExperts(
        m.moe.num_experts,
        m.moe.top_k,
        m.hidden_size,
        m.moe.expert_ffn(m.ffn_hidden_size),
        m.init_std,
        out_std,
        DTYPES[m.param_dtype],
        DTYPES[m.compute_dtype],
        layout.sharded,
        ep,
        group,
        layout.grouped_matmul,
    )


class TransformerBlock(nn.Cell):
    """x + attention(norm(x)), then + feed_forward(norm(.)); the residual stream x in m.residual_dtype."""

    def __init__(self, m: ModelConfig, spec: ArchSpec, layout: Layout, dense: bool):
        """dense: this layer's MLP is dense (dense_layer); a mixture of experts' other layers have experts."""
        super().__init__()
        pdt, cdt = DTYPES[m.param_dtype], DTYPES[m.compute_dtype]
        self.residual_dtype = DTYPES[m.residual_dtype]
        out_std = m.init_std / math.sqrt(2 * m.num_layers)
        norm = norm_class(spec, layout)
        self.attention_norm = norm(m.hidden_size, m.norm_eps, pdt, cdt)
        self.attention = attention_layer(m, spec, layout, out_std)
        self.ffn_norm = norm(m.hidden_size, m.norm_eps, pdt, cdt)
        self.moe = spec.moe and not dense
        if self.moe:
            self.feed_forward = mixture_of_experts(m, layout, out_std)
        else:
            self.feed_forward = (SwiGLU if spec.gated_mlp else GeluMLP)(
                m.hidden_size, m.ffn_hidden_size, m.init_std, out_std, pdt, cdt
            )
        self.attention_residual = ops.Add()
        self.ffn_residual = ops.Add()
        self.cast = ops.Cast()
        self.cast_out = cdt != self.residual_dtype

    def construct(self, x, batch: int, seq: int, segment_ids, routing, loss_mask):
        """The new residual stream; with a mixture of experts (x, routing): `routing` [3] fp32 is the router
        statistics of the layers before, (sum of aux losses, largest max load / mean load, sum of sequence-wise
        losses), with this layer's
        added, over the tokens `loss_mask` [B, S] trains (None: all; models/moe.py says why). It travels beside
        the residual stream, so that a pipeline stage sends it with x to the next
        stage; collected per layer at the end instead, every layer's statistics would cross to the last
        stage on its own, and MindSpore's interleaved-pipeline compile of 8 stages x 2 chunks did not finish
        in 15 minutes (models/moe.py returns one layer's). The mask, a graph input like segment_ids, is read
        by each layer where it runs, so nothing computed from it crosses a stage."""
        a = self.attention(self.attention_norm(x), batch, seq, segment_ids)
        h = self.attention_residual(x, self.cast(a, self.residual_dtype) if self.cast_out else a)
        if self.moe:
            y, stats = self.feed_forward(self.ffn_norm(h), loss_mask, seq)
            routing = ops.stack((routing[0] + stats[0], ops.maximum(routing[1], stats[1]), routing[2] + stats[2]))
            return self.add_ffn(h, y), routing
        f = self.feed_forward(self.ffn_norm(h))
        if routing is not None:  # a dense layer of a mixture of experts passes the statistics on
            return self.add_ffn(h, f), routing
        return self.add_ffn(h, f)

    def add_ffn(self, h, f):
        return self.ffn_residual(h, self.cast(f, self.residual_dtype) if self.cast_out else f)

    def shard_strategies(self, style: str, layout: Layout) -> dict:
        x = stream_split(layout, style)
        return {"attention_residual": ((x, x), None), "ffn_residual": ((x, x), None)}

    def mark_recompute(self, mode: str, comm: bool) -> None:
        """full: only the block's input is kept, everything inside is recomputed in the backward pass
        (`comm`: its tensor-parallel communication too, MindSpore's mp_comm_recompute); selective: the
        large, cheap ops its layers list."""
        if mode == "full":
            self.recompute(mp_comm_recompute=comm)
        elif mode == "selective":
            mark_selective_recompute(self)

    def mark_regather(self) -> None:
        """Regather under sequence parallel: the backward all-gathers the input of QKV and of the MLP's first matmuls
        again for their weight gradients, as Megatron does, instead of keeping the forward's gathered copies
        (recompute.comm on a layer that is not fully recomputed): 2·s·b·h·(1 - 1/t) fewer bytes kept, two more
        all-gathers."""
        mark_regathered_inputs(self)

    def mark_offload(self, backward_prefetch: int) -> None:
        """Every op of the block offloads the activations the backward pass reads: MindSpore copies them to
        host memory as the forward produces them and back `backward_prefetch` operators before their first
        backward use (Cell.offload; it acts only inside a lazy_inline graph, in graph mode)."""
        self.offload(backward_prefetch=backward_prefetch)


class ReusedTransformerBlock(TransformerBlock):
    """A block whose compiled graph is shared by every block with the same `graph_key` (Layout.graph_reuse
    "layer"): MindSpore's lazy_inline compiles it once (type inference, autodiff) and calls or inlines it
    per layer. On CPU it is inlined at the front ("front" policy: the CPU backend rejects the kept call
    node). What differs between layers inside the graph (the recompute and offload marks, the pipeline stage) must
    therefore be in the key; construct takes no default arguments."""

    @ms.lazy_inline(attrs="graph_key")
    def __init__(self, m: ModelConfig, spec: ArchSpec, layout: Layout, graph_key: str, dense: bool):
        super().__init__(m, spec, layout, dense)
        self.graph_key = graph_key
        if layout.device == "CPU":
            self.no_inline = False  # what lazy_inline(policy="front") sets


class CausalLM(nn.Cell):
    """construct(input_ids [B, S] int32) -> logits [B, S, V] fp32."""

    def __init__(self, m: ModelConfig, layout: Layout):
        super().__init__()
        spec = m.spec
        pdt, cdt = DTYPES[m.param_dtype], DTYPES[m.compute_dtype]
        self.arch = m.arch
        rdt = DTYPES[m.residual_dtype]
        self.tok_embeddings = Embedding(m.vocab_size, m.hidden_size, m.init_std, pdt, cdt, rdt)
        self.pos_embeddings = None
        if spec.learned_positions:
            self.pos_embeddings = Embedding(m.seq_length, m.hidden_size, m.init_std, pdt, cdt, rdt)
            self.positions = Tensor(np.arange(m.seq_length, dtype=np.int32))
            self.pos_add = ops.Add()
        if layout.graph_reuse == "layer":
            blocks = [
                ReusedTransformerBlock(m, spec, layout, key, dense_layer(m, i))
                for i, key in enumerate(layer_graph_keys(layout, m))
            ]
        else:
            blocks = [TransformerBlock(m, spec, layout, dense_layer(m, i)) for i in range(m.num_layers)]
        self.layers = nn.CellList(blocks)
        self.mtp = self.mtp_modules(m, spec, layout) if m.mtp_depth else None
        self.mtp_loss_weight = m.mtp_loss_weight / max(m.mtp_depth, 1)  # lambda / D
        self.moe = spec.moe
        # what the aux loss averages over: the layers with experts, and the blocks of the multi-token prediction's
        # modules (layer indices L, L + 1, ... as the checkpoint numbers them)
        self.moe_layers = sum(not dense_layer(m, i) for i in range(m.num_layers + m.mtp_depth))
        self.sequence_balance_coeff = m.moe.seq_aux_loss_coeff  # CausalLMLoss's weight of the sequence-wise loss
        self.no_routing = Tensor([0.0, 0.0, 0.0], ms.float32)  # the router statistics before the first layer
        # ... passed to it through an op, not as the constant itself: with the layers' graph reused
        # (run.reuse_layer_graph), a constant as the first call's input left the second call reading freed memory
        # on CPU in graph mode (tests/models/test_moe.py, under jemalloc's junk fill)
        self.start_routing = ops.Identity().shard(((1,),))
        self.norm = norm_class(spec, layout)(m.hidden_size, m.norm_eps, pdt, cdt)
        self.output = OutputHead(m.hidden_size, m.vocab_size, m.tie_embeddings, m.init_std, pdt, cdt)
        # used by CausalLMLoss; lives here to be sharded with the model
        self.loss = (ShardedCrossEntropy if layout.sharded else MaskedCrossEntropy)(m.vocab_size)
        self.vocab_size = m.vocab_size
        self.seq_length = m.seq_length
        self.cast = ops.Cast()
        if layout.cpu_kernels:
            expand_broadcasts(self)

    @staticmethod
    def mtp_modules(m: ModelConfig, spec: ArchSpec, layout: Layout) -> nn.CellList:
        """model.mtp_depth modules (models/mtp.py), the block of module k numbered layer L + k - 1 as the
        checkpoint stores it (DeepSeek-V3's: with experts)."""
        return nn.CellList(
            [
                MTPModule(
                    m,
                    layout,
                    TransformerBlock(m, spec, layout, dense_layer(m, m.num_layers + k)),
                    norm_class(spec, layout),
                    k + 1,
                )
                for k in range(m.mtp_depth)
            ]
        )

    def mtp_loss(self, hidden, input_ids, labels, loss_mask, segment_ids, routing):
        """(lambda / D x the sum of the modules' cross entropies from the decoder's output `hidden` [B*S, h],
        the router statistics with the modules' blocks added)."""
        total = 0.0
        for module in self.mtp:
            hidden, normed, targets, mask, routing = module(
                hidden, input_ids, labels, loss_mask, segment_ids, self.tok_embeddings.weight, routing
            )
            total = total + self.loss(self.logits(self.loss.mask_hidden(normed, mask)), targets, mask)
        return self.mtp_loss_weight * total, routing

    def hidden_states(self, input_ids, segment_ids=None):
        """Final-norm output [B*S, h] in the compute dtype; `segment_ids` [B, S] keeps attention within
        each packed example (the composite core's mask, the flash core's TND lengths; rotary positions are
        relative, so each LLaMA example computes as if alone)."""
        return self.decode(input_ids, segment_ids)[0]

    def decode(self, input_ids, segment_ids=None, loss_mask=None):
        """(hidden_states, a mixture of experts' router statistics summed over layers [sum of aux losses,
        largest max load / mean load, sum of sequence-wise losses] (TransformerBlock) over the tokens `loss_mask` [B, S] trains (None: all),
        else None)."""
        batch, seq = input_ids.shape
        x = self.tok_embeddings(input_ids)
        if self.pos_embeddings is not None:
            positions = self.positions if seq == self.seq_length else self.positions[:seq]
            x = self.pos_add(x, self.pos_embeddings(positions))
        x = x.reshape(batch * seq, -1)
        routing = self.start_routing(self.no_routing) if self.moe else None
        loss_mask = loss_mask if self.moe else None  # a dense model's layers take no mask: their graph unchanged
        for layer in self.layers:
            x = layer(x, batch, seq, segment_ids, routing, loss_mask)
            if self.moe:
                x, routing = x
        return self.norm(x), routing

    def logits(self, hidden):
        """[N, h] -> [N, V] fp32."""
        return self.cast(self.output(hidden, self.tok_embeddings.weight), ms.float32)

    def construct(self, input_ids):
        batch, seq = input_ids.shape
        return self.logits(self.hidden_states(input_ids)).reshape(batch, seq, self.vocab_size)

    def shard_strategies(self, style: str, layout: Layout) -> dict:
        return (
            {"pos_add": (((layout.dp, layout.cp, 1), (layout.cp, 1)), None)} if self.pos_embeddings is not None else {}
        )

    def mark_recompute(self, layout: Layout) -> list[int]:
        """recompute.mode on the layers Layout.recomputed chose (the first n of every pipeline stage), and the
        regather on the layers Layout.regathered chose (recompute.comm); after LoRA, whose adapters a fully
        recomputed block must hold. Returns the recomputed layers."""
        for index in layout.recomputed:
            self.layers[index].mark_recompute(layout.recompute, layout.recompute_comm)
        for index in layout.regathered:
            self.layers[index].mark_regather()
        return list(layout.recomputed)

    def mark_offload(self, layout: Layout) -> list[int]:
        """offload on the layers Layout.offloaded chose (the first n of every stage after its recomputed ones);
        after LoRA, so the adapters' activations go too. Returns those layers."""
        for index in layout.offloaded:
            self.layers[index].mark_offload(layout.offload_prefetch)
        return list(layout.offloaded)


class MaskedCrossEntropy(nn.Cell):
    """sum(ce * mask) / max(sum(mask), 1) from the final hidden states, without a one-hot [N, V].

    Uses the fused SparseSoftmaxCrossEntropyWithLogits (4-5x faster on CPU than ops.cross_entropy or
    log_softmax + gather, fwd+bwd at [2048, 8192]). That kernel returns only the mean over all
    tokens, so masking happens before the output projection: a masked token's hidden state is
    zeroed, its logits are exactly 0, its cross entropy is exactly log(V) and no gradient flows
    through it; the sum over kept tokens is N * mean - (N - sum(mask)) * log(V). loss_mask must
    therefore hold 0/1 (which the data pipeline gives).
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.mask_rows = ops.Mul()
        self.cross_entropy = ops.SparseSoftmaxCrossEntropyWithLogits()
        self.log_vocab = float(np.log(vocab_size))
        self.cast = ops.Cast()

    def mask_hidden(self, hidden, loss_mask):
        """Zero the hidden state [N, h] of every masked token."""
        return self.mask_rows(hidden, self.cast(loss_mask.reshape(-1, 1), hidden.dtype))

    def construct(self, logits, labels, loss_mask=None):
        """logits [N, V] fp32 computed from mask_hidden's output; no mask: every token is trained."""
        mean_ce = self.cross_entropy(logits, labels.reshape(-1))
        if loss_mask is None:
            return mean_ce
        tokens = logits.shape[0]
        kept = loss_mask.sum()
        return (mean_ce * tokens - (tokens - kept) * self.log_vocab) / ops.maximum(kept, 1.0)


class TokenCrossEntropy(nn.Cell):
    """Each token's cross entropy from fp32 logits [N, V] and labels [N], with the gradient written out:
    construct -> (log Z + max - the label's logit [N, 1], exp(logits - max) [N, V], its row sums Z [N, 1], the
    labels' one-hot [N, V]); bprop: d logits = (exp / Z - one_hot) * d loss, Megatron's vocab-parallel cross
    entropy.

    Why the bprop is ours: MindSpore's autodiff of the forward held five fp32 [N, V] tensors at the step's
    peak (the shifted logits, their exp, the one-hot, the sum's Tile and the exp's gradient), and folded the
    label pick's gradient, a constant when the loss scale is, into an [N, V] fp32 graph constant held all
    step (llama2_7b's widths, 8,192 tokens a rank: 1,000 MiB each; docs/evidence/dryrun.md). Here at
    most three [N, V] tensors are live in the forward (the logits, the one-hot and their product; the pick is
    of the logits, and the shift waits for it) and in the backward (the scaled exp, the one-hot times d loss,
    their difference). The `depend`s keep that order: with a fixed loss scale and no mask d loss is a
    constant, and the scheduler would otherwise make the backward's [N, V] tensors while the forward's live.
    The one-hot is the forward's, kept for the backward: the loss's forward and backward follow each other,
    so it adds nothing to the peak. Strategies: ShardedCrossEntropy, which also hands it the logits in its
    own split (MindSpore's parallel passes do not know the split of what a bprop returns)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.row_max = ops.ReduceMax(keep_dims=True)
        self.one_hot = ops.OneHot()
        self.pick = ops.Mul()
        self.sum_picked = ops.ReduceSum(keep_dims=True)
        self.shift = ops.Sub()
        self.exp = ops.Exp()
        self.sum_exp = ops.ReduceSum(keep_dims=True)
        self.log = ops.Log()
        self.add_max = ops.Add()
        self.token_ce = ops.Sub()
        self.row_scale = ops.RealDiv()  # d loss / Z, [N, 1]
        self.probs = ops.Mul()  # exp * (d loss / Z): the softmax times d loss
        self.label_grad = ops.Mul()  # one_hot * d loss
        self.minus_label = ops.Sub()
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, logits, labels):
        row_max = self.row_max(logits, -1)
        one_hot = self.one_hot(ops.depend(labels, logits), self.vocab_size, self.on, self.off)
        picked = self.sum_picked(self.pick(logits, one_hot), -1)
        exp = self.exp(self.shift(ops.depend(logits, picked), row_max))
        sum_exp = self.sum_exp(exp, -1)
        return self.token_ce(self.add_max(self.log(sum_exp), row_max), picked), exp, sum_exp, one_hot

    def bprop(self, logits, labels, out, dout):
        token_ce, exp, sum_exp, one_hot = out
        d_loss = dout[0]
        scaled = self.probs(ops.depend(exp, token_ce), self.row_scale(d_loss, sum_exp))  # after the forward
        d_logits = self.minus_label(scaled, self.label_grad(ops.depend(one_hot, scaled), d_loss))
        return d_logits, ops.zeros_like(labels)


class ShardedCrossEntropy(nn.Cell):
    """sum(ce * mask) / max(sum(mask), 1) from elementary ops, each with a strategy (semi-auto parallel).

    The max, the exp-sum and the label's logit reduce over the vocabulary, which the plan splits over
    model_parallel (Megatron's vocab-parallel cross entropy; a head that is not vocab-split is sliced
    locally, as MindFormers' loss does), so the compiler all-reduces [N, 1] tensors instead of
    gathering [N, V] logits; a data-parallel head under sequence parallel splits the tokens instead
    (Layout.logit_split). The two sums over tokens reduce over the row split (data parallel, or dp x tp
    for that head), so every rank computes the loss of the whole global batch. The fused kernel of MaskedCrossEntropy cannot
    serve here: it returns one rank's mean, and its batch-parallel strategy splits tokens over all
    devices. Same numbers as MaskedCrossEntropy (tested on CPU); slower there (the one-hot product).
    The [N, V] part and its gradient: TokenCrossEntropy; `to_split`, a StridedSlice of the whole logits with
    the loss's strategy, gives it the logits in its own split (a slice of the vocabulary of a head that is not
    vocab-split), so the split of the gradient it returns is the one MindSpore's passes expect there (without
    it a head that is not vocab-split failed to compile under tp 2: its MatMul's backward got the loss's
    [N, V/2] slice). Where the head's split is the loss's, the slice is a view: no memory, no copy (SOMAS).
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.tokens = TokenCrossEntropy(vocab_size)
        self.to_split = ops.StridedSlice()
        self.apply_mask = ops.Mul()
        self.sum_loss = ops.ReduceSum()
        self.sum_mask = ops.ReduceSum()

    def mask_hidden(self, hidden, loss_mask):
        return hidden

    def shard_strategies(self, style: str, layout: Layout) -> dict:
        """[N, V] ops split as the head's logits are (Layout.logit_split); logits every tp rank holds whole are
        reduced on a slice of the vocabulary each. The token sums reduce over the row split."""
        rows, vocab = layout.logit_split
        split = (rows, layout.tp) if rows * vocab == layout.token_rows else (rows, vocab)
        rows = (split[0], 1)
        per_token = {
            "row_max": (split,),
            "one_hot": (split, (), ()),
            "pick": (split, split),
            "sum_picked": (split,),
            "shift": (split, rows),
            "exp": (split,),
            "sum_exp": (split,),
            "log": (rows,),
            "add_max": (rows, rows),
            "token_ce": (rows, rows),
            "row_scale": (rows, rows),
            "probs": (split, rows),
            "label_grad": (split, rows),
            "minus_label": (split, split),
        }
        return {
            **{f"tokens.{name}": (strategy, None) for name, strategy in per_token.items()},
            "to_split": ((split,), None),
            "apply_mask": ((rows, rows), None),
            "sum_loss": ((rows,), None),
            "sum_mask": ((rows,), None),
        }

    def construct(self, logits, labels, loss_mask=None):
        n, v = logits.shape
        token_ce = self.tokens(self.to_split(logits, (0, 0), (n, v), (1, 1)), labels.reshape(-1))[0]
        if loss_mask is None:  # every token trained: the mean over the global batch's (static) token count
            return self.sum_loss(token_ce) / float(labels.shape[0] * labels.shape[1])
        mask = loss_mask.reshape(-1, 1)
        return self.sum_loss(self.apply_mask(token_ce, mask)) / ops.maximum(self.sum_mask(mask), 1.0)


class CausalLMLoss(nn.Cell):
    """construct(input_ids, labels, loss_mask=None, segment_ids=None) -> the model's masked mean cross
    entropy (no mask: every token trained), plus
    `aux_loss_coeff` x the load-balancing loss of a mixture of experts (its mean over layers) and
    model.sequence_balance_coeff (moe.seq_aux_loss_coeff) x DeepSeek-V3's sequence-wise balance loss (its mean
    over layers), over the same tokens: padding and the other untrained tokens do not count (models/moe.py
    says why); with model.mtp_depth D, plus mtp_loss_weight / D x the multi-token-prediction modules' cross
    entropies (models/mtp.py), from the decoder's output before the mask zeroes its untrained rows.

    A mixture of experts' router statistics of the last call (aux loss averaged, busiest-expert load
    maxed, sequence-wise loss averaged over layers) are kept in the parameter `moe_stats`, and the
    multi-token-prediction term in `mtp_loss`, for the host to log, as BatchNorm keeps its
    moving statistics: written in the graph, never trained, not a weight of the model nor optimizer state."""

    def __init__(self, model: CausalLM, aux_loss_coeff: float = 0.0, training: bool = True):
        """training: add the terms only training optimises (the multi-token-prediction term, the sequence-wise
        balance loss); False: the next-token loss alone (a held-out pass, whose mean is the model's perplexity)."""
        super().__init__(auto_prefix=False)  # keep the model's parameter names unprefixed
        self.model = model
        self.aux_loss_coeff = aux_loss_coeff
        self.sequence_balance_coeff = model.sequence_balance_coeff if training else 0.0
        self.multi_token = training and model.mtp is not None
        self.mtp_loss = (
            Parameter(Tensor([0.0], ms.float32), name=MTP_LOSS, requires_grad=False) if self.multi_token else None
        )
        self.moe_stats = (
            Parameter(Tensor([0.0, 0.0, 0.0], ms.float32), name=MOE_STATS, requires_grad=False) if model.moe else None
        )
        self.record = ops.Assign().shard(((1,), (1,)))  # whole on every rank (a strategy unused unsharded)

    def construct(self, input_ids, labels, loss_mask=None, segment_ids=None):
        model = self.model
        decoded, routing = model.decode(input_ids, segment_ids, loss_mask)
        hidden = decoded if loss_mask is None else model.loss.mask_hidden(decoded, loss_mask)
        loss = model.loss(model.logits(hidden), labels, loss_mask)
        if self.multi_token:
            mtp_loss, routing = model.mtp_loss(decoded, input_ids, labels, loss_mask, segment_ids, routing)
            noted = self.record(self.mtp_loss, ops.stop_gradient(mtp_loss.reshape((1,))))
            loss = ops.depend(loss + mtp_loss, noted)
        if self.moe_stats is None:
            return loss
        aux = routing[0] / model.moe_layers  # the mean over the layers with experts (not DeepSeek-V3's dense ones)
        sequence_aux = routing[2] / model.moe_layers
        kept = self.record(self.moe_stats, ops.stop_gradient(ops.stack((aux, routing[1], sequence_aux))))
        loss = loss + self.aux_loss_coeff * aux
        if self.sequence_balance_coeff:
            loss = loss + self.sequence_balance_coeff * sequence_aux
        return ops.depend(loss, kept)


class NextTokenLoss(nn.Cell):
    """The network a training step differentiates: rows of tokens as stored, [B, S + 1] -> CausalLMLoss of
    the inputs tokens[:, :-1] and the labels tokens[:, 1:]; `loss_mask` [B, S] (SFT data: which labels are
    trained; None: all) and `segment_ids` [B, S] (packed data) as CausalLMLoss takes them.

    Why the shift happens in the graph: a step's graph calls this network once per micro batch, and each
    argument of the reused network is paid per micro batch in the compile (docs/dryrun.md, "Compile time
    against micro batches"). MindFormers' LlamaForCausalLM takes its input the same way. The two slices keep
    the rows as fed (split over data parallel, runtime.set_input_layout): no row moves."""

    def __init__(self, model: CausalLM, layout: Layout, aux_loss_coeff: float = 0.0, training: bool = True):
        super().__init__(auto_prefix=False)  # keep the model's parameter names unprefixed
        self.loss = CausalLMLoss(model, aux_loss_coeff, training)
        self.inputs, self.labels = ops.StridedSlice(), ops.StridedSlice()
        if layout.sharded:
            self.inputs.shard(((layout.dp, 1),))
            self.labels.shard(((layout.dp, 1),))

    def construct(self, tokens, loss_mask=None, segment_ids=None):
        rows, length = tokens.shape
        input_ids = self.inputs(tokens, (0, 0), (rows, length - 1), (1, 1))
        labels = self.labels(tokens, (0, 1), (rows, length), (1, 1))
        return self.loss(input_ids, labels, loss_mask, segment_ids)


class ReusedNextTokenLoss(NextTokenLoss):
    """The loss network compiled once and called for every micro batch (Layout.graph_reuse "model";
    MindSpore lazy_inline on the outermost cell, where MindFormers puts it for pipeline and gradient
    accumulation): a step of hundreds of micro batches would otherwise compile a copy of the model per
    micro batch. MindSpore allows lazy_inline only on that outermost cell in these layouts, so the
    decoder layers are then plain blocks."""

    @ms.lazy_inline(attrs="graph_key")
    def __init__(self, model: CausalLM, layout: Layout, aux_loss_coeff: float = 0.0, training: bool = True):
        super().__init__(model, layout, aux_loss_coeff, training)
        self.graph_key = "loss network"  # the graph's cache key (without it MindSpore prints the cell tree)
