"""The parallel planner: parameters, FLOPs, per-device memory, communication and a predicted step
time for a resolved config, before anything is compiled (issue 5, DESIGN.md §3-4).

Sources of the formulas
-----------------------
* Parameters and FLOPs: training/flops.py (PaLM App. B; Korthikanti et al. 2022; Narayanan et al. 2021).
* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", §4: per layer and micro batch ``s·b·h·(34 + 5·a·s/h)`` bytes without parallelism,
  ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallel t, ``s·b·h/t·(34 + 5·a·s/h)`` with tensor
  + sequence parallel, ``34·s·b·h/t`` with selective recompute, ``2·s·b·h`` with full recompute;
  under 1F1B stage k holds ``p - k`` micro batches in flight (stage 0 holds p).
  `layer_activation_bytes` builds those numbers term by term (which tensor, which dtype, which are
  split by t), so with the paper's settings (`PAPER`) it returns the paper's formulas exactly and
  with the model's settings it covers GQA, SwiGLU and MindSpore's dtypes.

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
* Activations are stored in model.compute_dtype (4 bytes in fp32 runs, 2 in fp16/bf16).
* SwiGLU keeps gate, SiLU(gate), up and their product (4·f per token) where GELU keeps 2·f.
* Optimizer: nn.AdamWeightDecay keeps two moments in the parameter dtype (training/optim.py); with
  param_dtype float32 the parameter is the master copy. With a compute dtype different from the
  parameter dtype (or with optimizer sharding, whose gathered weight is a full copy) a full
  compute-dtype copy of the weights lives through the step. Gradients are in the parameter dtype;
  with optimizer sharding the accumulated gradient is sharded over data parallel too (MindSpore's
  gradient_accumulation_shard), plus one layer's full gradient before its reduce-scatter.
* The output logits are kept in the compute dtype, cast to fp32 for the loss, and the fp32 softmax
  of the loss is kept for its backward: (compute bytes + 8) per logit of one micro batch on the
  last stage (vocab split over t).

Predicted step time (assumptions are returned with the prediction)
------------------------------------------------------------------
Hardware FLOPs of the busiest pipeline stage at `efficiency` x peak, plus tensor-parallel
collectives (on the critical path), times ``(m + p - 1)`` micro-batch slots (1F1B bubble
``(p-1)/m``), plus pipeline send/recv, plus the part of the data-parallel gradient reduction that
does not overlap the last micro batch's backward (2/3 of its compute). Bandwidths come from the
hardware profile: a group inside one node uses intra_node_gbps, otherwise inter_node_gbps; ranks
are ordered tensor-parallel innermost, then data parallel, then pipeline.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from training import flops
from training.config import (Config, ConfigError, apply_override, config_from_tree, recompute_layer_counts,
                             stage_layer_counts)

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Fraction of the peak the hardware FLOPs are assumed to run at (matmul-bound training step).
DEFAULT_EFFICIENCY = {"Ascend": 0.55, "GPU": 0.55, "CPU": 0.3}
FLASH_STATS_WIDTH = 8  # FlashAttentionScore returns softmax max and sum as (B, N, S, 8) fp32


class PlanError(ValueError):
    """A plan that cannot be made (bad --devices, no fitting layout): one line with the fix."""


# ----------------------------------------------------------------------------------------------
# Activation memory (Korthikanti et al. 2022, §4), term by term


@dataclass(frozen=True)
class ActivationDtypes:
    """Bytes per stored element, and whether dropout masks exist."""
    act: int        # matmul inputs/outputs (compute dtype)
    norm: int       # norm inputs
    softmax: int    # saved softmax output of composite attention
    dropout: bool   # 1-byte masks after attention probs, attention out, MLP out, embedding


PAPER = ActivationDtypes(act=2, norm=2, softmax=2, dropout=True)


def mindspore_dtypes(compute_dtype: str) -> ActivationDtypes:
    act = DTYPE_BYTES[compute_dtype]
    return ActivationDtypes(act=act, norm=4, softmax=4, dropout=False)


def layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int, kv_heads: int, ffn: int, *,
                           mlp: str = "gelu", t: int = 1, sp: bool = False, recompute: str = "none",
                           flash: bool = False, dtypes: ActivationDtypes = PAPER) -> float:
    """Bytes one transformer layer keeps for backward, for one micro batch of `batch` sequences.

    With MHA, a 4h GELU MLP and `PAPER` dtypes: sbh(34 + 5as/h) (t = 1), sbh(10 + 24/t + 5as/(ht))
    (tensor parallel), sbh/t(34 + 5as/h) (+ sequence parallel), 34sbh/t (selective, with sp),
    2sbh (full)."""
    sbh = seq * batch * hidden
    head_dim = hidden // heads
    if recompute == "full":
        return sbh * dtypes.act / (t if sp else 1)      # only the layer input is kept
    mask = 1 if dtypes.dropout else 0
    # Replicated over t unless sequence parallel: the two norm inputs, the norm outputs feeding
    # QKV and the MLP, the dropout masks after attention and after the MLP.
    replicated = sbh * (2 * dtypes.norm + 2 * dtypes.act + 2 * mask)
    # Split over t (inside the column/row-parallel pair): Q, K, V, attention output, MLP inner.
    qk = seq * batch * (heads + kv_heads) * head_dim * dtypes.act
    v = seq * batch * kv_heads * head_dim * dtypes.act
    attention_out = sbh * dtypes.act
    mlp_inner = seq * batch * ffn * dtypes.act * (4 if mlp == "swiglu" else 2)
    split = qk + v + attention_out + mlp_inner
    if flash:
        scores = seq * batch * heads * FLASH_STATS_WIDTH * 4 * 2
    elif recompute == "selective":
        scores = 0                                       # recomputed from Q, K, V in backward
    else:
        per_score = dtypes.softmax + (mask + dtypes.act if dtypes.dropout else
                                      (dtypes.act if dtypes.softmax != dtypes.act else 0))
        scores = heads * seq * seq * batch * per_score
    return replicated / (t if sp else 1) + (split + scores) / t


def _model_layer_activation_bytes(cfg: Config, recompute: str, flash: bool) -> float:
    m, p = cfg.model, cfg.parallel
    return layer_activation_bytes(m.seq_length, cfg.train.micro_batch_size, m.hidden_size, m.num_heads, m.kv_heads,
                                  m.ffn_hidden_size, mlp="swiglu" if m.arch == "llama" else "gelu",
                                  t=p.model_parallel, sp=p.sequence_parallel, recompute=recompute, flash=flash,
                                  dtypes=mindspore_dtypes(m.compute_dtype))


def uses_flash(cfg: Config) -> bool:
    """model.attention resolved against the hardware profile (auto = flash where it exists)."""
    return cfg.model.attention == "flash" or (cfg.model.attention == "auto" and cfg.hardware.flash_attention)


# ----------------------------------------------------------------------------------------------
# Per-stage parameters and memory


def _vocab_split(cfg: Config) -> int:
    """Tensor-parallel split of the output projection (vocab-parallel when the vocab divides)."""
    t = cfg.parallel.model_parallel
    return t if cfg.model.vocab_size % t == 0 else 1


def stage_params(cfg: Config) -> list[float]:
    """Parameters held by one device of each pipeline stage (tensor-parallel shards)."""
    m, p = cfg.model, cfg.parallel
    t, stages = p.model_parallel, p.pipeline_stage
    per_layer = flops.layer_matmul_params(m) / t + flops.layer_other_params(m)
    embedding = m.vocab_size * m.hidden_size / (1 if p.vocab_emb_dp else t)
    positions = m.seq_length * m.hidden_size if m.arch == "gpt" else 0
    final_norm = m.hidden_size * (1 if m.arch == "llama" else 2)
    output = flops.output_params(m) / _vocab_split(cfg)
    counts = stage_layer_counts(m.num_layers, stages, p.stage_offset)
    out = [n * per_layer for n in counts]
    out[0] += embedding + positions
    out[-1] += final_norm
    if not (m.tie_embeddings and stages == 1):
        out[-1] += output       # a tied output on another stage is a second copy (as in Megatron)
    return out


def _in_flight(cfg: Config, stage: int) -> int:
    p = cfg.parallel
    return min(p.pipeline_stage - stage, p.micro_batch_num) if p.pipeline_stage > 1 else 1


def stage_memory(cfg: Config, stage: int, recomputed: int | None = None) -> dict:
    """Memory breakdown (bytes) of one device of pipeline stage `stage`.

    `recomputed` overrides the number of recomputed layers of this stage (used by the search)."""
    m, p, hw = cfg.model, cfg.parallel, cfg.hardware
    params = stage_params(cfg)[stage]
    pb, cb = DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[m.compute_dtype]
    shard = p.data_parallel if p.optimizer_shard else 1
    weights = params * pb / shard + (params * cb if (cb != pb or shard > 1) else 0)
    # With optimizer sharding MindSpore also shards the accumulated gradient over data parallel
    # (parallel_optimizer_config gradient_accumulation_shard, on by default); one layer's full
    # gradient exists before its reduce-scatter.
    largest_layer = flops.layer_matmul_params(m) / p.model_parallel + flops.layer_other_params(m)
    grads = params * pb / shard + (largest_layer * pb if shard > 1 else 0)
    optimizer = 2 * params * pb / shard

    layers = stage_layer_counts(m.num_layers, p.pipeline_stage, p.stage_offset)[stage]
    r = recompute_layer_counts(cfg)[stage] if recomputed is None else recomputed
    flash = uses_flash(cfg)
    kept = _model_layer_activation_bytes(cfg, "none", flash)
    recomputed_bytes = _model_layer_activation_bytes(cfg, cfg.recompute.mode, flash) if r else 0.0
    per_micro_batch = (layers - r) * kept + r * recomputed_bytes
    activations = _in_flight(cfg, stage) * per_micro_batch
    if r and cfg.recompute.mode == "full":
        activations += kept        # one layer rematerialised at a time during backward
    if stage == p.pipeline_stage - 1:
        sb = m.seq_length * cfg.train.micro_batch_size
        t = p.model_parallel
        activations += sb * m.hidden_size * 4 / (t if p.sequence_parallel else 1)      # final norm input
        activations += sb * m.vocab_size / _vocab_split(cfg) * (cb + 8)                # logits, fp32 loss
    reserve = hw.memory_reserve_gib * GIB
    parts = {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations,
             "reserve": reserve}
    parts["total"] = sum(parts.values())
    return parts


def memory_budget_gib(cfg: Config) -> float:
    """What a plan may fill: memory_margin of the memory left after the framework reserve (+ the reserve)."""
    hw = cfg.hardware
    return hw.memory_reserve_gib + (hw.memory_gib - hw.memory_reserve_gib) * hw.memory_margin


# ----------------------------------------------------------------------------------------------
# Communication and time


def _bandwidth(cfg: Config, span: int) -> float:
    """Bytes/s of a group whose ranks span `span` consecutive devices."""
    hw = cfg.hardware
    gbps = hw.intra_node_gbps if span <= hw.devices_per_node else hw.inter_node_gbps
    return gbps * 1e9


def communication(cfg: Config, stage: int) -> dict:
    """Bytes one device of `stage` sends per optimizer step (ring collectives)."""
    m, p = cfg.model, cfg.parallel
    d, t, stages = p.data_parallel, p.model_parallel, p.pipeline_stage
    cb, pb = DTYPE_BYTES[m.compute_dtype], DTYPE_BYTES[m.param_dtype]
    micro_batches = p.micro_batch_num * p.gradient_accumulation_steps
    x = m.seq_length * cfg.train.micro_batch_size * m.hidden_size * cb     # one layer's hidden states
    # Per layer and micro batch: 2 collectives forward, 2 backward (all-reduce, or all-gather +
    # reduce-scatter with sequence parallel: the same volume), 2(t-1)/t of the tensor each.
    collectives = 4 + (2 if cfg.recompute.mode == "full" and cfg.recompute.comm else 0)
    tp_per_layer = collectives * 2 * (t - 1) / t * x if t > 1 else 0.0
    layers = stage_layer_counts(m.num_layers, stages, p.stage_offset)[stage]
    tp = tp_per_layer * layers * micro_batches
    dp = 2 * (d - 1) / d * stage_params(cfg)[stage] * pb if d > 1 else 0.0
    sends = (stage > 0) + (stage < stages - 1)                              # activations out, grads back
    pp = sends * micro_batches * x / (t if p.sequence_parallel else 1) if stages > 1 else 0.0
    return {"dp_grad_reduce": dp, "tp_per_layer": tp_per_layer, "tp": tp, "pp_send_recv": pp,
            "total": dp + tp + pp}


def _stage_flops_per_token(cfg: Config, stage: int) -> float:
    """Hardware FLOPs per token of one stage (whole tensor-parallel group)."""
    m, p = cfg.model, cfg.parallel
    layers = stage_layer_counts(m.num_layers, p.pipeline_stage, p.stage_offset)[stage]
    output = 6 * flops.output_params(m)
    per_layer = (flops.model_flops_per_token(m) - output) / m.num_layers
    r = recompute_layer_counts(cfg)[stage]
    extra = flops.recompute_flops_per_token(m, cfg.recompute.mode, recomputed_layers=r)
    return layers * per_layer + extra + (output if stage == p.pipeline_stage - 1 else 0)


def predict(cfg: Config, peak_tflops: float, efficiency: float) -> dict:
    m, p = cfg.model, cfg.parallel
    d, t, stages = p.data_parallel, p.model_parallel, p.pipeline_stage
    tokens_per_micro_batch = cfg.train.micro_batch_size * m.seq_length
    flop_rate = peak_tflops * 1e12 * efficiency
    tp_bw, dp_bw, pp_bw = _bandwidth(cfg, t), _bandwidth(cfg, t * d), _bandwidth(cfg, t * d * stages)
    slots, comm = [], []
    for k in range(stages):
        c = communication(cfg, k)
        compute = tokens_per_micro_batch * _stage_flops_per_token(cfg, k) / t / flop_rate
        layers = stage_layer_counts(m.num_layers, stages, p.stage_offset)[k]
        slots.append(compute + c["tp_per_layer"] * layers / tp_bw)
        comm.append(c)
    slot = max(slots)
    micro_batches = p.micro_batch_num
    pipeline = p.gradient_accumulation_steps * (micro_batches + stages - 1) * slot
    pp_time = max(c["pp_send_recv"] for c in comm) / pp_bw
    dp_time = max(c["dp_grad_reduce"] for c in comm) / dp_bw
    dp_exposed = max(0.0, dp_time - 2 / 3 * slot)
    step = pipeline + pp_time + dp_exposed
    tokens_per_s = cfg.global_batch_size * m.seq_length / step
    devices = cfg.devices
    recomputed = sum(recompute_layer_counts(cfg))
    return {
        "step_time_s": step, "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / devices,
        "samples_per_s_per_device": cfg.global_batch_size / step / devices,
        "tflops_per_device": tokens_per_s * flops.model_flops_per_token(m) / devices / 1e12,
        "mfu": flops.mfu(tokens_per_s, devices, peak_tflops, m),
        "hfu": flops.hfu(tokens_per_s, devices, peak_tflops, m, cfg.recompute.mode, recomputed),
        "bubble_fraction": (stages - 1) / micro_batches if stages > 1 else 0.0,
        "compute_s": p.gradient_accumulation_steps * micro_batches * slot,
        "comm_exposed_s": pp_time + dp_exposed,
        "peak_tflops": peak_tflops, "efficiency": efficiency,
        "assumptions": [
            f"hardware FLOPs run at {efficiency:.0%} of the {peak_tflops:g} TFLOP/s peak",
            "tensor-parallel collectives are on the critical path (not overlapped)",
            f"1F1B pipeline: {micro_batches + stages - 1} micro-batch slots of the busiest stage per step "
            f"(bubble (p-1)/m = {(stages - 1) / micro_batches:.1%})" if stages > 1 else "no pipeline bubble",
            "data-parallel gradient reduction overlaps the last micro batch's backward (2/3 of its compute); "
            "the rest is exposed",
            "bandwidths: hardware profile, intra-node for groups within devices_per_node, else inter-node",
            "optimizer update, data loading and host overhead are not counted",
        ],
    }


def peak_of(cfg: Config) -> float:
    """The hardware profile's peak, or the measured CPU GEMM peak when the profile has none."""
    if cfg.hardware.peak_tflops is not None:
        return cfg.hardware.peak_tflops
    from training.gemm_peak import cpu_peak_tflops
    return cpu_peak_tflops()


def plan(cfg: Config, peak_tflops: float | None = None, efficiency: float | None = None) -> dict:
    """The DESIGN §3 plan of `cfg`: params, FLOPs, worst-stage memory, fits, comm bytes, prediction."""
    peak = peak_tflops if peak_tflops is not None else peak_of(cfg)
    eff = efficiency if efficiency is not None else DEFAULT_EFFICIENCY[cfg.hardware.device_target]
    stages = [stage_memory(cfg, k) for k in range(cfg.parallel.pipeline_stage)]
    worst = max(range(len(stages)), key=lambda k: stages[k]["total"])
    comm = communication(cfg, worst)
    budget = memory_budget_gib(cfg)
    total_gib = stages[worst]["total"] / GIB
    return {
        "config": cfg.run.name,
        "hardware": cfg.hardware.name,
        "devices": cfg.devices,
        "layout": {"data_parallel": cfg.parallel.data_parallel, "model_parallel": cfg.parallel.model_parallel,
                   "pipeline_stage": cfg.parallel.pipeline_stage, "micro_batch_num": cfg.parallel.micro_batch_num,
                   "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.global_batch_size,
                   "gradient_accumulation_steps": cfg.parallel.gradient_accumulation_steps,
                   "sequence_parallel": cfg.parallel.sequence_parallel,
                   "optimizer_shard": cfg.parallel.optimizer_shard, "recompute": cfg.recompute.mode,
                   "recompute_layers": recompute_layer_counts(cfg),
                   "layers_per_stage": stage_layer_counts(cfg.model.num_layers, cfg.parallel.pipeline_stage,
                                                          cfg.parallel.stage_offset),
                   "attention": "flash" if uses_flash(cfg) else "composite"},
        "params": flops.param_count(cfg.model),
        "matmul_params": flops.matmul_param_count(cfg.model),
        "flops_per_token": flops.model_flops_per_token(cfg.model),
        "hflops_per_token": flops.hardware_flops_per_token(cfg.model, cfg.recompute.mode,
                                                           sum(recompute_layer_counts(cfg))),
        "memory_gib": {k: v / GIB for k, v in stages[worst].items()},
        "memory_stage": worst,
        "memory_gib_per_stage": [s["total"] / GIB for s in stages],
        "device_memory_gib": cfg.hardware.memory_gib,
        "memory_budget_gib": budget,
        "fits": total_gib <= budget,
        "comm_bytes_per_step": comm,
        "predicted": predict(cfg, peak, eff),
    }


# ----------------------------------------------------------------------------------------------
# Re-planning and search


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with `--set`-style overrides applied and re-validated (raises ConfigError)."""
    tree = copy.deepcopy(cfg.to_dict())
    for assignment in overrides:
        apply_override(tree, assignment)
    return config_from_tree(tree)


def _batch_overrides(cfg: Config, dp: int, pp: int, mbs: int) -> list[str] | None:
    """micro_batch_num / gradient accumulation that keep the global batch, or None if impossible."""
    g = cfg.global_batch_size
    per_step = mbs * dp
    if g % per_step:
        return None
    micro = g // per_step
    if pp > 1:
        if micro < pp:
            return None
        return [f"parallel.micro_batch_num={micro}", "parallel.gradient_accumulation_steps=1"]
    return ["parallel.micro_batch_num=1", f"parallel.gradient_accumulation_steps={micro}"]


def replan_devices(cfg: Config, devices: int) -> Config:
    """Same model/pipeline parallel and global batch on `devices` cards: data_parallel changes."""
    p = cfg.parallel
    group = p.model_parallel * p.pipeline_stage
    if devices < 1 or devices % group:
        raise PlanError(f"--devices {devices} is not a multiple of model_parallel x pipeline_stage = "
                        f"{p.model_parallel} x {p.pipeline_stage} = {group}; pick a multiple or change them with --set")
    dp = devices // group
    batch = _batch_overrides(cfg, dp, p.pipeline_stage, cfg.train.micro_batch_size)
    if batch is None:
        raise PlanError(f"global batch {cfg.global_batch_size} cannot be split over data_parallel={dp} x "
                        f"micro_batch_size={cfg.train.micro_batch_size} (x >= {p.pipeline_stage} micro batches); "
                        "set train.global_batch_size or train.micro_batch_size with --set")
    try:
        return with_overrides(cfg, [f"parallel.data_parallel={dp}", *batch,
                                    f"parallel.optimizer_shard={str(p.optimizer_shard and dp > 1).lower()}",
                                    f"train.global_batch_size={cfg.global_batch_size}"])
    except ConfigError as exc:
        raise PlanError(f"--devices {devices}: {exc}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def balanced_offset(layers: int, stages: int) -> list[int] | int:
    """stage_offset giving the remainder layers to the middle stages (stage 0 holds the most micro
    batches in flight, the last stage the logits)."""
    extra = layers % stages
    if not extra:
        return 0
    return [0] + [1] * extra + [0] * (stages - 1 - extra)


def _fit_full_recompute(cfg: Config) -> list[int] | None:
    """Fewest fully recomputed layers per stage that make every stage fit, or None."""
    budget = memory_budget_gib(cfg) * GIB
    counts = stage_layer_counts(cfg.model.num_layers, cfg.parallel.pipeline_stage, cfg.parallel.stage_offset)
    out = []
    for k, n in enumerate(counts):
        r = next((r for r in range(n + 1) if stage_memory(cfg, k, r)["total"] <= budget), None)
        if r is None:
            return None
        out.append(r)
    return out


def _layout_overrides(cfg: Config, dp: int, tp: int, pp: int, mbs: int) -> list[str] | None:
    m = cfg.model
    if any(x % tp for x in (m.num_heads, m.kv_heads, m.ffn_hidden_size)) or tp > cfg.hardware.devices_per_node:
        return None
    if pp > m.num_layers or (tp > 1 and m.seq_length % tp):
        return None
    batch = _batch_overrides(cfg, dp, pp, mbs)
    if batch is None:
        return None
    offset = balanced_offset(m.num_layers, pp)
    return [f"parallel.data_parallel={dp}", f"parallel.model_parallel={tp}", f"parallel.pipeline_stage={pp}",
            *batch, f"train.micro_batch_size={mbs}", f"train.global_batch_size={cfg.global_batch_size}",
            f"parallel.stage_offset={_yaml(offset)}", f"parallel.sequence_parallel={str(tp > 1).lower()}",
            f"parallel.optimizer_shard={str(dp > 1).lower()}"]


def _yaml(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def search(cfg: Config, devices: int, top: int = 5, peak_tflops: float | None = None,
           efficiency: float | None = None, micro_batch_sizes: tuple = (1, 2, 4)) -> list[dict]:
    """Valid (dp, mp, pp, micro batches, recompute) layouts for `devices` keeping the global batch,
    ranked by predicted tokens/s among those that fit. Each entry: overrides, plan."""
    peak = peak_tflops if peak_tflops is not None else peak_of(cfg)
    found = []
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            for mbs in micro_batch_sizes:
                layout = _layout_overrides(cfg, dp, tp, pp, mbs)
                if layout is None:
                    continue
                try:
                    base = with_overrides(cfg, layout + ["recompute.mode=none", "recompute.layers=null"])
                except ConfigError:
                    continue
                candidates = [[], ["recompute.mode=selective"]]
                full = _fit_full_recompute(with_overrides(base, ["recompute.mode=full"]))
                if full is not None and any(full):
                    candidates.append(["recompute.mode=full", f"recompute.layers={_yaml(full)}"])
                for extra in candidates:
                    candidate = with_overrides(base, extra) if extra else base
                    result = plan(candidate, peak, efficiency)
                    if result["fits"]:
                        sets = layout + (extra or ["recompute.mode=none"])
                        found.append({"overrides": sets, "plan": result})
    if not found:
        raise PlanError(f"no layout of {cfg.run.name} fits {devices} x {cfg.hardware.name} "
                        f"({cfg.hardware.memory_gib:g} GiB) at global batch {cfg.global_batch_size}; "
                        "use more devices, a smaller micro batch or a shorter sequence")
    found.sort(key=lambda c: (-c["plan"]["predicted"]["tokens_per_s"], c["plan"]["memory_gib"]["total"]))
    return found[:top]

