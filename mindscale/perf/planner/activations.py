"""What a transformer layer keeps for its backward, per micro batch on one rank, term by term.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4: per layer and
micro batch ``s·b·h·(34 + 5·a·s/h)`` bytes without parallelism, ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with
tensor parallel t, ``s·b·h/t·(34 + 5·a·s/h)`` with tensor + sequence parallel, ``34·s·b·h/t`` with selective
recompute, ``2·s·b·h`` with full recompute. `layer_activation_bytes` builds those numbers term by term (which
tensor, which dtype, which are split by t), so with the paper's settings (`PAPER`) it returns the paper's formulas
exactly and with the model's settings it covers GQA, SwiGLU and MindSpore's dtypes. How many micro batches a stage
holds is the pipeline schedule's (schedule.py).

How MindSpore differs from the paper, and what the planner does about it
---------------------------------------------------------------------------
* Softmax runs in fp32 (MindScale keeps norms, softmax and the loss in fp32): the saved softmax
  output is 4 bytes per score plus its compute-dtype cast that feeds scores x V, instead of the
  paper's 2-byte softmax + 1-byte dropout mask + 2-byte dropout output (5 bytes per score).
* FlashAttentionScore (attention resolves to flash on Atlas A2) never stores the s x s scores: the
  ``5·a·s/h`` term is dropped and only the per-row softmax max/sum (fp32, 8 wide, as the primitive
  returns them) are kept. Selective recompute then saves no further activation memory.
* Norm inputs are kept in fp32 (the norm casts up), so they cost 4 bytes per element, not 2.
* MindScale's models have no dropout: no dropout masks (the paper's 1-byte terms).
* Activations are stored in model.compute_dtype (4 bytes in fp32 runs, 2 in fp16/bf16); pipeline
  stages send the residual stream, in model.residual_dtype.
* SwiGLU keeps gate, SiLU(gate), up and their product (4·f per token) where GELU keeps 2·f.
* Norms keep the statistics their fused kernels return for the backward: RmsNorm's reciprocal RMS, LayerNorm's
  mean and variance (fp32 per token each; the paper ignores them).
* Under sequence parallel MindSpore keeps the input of the column-parallel matmuls (QKV, the MLP's first)
  all-gathered: the weight-gradient MatMul reads the forward's AllGather output (validate IR), where Megatron
  keeps the split norm output and regathers it (all-gathers it again) in the backward; 2·s·b·h·(1 - 1/t)
  compute-dtype bytes more per layer and micro batch. recompute.comm marks those matmuls `recompute_comm_op`
  (MindFormers' select_comm_recompute), which makes the backward regather as Megatron does: the paper's bytes, one
  more all-gather of each input in the backward.
* Full recompute without recompute.comm (MindSpore's mp_comm_recompute=False) repeats no collective: the
  recomputed forward reads the forward's all-gathered inputs and the attention's reduce-scatter output (its
  all-reduce output without sequence parallel), which stay on the device with the layer input.
* Activation offload (offload.layers; docs/planner.md): an offloaded layer keeps its Q, K and V on the device
  and moves everything else it keeps (as counted above), as the compiled graph moves it, to host memory; the
  copies cross hardware.host_link_gbps and count where they outlast the slot's forward third (out) or backward
  two thirds (back).
"""

from __future__ import annotations

from dataclasses import dataclass

from mindscale.config import Config, Layout
from mindscale.perf import flops
from mindscale.perf.planner.caches import _layout
from mindscale.perf.planner.sizes import DTYPE_BYTES


FLASH_STATS_WIDTH = 8  # FlashAttentionScore returns softmax max and sum as (B, N, S, 8) fp32


@dataclass(frozen=True)
class ActivationDtypes:
    """Bytes per stored element, whether dropout masks exist, and the norms' saved statistics."""

    act: int  # matmul inputs/outputs (compute dtype)
    norm: int  # norm inputs
    softmax: int  # saved softmax output of composite attention
    dropout: bool  # 1-byte masks after attention probs, attention out, MLP out, embedding
    norm_stats: int = 0  # bytes per token a norm keeps besides its input (the paper ignores them)


PAPER = ActivationDtypes(act=2, norm=2, softmax=2, dropout=True)


def mindspore_dtypes(compute_dtype: str, rms_norm: bool = True) -> ActivationDtypes:
    """MindScale's dtypes on MindSpore; the norms' statistics as the fused kernels return them for the backward:
    RmsNorm's reciprocal RMS, LayerNorm's mean and variance (fp32 per token each)."""
    act = DTYPE_BYTES[compute_dtype]
    return ActivationDtypes(act=act, norm=4, softmax=4, dropout=False, norm_stats=4 if rms_norm else 8)


def layer_activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    *,
    mlp: str = "gelu",
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    flash: bool = False,
    dtypes: ActivationDtypes = PAPER,
    head_dim: int | None = None,
    gathered: bool = False,
    comm: bool = True,
    tp_x: int = 1,
    tp_y: int = 1,
    tp_z: int = 1,
) -> float:
    """Bytes one transformer layer keeps for backward, for one micro batch of `batch` sequences.

    With MHA, a 4h GELU MLP and `PAPER` dtypes: sbh(34 + 5as/h) (t = 1), sbh(10 + 24/t + 5as/(ht))
    (tensor parallel), sbh/t(34 + 5as/h) (+ sequence parallel), 34sbh/t (selective, with sp),
    2sbh (full). `head_dim`: the width of a head where it is not hidden / heads (Qwen3).

    Two ways MindSpore keeps more than the paper (Megatron) under tensor parallel, both read from the validate
    IR (docs/planner.md, "What MindSpore keeps beyond the paper"):
    * `gathered`: under sequence parallel the column-parallel matmuls (QKV, the MLP's first) keep their input
      all-gathered over t for their weight gradients, where Megatron keeps it split and regathers it in the
      backward: the two norm outputs are kept whole, 2·s·b·h·(1 - 1/t) more (MindSpore without recompute.comm).
    * `comm` False (full recompute): the recomputed forward repeats no communication but reads the forward's
      outputs of it, which stay: under sequence parallel both all-gathered inputs and the attention's
      reduce-scatter output, 2·s·b·h + s·b·h/t; without it the attention's all-reduce output, s·b·h.

    `tp_x` x `tp_y` (x `tp_z`) = t > 1: 2D or 3D tensor parallel (nd_tp_layer_bytes)."""
    head_dim = head_dim or hidden // heads
    if tp_x * tp_y > 1:
        split = (tp_x, tp_y, tp_z)
        layer = nd_tp_layer_bytes(seq * batch, hidden, heads, kv_heads, ffn, head_dim, split, recompute, dtypes, comm)
        scores = 0.0 if recompute == "full" else _scores_bytes(seq, batch, heads, recompute, flash, dtypes)
        return layer + scores / (tp_x * tp_y * tp_z)
    sbh = seq * batch * hidden
    split = t if sp else 1
    if recompute == "full":  # only the layer input is kept
        outputs = 0 if comm or t == 1 else sbh * (2 + 1 / t if sp else 1)
        return (sbh / split + outputs) * dtypes.act
    mask = 1 if dtypes.dropout else 0
    # Replicated over t unless sequence parallel: the two norm inputs (and their statistics), the dropout masks
    # after attention and after the MLP; the norm outputs feeding QKV and the MLP too, unless kept gathered.
    replicated = sbh * (2 * dtypes.norm + 2 * mask) + 2 * seq * batch * dtypes.norm_stats
    norm_out = 2 * sbh * dtypes.act
    # Split over t (inside the column/row-parallel pair): Q, K, V, attention output, MLP inner.
    qk = seq * batch * (heads + kv_heads) * head_dim * dtypes.act
    v = seq * batch * kv_heads * head_dim * dtypes.act
    attention_out = seq * batch * heads * head_dim * dtypes.act
    mlp_inner = seq * batch * ffn * dtypes.act * (4 if mlp == "swiglu" else 2)
    inner = qk + v + attention_out + mlp_inner
    scores = _scores_bytes(seq, batch, heads, recompute, flash, dtypes)
    return replicated / split + norm_out / (1 if gathered else split) + (inner + scores) / t


def _scores_bytes(seq: int, batch: int, heads: int, recompute: str, flash: bool, dtypes: ActivationDtypes) -> float:
    """What the attention core keeps per layer and micro batch, all heads: flash attention's softmax statistics,
    nothing under selective recompute (recomputed from Q, K and V), else the saved softmax (and its dropout)."""
    if flash:
        return seq * batch * heads * FLASH_STATS_WIDTH * 4 * 2
    if recompute == "selective":
        return 0.0
    mask = 1 if dtypes.dropout else 0
    per_score = dtypes.softmax + (
        mask + dtypes.act if dtypes.dropout else (dtypes.act if dtypes.softmax != dtypes.act else 0)
    )
    return heads * seq * seq * batch * per_score


def nd_tp_layer_bytes(
    tokens: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    head_dim: int,
    split: tuple[int, int, int],
    recompute: str,
    dtypes: ActivationDtypes,
    comm: bool,
) -> float:
    """What a SwiGLU layer keeps for its backward under 2D or 3D tensor parallel (`split` = (x, y, z), t = x·y·z, z = 1
    for 2D), per micro batch of `tokens` tokens on one rank, as the validate IR of a LLaMA twin's layer graph hands it
    to its backward (the arguments of the forward's `Partial`; tests/dryrun/test_kept_activations.py, docs/planner.md
    "2D and 3D tensor parallel"). The residual stream is split over t: its width over (x, y) in 2D, its tokens over
    (z, y) and its width over x in 3D.

    * each norm (models/layers.py WidthSplitRMSNorm, composite) its fp32 input and normalised output, a t-th of the
      stream each, and the reciprocal RMS per token of the rank's rows;
    * the column-parallel inputs all-gathered over y, [T/z, h/x]: one for wq, wk and wv, one for w1 and w3;
    * Q, K, V, the attention's output and softmax statistics, split over t as under 1D;
    * the row-parallel inputs all-gathered over x: the attention's output [T/z, heads·d/y] and the SwiGLU product
      [T/z, f/y];
    * the gate, the up projection and SiLU(gate), f/t wide;
    * the attention core's (_scores_bytes, split over t), which the caller adds.

    A fully recomputed layer keeps its input and, without recompute.comm, the forward collectives' outputs its
    recomputed forward reads: the norms' fp32 sums of squares; in 2D each of the five column projections' gathered
    input apart and both row projections' (nd_tp_gathered_bytes); in 3D instead the seven weights all-gathered over z
    and one [T, heads·d/t] attention tensor (its other collectives run again)."""
    x, y, z = split
    t, act = x * y * z, dtypes.act
    rows = tokens / (z * y) if z > 1 else tokens  # the stream's tokens on a rank: 3D splits them over (z, y)
    layer_input = tokens * hidden / t * act
    if recompute == "full":
        if comm:
            return layer_input
        sums = 2 * rows * 4
        if z == 1:
            return layer_input + sums + nd_tp_gathered_bytes(tokens, hidden, heads * head_dim, ffn, split, act, 5)
        weights = hidden * ((2 * heads + 2 * kv_heads) * head_dim + 3 * ffn) / (x * y) * act
        return layer_input + sums + weights + tokens * heads * head_dim / t * act
    norms = 2 * (2 * dtypes.norm * tokens * hidden / t + rows * dtypes.norm_stats)
    gathered = nd_tp_gathered_bytes(tokens, hidden, heads * head_dim, ffn, split, act, 2)
    qkv = tokens * (heads + 2 * kv_heads) * head_dim / t * act
    attention_out = tokens * heads * head_dim / t * act
    mlp = 3 * tokens * ffn / t * act
    return norms + gathered + qkv + attention_out + mlp


def nd_tp_gathered_bytes(
    tokens: int, hidden: int, attention: int, ffn: int, split: tuple[int, int, int], act: int, inputs: int
) -> float:
    """The gathered inputs a 2D or 3D tensor-parallel layer keeps, for the T/z tokens of the rank's token group:
    `inputs` column-projection inputs of h/x (2 where wq/wk/wv and w1/w3 share a gather, 5 in a 2D recomputed
    forward, which gathers each on its own), wo's of attention/y and w2's of f/y."""
    x, y, z = split
    return tokens / z * (inputs * hidden / x + attention / y + ffn / y) * act


def expert_slots(cfg: Config) -> int:
    """E x C: the slots of every expert for one rank's tokens of a micro batch (a token group of
    models/moe.py), C = model.moe.capacity of those tokens."""
    moe = cfg.model.moe
    return moe.num_experts * moe.capacity(local_tokens(cfg))


def routed_activation_bytes(cfg: Config, recompute: str) -> float:
    """What a mixture-of-experts layer keeps for backward on one rank, per micro batch, beyond the dense
    layer without its MLP (estimated from models/moe.py's tensors): the router's fp32 probabilities and
    choices (T x E, T x k x E), the routed tokens gathered into the experts' slots (E x C x h: the expert-
    parallel AlltoAll moves the same slots, so a rank holds E x C of them whatever ep is), the experts'
    SwiGLU inner tensors (4 x E x C x F/t), each choice's gathered output (k x T x h) and the shared
    expert's inner tensors (4 x T x F_shared/t)."""
    model, moe = cfg.model, cfg.model.moe
    if not model.spec.moe or recompute == "full":
        return 0.0
    act, t, tokens = DTYPE_BYTES[model.compute_dtype], cfg.parallel.model_parallel, local_tokens(cfg)
    slots = expert_slots(cfg)
    router = tokens * moe.num_experts * 4 * (2 + moe.top_k)
    routed = (slots + moe.top_k * tokens) * model.hidden_size * act
    inner = 4 * (slots * moe.expert_ffn(model.ffn_hidden_size) + tokens * moe.shared_expert_ffn_hidden_size) * act / t
    return router + routed + inner


def _model_layer_activation_bytes(cfg: Config, recompute: str, flash: bool, gathered: bool | None = None) -> float:
    """One layer's kept bytes for one micro batch on one rank, as MindSpore keeps them (layer_activation_bytes with
    the model's dtypes): its S/cp tokens under context parallel, and the keys and values gathered from the other cp
    ranks, which the attention's backward reads. Under sequence parallel the column-parallel inputs are kept
    gathered unless recompute.comm regathers them in the backward (`gathered` overrides: a fully recomputed
    layer's rematerialised forward keeps them gathered either way; read from dense layers' IR, a mixture of
    experts' counted alike). A mixture of experts: the dense layer without its MLP, plus routed_activation_bytes."""
    model, parallel, layout = cfg.model, cfg.parallel, _layout(cfg)
    comm = cfg.recompute.comm
    local = layer_activation_bytes(
        model.seq_length // parallel.context_parallel,
        cfg.train.micro_batch_size,
        model.hidden_size,
        model.num_heads,
        model.kv_heads,
        0 if model.spec.moe else model.ffn_hidden_size,
        mlp="swiglu" if model.spec.gated_mlp else "gelu",
        t=parallel.model_parallel,
        sp=parallel.sequence_parallel,
        recompute=recompute,
        flash=flash,
        dtypes=mindspore_dtypes(model.compute_dtype, model.spec.rms_norm),
        head_dim=model.head_size,
        gathered=not comm if gathered is None else gathered,
        comm=comm,
        tp_x=layout.tp_x,
        tp_y=layout.tp_y,
        tp_z=layout.tp_z,
    )
    local += routed_activation_bytes(cfg, recompute) + head_norm_bytes(cfg, recompute)
    # full recompute rematerialises the gather only if it repeats communication (recompute.comm, MindSpore's
    # mp_comm_recompute); otherwise the gathered K and V are kept like any communication output
    return local + (0.0 if recompute == "full" and comm else gathered_kv_bytes(cfg))


# What a per-head RMSNorm of q and k (Qwen3's qk-norm, models/layers.py HeadRMSNorm) keeps per element: MindSpore's
# level-1 plans of qwen3_8b and qwen3_14b hold 9.5-10.3 bytes per q/k element and layer beyond the planner's other
# terms (docs/evidence/planner.md): the fp32 input and normalised output of an Fp32Norm (4 + 4) and a copy in the
# compute dtype.
HEAD_NORM_FP32_BYTES = 8


def head_norm_bytes(cfg: Config, recompute: str) -> float:
    """Per layer and micro batch, what qk-norm keeps for its backward on one rank (heads split over tp); 0 without
    qk-norm or under full recompute (the layer keeps its input only)."""
    model = cfg.model
    if not model.spec.qk_norm or recompute == "full":
        return 0.0
    elements = local_tokens(cfg) * (model.num_heads + model.kv_heads) * model.head_size / cfg.parallel.model_parallel
    return elements * (HEAD_NORM_FP32_BYTES + DTYPE_BYTES[model.compute_dtype])


def rematerialised_bytes(cfg: Config, flash: bool) -> float:
    """What a fully recomputed layer adds while its backward runs: its activations, recomputed, with the
    column-parallel inputs gathered (regathered with recompute.comm; without, the forward's kept all-gather
    outputs are read, already counted in what the layer kept: under sequence parallel and 2D tensor parallel; 3D's
    recomputed forward gathers them again)."""
    remat = _model_layer_activation_bytes(cfg, "none", flash, gathered=True)
    layout, model = _layout(cfg), cfg.model
    if cfg.recompute.comm or not (layout.sp or layout.nd_tp):
        return remat
    act = DTYPE_BYTES[model.compute_dtype]
    if layout.nd_tp:  # 2D's recomputed forward reads the kept gathers; 3D's gathers them again
        attention, split = model.num_heads * model.head_size, layout.tensor_split
        kept = nd_tp_gathered_bytes(
            local_tokens(cfg), model.hidden_size, attention, model.ffn_hidden_size, split, act, 2
        )
        return remat - (kept if layout.tp_z == 1 else 0.0)
    return remat - 2 * local_tokens(cfg) * model.hidden_size * act


def local_tokens(cfg: Config) -> int:
    """Tokens of one micro batch on one rank: micro_batch_size x seq_length / context_parallel."""
    return cfg.train.micro_batch_size * cfg.model.seq_length // cfg.parallel.context_parallel


def _kv_bytes(cfg: Config, tokens: int) -> float:
    """K and V of `tokens` tokens on one rank (kv heads split over tp), in the compute dtype."""
    model = cfg.model
    return (
        2 * tokens * model.kv_heads * model.head_size / cfg.parallel.model_parallel * DTYPE_BYTES[model.compute_dtype]
    )


def gathered_kv_bytes(cfg: Config) -> float:
    """colossalai_cp: per layer and micro batch, the K and V of the other cp ranks' tokens, all-gathered for
    the rank's queries and kept for the backward (the all-gather's output is FlashAttentionScoreGrad's
    input). 0 without context parallel and under ulysses_cp, whose all-to-all keeps the bytes it moves."""
    parallel = cfg.parallel
    if parallel.context_parallel == 1 or parallel.context_parallel_algo != "colossalai_cp":
        return 0.0
    return _kv_bytes(cfg, local_tokens(cfg) * (parallel.context_parallel - 1))


def offload_resident_bytes(cfg: Config) -> float:
    """What an offloaded layer keeps on the device per micro batch: its Q, K and V (the rank's heads and tokens),
    which the attention kernel reads through reshapes (Tensor methods, no primitive that Cell.offload marks);
    MindSpore moves every other activation the backward reads (the validate IR of tests/dryrun/test_offload.py).
    Under parallel.context_parallel_load_balance also the attention's output and softmax statistics: the
    parallel pass replaces FlashAttentionScore by its two half-chunk kernels, which carry no offload mark
    (llama3_1_70b_128k's twin: 40,962 bytes a layer and micro batch fewer moved, these and a [1] placeholder).
    Under 2D tensor parallel also the gathered inputs and the gate and up outputs, which leave the parallel pass's
    all-gathers and transposes (a 2 x 2 twin's layer moved its norms', SiLU's and attention's tensors only); under
    3D the gate and up outputs and wo's gathered input (a 2 x 2 x 2 twin moved the other gathered inputs)."""
    model, parallel = cfg.model, cfg.parallel
    tokens = local_tokens(cfg)
    queries = tokens * model.num_heads * model.head_size / parallel.model_parallel * DTYPE_BYTES[model.compute_dtype]
    resident = queries + _kv_bytes(cfg, tokens)
    layout = _layout(cfg)
    if layout.cp_load_balance:
        stats = tokens * model.num_heads / parallel.model_parallel * FLASH_STATS_WIDTH * 4 * 2  # max and sum, fp32
        resident += queries + stats  # the output has the queries' shape
    if layout.nd_tp:  # what the parallel pass inserts for the matmuls carries no offload mark, but 3D's gathers do
        act, attention = DTYPE_BYTES[model.compute_dtype], model.num_heads * model.head_size
        split = layout.tensor_split
        gathered = (
            nd_tp_gathered_bytes(tokens, model.hidden_size, attention, model.ffn_hidden_size, split, act, 2)
            if layout.tp_z == 1
            else tokens / layout.tp_z * attention / layout.tp_y * act  # wo's input only
        )
        resident += gathered + 2 * tokens * model.ffn_hidden_size / layout.tp * act  # and the gate and up outputs
    return resident


def offloaded_layer_bytes(cfg: Config, layout: Layout | None = None) -> float:
    """Bytes one offloaded layer moves to host memory in the forward and back in the backward, per micro batch on
    one rank, as the compiled graph moves them (tests/dryrun/test_offload.py; equal at full size for llama3_405b,
    docs/planner.md): what the layer keeps without recompute (_model_layer_activation_bytes: under sequence
    parallel its column-parallel inputs gathered, or split with recompute.comm), less what stays resident. When
    each layer is its own reused graph (graph_reuse "layer": one micro batch a step) the compute-dtype copies of
    its matmul weights move too, where they differ from the parameter dtype (the casts are ops of the offloaded
    layer; in a reused loss network, graph_reuse "model", they are not moved, nor are 3D's, gathered over z)."""
    model, layout = cfg.model, layout or _layout(cfg)
    cb = DTYPE_BYTES[model.compute_dtype]
    weights = (
        flops.layer_matmul_params(model) / layout.tp * cb
        if layout.graph_reuse == "layer" and model.compute_dtype != model.param_dtype and layout.tp_z == 1
        else 0.0
    )
    kept = _model_layer_activation_bytes(cfg, "none", layout.attention == "flash")
    return kept - offload_resident_bytes(cfg) + weights


def mtp_modules_on(cfg: Config, stage: int) -> int:
    """Multi-token-prediction modules `stage` computes (models/mtp.py): model.mtp_depth on the last stage, with the
    head they share, none elsewhere."""
    return cfg.model.mtp_depth if stage == _layout(cfg).pp - 1 else 0


def mtp_activation_bytes(cfg: Config) -> float:
    """What one multi-token-prediction module keeps for its backward per micro batch on one rank: its block's, as a
    kept layer's (never recomputed), and per token of the [T, h] stream (split over tp under sequence parallel)
    the fp32 inputs of enorm, hnorm and the head's norm, the [T, 2h] projection input and the head's input in the
    compute dtype; and its cross entropy's exp and one-hot, fp32 [T, V] split over tp (TokenCrossEntropy keeps
    them for its backward, which runs after every module's forward)."""
    model, layout = cfg.model, _layout(cfg)
    tokens, cb = local_tokens(cfg), DTYPE_BYTES[model.compute_dtype]
    stream = tokens * model.hidden_size * (3 * 4 + 3 * cb) / (layout.tp if layout.sp else 1)
    loss = 2 * tokens * model.vocab_size * 4 / layout.tp
    return _model_layer_activation_bytes(cfg, "none", layout.attention == "flash") + stream + loss


def _stage_layer_roles(layout: Layout, stage: int, recomputed: int | None, offloaded: int | None) -> list[str]:
    """Per layer of `stage` in order: recomputed (the first r), offloaded (the next o), or kept; r and o default
    to the layout's (Layout.recomputed, Layout.offloaded), the search overrides them."""
    r = layout.recomputed_in(stage) if recomputed is None else recomputed
    o = layout.offloaded_in(stage) if offloaded is None else offloaded
    n = layout.layers_per_stage[stage]
    return ["recomputed"] * min(r, n) + ["offloaded"] * min(o, n - min(r, n)) + ["kept"] * max(0, n - r - o)
