"""Bytes one rank sends per optimizer step, by parallel dimension (ring collectives): data-parallel gradients,
tensor-parallel collectives, context-parallel K/V exchange, expert-parallel AlltoAlls and pipeline sends."""

from __future__ import annotations

import math

from mindscale.config import Config, Layout
from mindscale.perf.planner.activations import _kv_bytes, _stage_layer_roles, expert_slots, local_tokens, mtp_modules_on
from mindscale.perf.planner.caches import _GRADIENT_BYTES, _layout, _stored_key
from mindscale.perf.planner.parameters import embedding_copied, optimizer_shard, parameter_slices
from mindscale.perf.planner.schedule import pipeline_sends
from mindscale.perf.planner.sizes import DTYPE_BYTES


def context_parallel_bytes_per_layer(cfg: Config) -> float:
    """Ring bytes one rank sends per layer and micro batch for context parallel, forward and backward.
    colossalai_cp: K and V all-gathered forward and their gradients reduce-scattered backward, (c-1)/c of the
    whole-sequence tensors each way (again forward when full recompute repeats communication).
    ulysses_cp: q, k, v and the attention output all-to-all forward and back in the backward, (c-1)/c of
    the rank's own [S/c, heads/t] tensors each."""
    model, parallel = cfg.model, cfg.parallel
    c = parallel.context_parallel
    if c == 1:
        return 0.0
    share = (c - 1) / c
    if parallel.context_parallel_algo == "ulysses_cp":
        q_and_out = (
            2
            * local_tokens(cfg)
            * model.num_heads
            * model.head_size
            / parallel.model_parallel
            * DTYPE_BYTES[model.compute_dtype]
        )
        return 2 * share * (q_and_out + _kv_bytes(cfg, local_tokens(cfg)))
    return _cp_passes(cfg) * share * _kv_bytes(cfg, local_tokens(cfg) * c) + load_balance_bytes_per_layer(cfg)


def _cp_passes(cfg: Config) -> int:
    """How often colossalai_cp's collectives run per layer and micro batch: forward, backward, and the forward
    again when full recompute repeats communication."""
    return 3 if cfg.recompute.mode == "full" and cfg.recompute.comm else 2


def load_balance_bytes_per_layer(cfg: Config) -> float:
    """Ring bytes one rank sends per layer and micro batch for parallel.context_parallel_load_balance: the
    exchange of half its queries [S/2c, heads/t] and of that half's attention output with its partner rank,
    each an all-gather over the pair (half the gathered tensor sent), reduce-scattered back in the backward
    (validate IR, tests/dryrun/test_context_parallel.py); full recompute with recompute.comm is assumed to repeat
    the forward pair as it repeats the K/V gather. 0 without the load balance."""
    if not _layout(cfg).cp_load_balance:
        return 0.0
    model = cfg.model
    half = local_tokens(cfg) / 2 * model.num_heads * model.head_size / cfg.parallel.model_parallel
    return _cp_passes(cfg) * 2 * half * DTYPE_BYTES[model.compute_dtype]


def nd_tp_groups(layout: Layout) -> dict[str, tuple[int, int, int]]:
    """2D and 3D tensor parallel's communication groups (nd_tp_bytes_by_group's keys): (stride, size, collectives per
    layer and micro batch, forward and backward), ranks numbered x innermost, then z, then y (models/layers.py
    tp_mesh). 2D (validate IR): over x, 5 reduce-scatters (wq, wk, wv, w1, w3) and 2 all-gathers (wo, w2) forward
    and as many the other way backward; over y, 2 all-gathers (the shared inputs) and 2 reduce-scatters (wo, w2)
    forward, mirrored backward; the two norms' all-reduces over all t, forward and backward. 3D: as 2D over x and y,
    with the norms' all-reduces over x; the 7 weights' all-gathers over z (their gradients reduce-scattered
    backward); the four redistributions of q, k, v and the attention output between the token split and the head
    split, an all-gather over x, then over z, each mirrored backward ("heads", timed as one group of x·z: with more
    than one data-parallel row MindSpore gathers over both at once, with one it gathers over x, then z)."""
    x, y, z = layout.tensor_split
    if z == 1:
        return {"x": (1, x, 2 * 7), "y": (x, y, 2 * 4), "t": (1, x * y, 4)}
    return {"x": (1, x, 2 * 7 + 4), "z": (x, z, 2 * 7), "y": (x * z, y, 2 * 4), "heads": (1, x * z, 2 * 2 * 4)}


def nd_tp_bytes_by_group(cfg: Config, role: str = "kept") -> dict[str, float]:
    """2D tensor parallel (parallel.tp_x x tp_y = t; 3D: _tp3d_bytes_by_group): ring bytes one rank sends per layer
    and micro batch, forward and backward, by group: "x" (tp_x neighbouring ranks), "y" (tp_y ranks tp_x apart),
    "t" (all tp ranks).
    A column-parallel projection h -> e all-gathers its input [T, h/x] over y and reduce-scatters its partial
    sums [T, e/y] over x; a row-parallel e -> h the same with x and y swapped; the backward mirrors each (a
    reduce-scatter for an all-gather). A pair h -> e -> h sends MindSpore's 2T[e(x-1) + h(y-1)]/xy forward,
    against 1D's all-reduce 2(t-1)Th/t. wq/wk/wv share one all-gather of their input, and so do w1/w3; the norms
    all-reduce their mean of squares [T, 1] fp32 over t (validate IR, tests/dryrun/test_nd_tensor_parallel.py).
    A layer of `role` "recomputed" under full recompute with recompute.comm repeats in the backward every forward
    collective over x (7 of 14), three over y (the two input gathers and wo's scatter, 3 of 8; w2's scatter ends
    the layer) and the norms' two all-reduces (validate IR)."""
    model, layout = cfg.model, _layout(cfg)
    if layout.tp_z > 1:
        return _tp3d_bytes_by_group(cfg, role)
    x, y, t = layout.tp_x, layout.tp_y, layout.tp
    tokens, h, dtype = local_tokens(cfg), model.hidden_size, DTYPE_BYTES[model.compute_dtype]
    q, kv, f = model.num_heads * model.head_size, model.kv_heads * model.head_size, model.ffn_hidden_size
    over_y = 4 * tokens * h * (y - 1) / (x * y)  # the attention's and the MLP's input gathers, wo's and w2's scatters
    over_x = tokens * (x - 1) / (x * y) * ((q + 2 * kv) + q + 2 * f + f)  # qkv and w1/w3 scatters, wo and w2 gathers
    norms = 2 * 2 * (t - 1) / t * tokens * DTYPE_BYTES["float32"]
    repeats = role == "recomputed" and layout.recompute == "full" and cfg.recompute.comm
    x_passes, y_passes = (3, 2 + 3 / 4) if repeats else (2, 2)  # y: 3 of its 4 forward collectives again
    return {"x": x_passes * over_x * dtype, "y": y_passes * over_y * dtype, "t": (3 if repeats else 2) * norms}


def _tp3d_bytes_by_group(cfg: Config, role: str) -> dict[str, float]:
    """3D tensor parallel (parallel.tp_x x tp_y x tp_z = t): nd_tp_bytes_by_group's bytes, by group: "x" (tp_x
    neighbouring ranks), "z" (tp_z ranks tp_x apart), "y" (tp_y ranks tp_z x tp_x apart), and "heads" (over z and
    x). The residual stream [T, h] is split T over (z, y) and h over x. A column-parallel projection h -> e
    all-gathers its input over y ([T/z, h/x] gathered) and its weight [e/y, h/x] over z, and reduce-scatters its
    partial sums [T/z, e/y] over x; a row-parallel e -> h the same with x and y swapped; the backward mirrors each
    (the weight's gradient reduce-scattered over z). A pair h -> e -> h sends MindSpore's
    2[Te(x-1) + Th(y-1) + he(z-1)]/xyz forward. wq/wk/wv share one input gather, and so do w1/w3. The attention
    core splits heads over all t ranks (its strategies are 1D), so q, k, v [T/(zx), e/y] and the core's output are
    redistributed between the token split and the head split: all-gathered over x and z (Te/y (xz-1)/xz sent,
    mirrored backward). The norms all-reduce their mean of squares [T/zy, 1] fp32 over x (validate IR,
    tests/dryrun/test_nd_tensor_parallel.py). A layer of `role` "recomputed" under full recompute with
    recompute.comm repeats every forward collective but w2's scatter over y, as under 2D: the x and z ones, the
    redistributions, the norms' all-reduces and three of the four over y (validate IR of the module's layout at one
    stage, two layers)."""
    model, layout = cfg.model, _layout(cfg)
    x, y, z, t = layout.tp_x, layout.tp_y, layout.tp_z, layout.tp
    tokens, h, dtype = local_tokens(cfg), model.hidden_size, DTYPE_BYTES[model.compute_dtype]
    q, kv, f = model.num_heads * model.head_size, model.kv_heads * model.head_size, model.ffn_hidden_size
    over_y = 4 * tokens * h * (y - 1) / t  # the attention's and the MLP's input gathers, wo's and w2's scatters
    over_x = tokens * (x - 1) / t * ((q + 2 * kv) + q + 2 * f + f)  # qkv and w1/w3 scatters, wo and w2 gathers
    over_z = h * (z - 1) / t * (q + 2 * kv + q + 3 * f)  # the seven weights' gathers
    heads = tokens / y * (x * z - 1) / (x * z) * (q + 2 * kv + q)  # q, k, v and the core's output
    norms = 2 * 2 * (x - 1) / x * tokens / (z * y) * DTYPE_BYTES["float32"]
    repeats = role == "recomputed" and layout.recompute == "full" and cfg.recompute.comm
    passes, y_passes = (3, 2 + 3 / 4) if repeats else (2, 2)
    return {
        "x": passes * (over_x * dtype + norms),
        "y": y_passes * over_y * dtype,
        "z": passes * over_z * dtype,
        "heads": passes * heads * dtype,
    }


def nd_tp_bytes_per_layer(cfg: Config, role: str = "kept") -> float:
    """nd_tp_bytes_by_group, all groups."""
    return sum(nd_tp_bytes_by_group(cfg, role).values())


def _mean_by_group(cfg: Config, roles: list[str]) -> dict[str, float]:
    """nd_tp_bytes_by_group averaged over a stage's layers of `roles`."""
    per_role = [nd_tp_bytes_by_group(cfg, role) for role in roles] or [nd_tp_bytes_by_group(cfg)]
    return {group: sum(b[group] for b in per_role) / len(per_role) for group in per_role[0]}


def nd_tp_head_gather_bytes(cfg: Config) -> float:
    """2D/3D tensor parallel, last stage: ring bytes one rank sends per micro batch to all-gather the final norm's
    split output [T, h] for the output head (degree by degree: MindSpore's redistribution, (t-1)/t of it in all)
    and to reduce-scatter its gradient back the same way."""
    model, layout = cfg.model, _layout(cfg)
    stream = local_tokens(cfg) * model.hidden_size * DTYPE_BYTES[model.compute_dtype]
    return 2 * stream * (layout.tp - 1) / layout.tp


def gradient_reduce_bytes(cfg: Config, stage: int) -> tuple[float, float]:
    """Ring bytes one rank of `stage` sends per step for its gradients, over the r ranks holding each
    trained slice: an all-reduce, 2(r-1)/r of the slice; with the optimizer shard a reduce-scatter,
    (r-1)/r (once per step, or per micro batch with parallel.gradient_accumulation_shard), plus the
    all-gather of the updated weights, (r-1)/r of the slice in the dtype its op reads (a MatMul's
    weight in the compute dtype: MindSpore gathers after the cast). Returns (bytes once per step,
    bytes per micro batch)."""
    layout = _layout(cfg)
    key = _stored_key(cfg, layout, stage)
    if key in _GRADIENT_BYTES:
        return _GRADIENT_BYTES[key]
    once = per_micro = 0.0
    for p in parameter_slices(cfg, layout):
        ranks = layout.stage_devices // p.replicas
        if stage not in p.stages or not p.trainable or ranks == 1:
            continue
        elements, share = math.prod(p.local), (ranks - 1) / ranks
        if optimizer_shard(p, layout) == 1:
            once += 2 * share * elements * p.itemsize
            continue
        # the last stage's copy of the embedding gathers the stored-dtype slice it received
        # (tied_embedding_exchange_bytes)
        tied_copy = stage != p.stages[0]
        once += share * elements * (p.itemsize if tied_copy else p.read_itemsize)
        if layout.accumulation_shard:
            per_micro += share * elements * p.itemsize
        else:
            once += share * elements * p.itemsize
    _GRADIENT_BYTES[key] = once, per_micro
    return once, per_micro


def communication(cfg: Config, stage: int) -> dict:
    """Bytes one device of `stage` sends per optimizer step (ring collectives)."""
    model, layout = cfg.model, _layout(cfg)
    t, stages, micro_batches = layout.tp, layout.pp, layout.micro_steps
    hidden = local_tokens(cfg) * model.hidden_size  # elements of one micro batch's hidden states on the rank
    x = hidden * DTYPE_BYTES[model.compute_dtype]  # as a layer's matmuls take them
    # Per layer and micro batch, averaged over the stage's layers (tp_all_reduces: what each role adds); the last
    # stage's multi-token-prediction blocks count as kept layers with experts
    mtp = mtp_modules_on(cfg, stage)
    roles = _stage_layer_roles(layout, stage, None, None) + ["kept"] * mtp
    blocks = layout.layers_per_stage[stage] + mtp
    all_reduces = sum(tp_all_reduces(cfg, role) for role in roles) / max(1, len(roles))
    tp_per_layer = all_reduces * 2 * (t - 1) / t * x if t > 1 else 0.0
    if layout.nd_tp:
        tp_per_layer = sum(nd_tp_bytes_per_layer(cfg, role) for role in roles) / max(1, len(roles))
    # The vocabulary-split lookup (first stage) and head (last stage), per micro batch: Megatron's
    # all-reduce one way (the lookup's forward, the head input's backward), or under sequence parallel a
    # reduce-scatter and an all-gather: 2(t-1)/t of the hidden states either way.
    vocab_ends = (stage == 0) + (stage == stages - 1) + 2 * mtp if layout.vocab_parallel else 0  # a module: both
    tp_vocab = vocab_ends * micro_batches * 2 * (t - 1) / t * x if t > 1 else 0.0
    head_gathers = layout.nd_tp and stage == stages - 1
    if head_gathers:
        tp_vocab += micro_batches * nd_tp_head_gather_bytes(cfg)
    # the stage's layers with experts (a mixture of experts' dense first layers have none: DeepSeek-V3)
    held = sorted(layout.layers_of_stage(stage)) + [model.num_layers + k for k in range(mtp)]
    experts = [i >= model.moe.dense_layers for i in held] if model.spec.moe else []
    if any(experts) and t > 1:  # the experts' w2 partial sums (and w1/w3 input gradients): E x C slots, not T
        tp_per_layer += (
            2
            * 2
            * (t - 1)
            / t
            * (expert_slots(cfg) - local_tokens(cfg))
            * model.hidden_size
            * DTYPE_BYTES[model.compute_dtype]
            * sum(experts)
            / len(experts)
        )
    tp = tp_per_layer * blocks * micro_batches + tp_vocab
    ep_per_layer = sum(expert_alltoall_bytes(cfg, role) for role, routed in zip(roles, experts) if routed) / max(
        1, len(roles)
    )
    ep = ep_per_layer * blocks * micro_batches
    cp_per_layer = context_parallel_bytes_per_layer(cfg)
    cp = cp_per_layer * blocks * micro_batches
    dp_once, dp_micro = gradient_reduce_bytes(cfg, stage)
    dp = dp_once + dp_micro * micro_batches
    sends = pipeline_sends(stages, layout.interleave, stage)  # activations out, grads back
    # what a stage sends: the residual stream, split over t by sequence parallel and 2D/3D tensor parallel
    stream = hidden * DTYPE_BYTES[model.residual_dtype]
    tied = tied_embedding_exchange_bytes(cfg, stage)
    pp = (sends * micro_batches * stream / (t if layout.sp or layout.nd_tp else 1) if stages > 1 else 0.0) + tied
    return {
        "dp_grad_reduce": dp,
        "dp_per_micro_batch": dp_micro,
        "tp_per_layer": tp_per_layer,
        "tp_vocab": tp_vocab,
        "tp": tp,
        "tp_per_layer_by_group": _mean_by_group(cfg, roles) if layout.nd_tp else {"t": tp_per_layer},
        "tp_collectives_per_layer": sum(ops for _, _, ops in nd_tp_groups(layout).values())
        if layout.nd_tp
        else (2 * all_reduces if t > 1 else 0),
        "tp_vocab_collectives": (2 * vocab_ends if t > 1 else 0) + 4 * head_gathers,
        "cp_per_layer": cp_per_layer,
        "cp_exchange_per_layer": load_balance_bytes_per_layer(cfg),
        "cp": cp,
        "ep_per_layer": ep_per_layer,
        "ep": ep,
        "pp_send_recv": pp,
        "pp_sends_per_micro_batch": sends if stages > 1 else 0,
        "pp_tied_embedding": tied,
        "blocks": blocks,
        "total": dp + tp + cp + ep + pp,
    }


def tied_embedding_exchange_bytes(cfg: Config, stage: int) -> float:
    """Bytes a rank of the first or last stage sends once per step for the last stage's copy of the embedding
    under a pipeline (parameters.embedding_copied: a tied output head, or multi-token prediction's lookup).
    MindSpore's pipeline pass shares the embedding between the two stages by sending it, not by Megatron's
    all-reduce of the two copies' gradients: the first stage sends its stored slice of the weight (the
    optimizer shard's, in the stored dtype) to the last, which all-gathers it in that dtype, computes the
    head's gradient, reduce-scatters it and sends its slice back (validate IR of llama3_2_3b's last stage:
    Receive of tok_embeddings.weight [32064, 3072] fp32, AllGather fp32, ReduceScatter, Send fp32 back to
    rank 0). 0 on the other stages and without a copy."""
    layout = _layout(cfg)
    if not (embedding_copied(cfg, layout) and stage in (0, layout.pp - 1)):
        return 0.0
    [embedding] = [p for p in parameter_slices(cfg, layout) if p.name == "tok_embeddings.weight"]
    return math.prod(embedding.local) / optimizer_shard(embedding, layout) * embedding.itemsize


def expert_alltoall_bytes(cfg: Config, role: str) -> float:
    """Bytes one rank sends per layer of `role` (_stage_layer_roles) and micro batch for expert parallel: its
    E x C routed slots [E, C, h] all-to-all over the ep ranks before the experts and back after them, forward
    and backward (4 AlltoAlls, (ep-1)/ep of the slots each; MindSpore turns the change of split into them,
    models/moe.py), and a fully recomputed layer's forward again (6): MindSpore repeats these AlltoAlls in the
    recomputation whatever recompute.comm says (mp_comm_recompute leaves them in; read from the validate IR of
    the qwen3_235b_a22b twin: 6 a layer and micro batch recomputed, 4 without recompute). 0 at ep 1."""
    model, ep = cfg.model, cfg.parallel.expert_parallel
    if ep == 1:
        return 0.0
    passes = 6 if role == "recomputed" and _layout(cfg).recompute == "full" else 4
    return passes * (ep - 1) / ep * expert_slots(cfg) * model.hidden_size * DTYPE_BYTES[model.compute_dtype]


def tp_all_reduces(cfg: Config, role: str) -> float:
    """Tensor-parallel traffic of one layer of `role` (_stage_layer_roles) per micro batch, in all-reduces of its
    hidden states (2(t-1)/t of them each; an all-gather or a reduce-scatter is half of one): 4, Megatron's two
    forward and two backward (all-gather + reduce-scatter pairs under sequence parallel); with recompute.comm, what
    MindSpore gathers or reduces again in the backward (validate IR, docs/planner.md): a fully recomputed layer
    repeats the forward collectives its backward reads, the attention's all-reduce (1), or under sequence
    parallel both all-gathers and the attention's reduce-scatter (1.5; the MLP's reduce-scatter feeds only the
    layer output); any other layer regathers its two column-parallel inputs under sequence parallel (1)."""
    layout = _layout(cfg)
    if not cfg.recompute.comm:
        return 4.0
    if role == "recomputed" and layout.recompute == "full":
        return 4 + (1.5 if layout.sp else 1.0)
    return 4 + (1.0 if layout.sp else 0.0)
