"""The parallel planner: parameters, FLOPs, per-device memory, communication and a predicted step
time for a resolved config, before anything is compiled (docs/planner.md).

Sources of the formulas
-----------------------
* Parameters and FLOPs: mindscale/perf/flops.py (PaLM App. B; Korthikanti et al. 2022; Narayanan et al. 2021).
* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", §4: per layer and micro batch ``s·b·h·(34 + 5·a·s/h)`` bytes without parallelism,
  ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallel t, ``s·b·h/t·(34 + 5·a·s/h)`` with tensor
  + sequence parallel, ``34·s·b·h/t`` with selective recompute, ``2·s·b·h`` with full recompute;
  under 1F1B stage k holds ``p - k`` micro batches in flight (stage 0 holds p); interleaved 1F1B with v
  chunks per stage (Narayanan et al. 2021, §2.2.2, as Megatron-LM schedules it) holds
  ``min(2(p-k-1) + (v-1)p + 1, v·m)`` chunk forwards, stage 0 ``v·p + p - 1`` (`in_flight_forwards`).
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
* Activations are stored in model.compute_dtype (4 bytes in fp32 runs, 2 in fp16/bf16); pipeline
  stages send the residual stream, in model.residual_dtype.
* SwiGLU keeps gate, SiLU(gate), up and their product (4·f per token) where GELU keeps 2·f.
* Weights, gradients and optimizer state are exact (`stage_bytes`, checked against the dry run's
  compiled slices): the model is built without weights, each parameter's slice is its shape divided
  by the plan's split (models.sharding.parameter_splits), and MindSpore's parallel optimizer cuts the
  first dimension of every trained parameter of at least 64 KiB over the ranks holding the same slice
  (`optimizer_shard`). AdamW keeps two fp32 moments whatever the parameter dtype; with param_dtype
  float32 the parameter is the master copy. Gradient accumulation and pipelines keep accumulation
  buffers of the model-parallel slice, or of the optimizer's shard of it with
  parallel.gradient_accumulation_shard (then reduce-scattered every micro batch).
* Transient (estimated): a compute-dtype copy of the weights when it differs from the parameter
  dtype or the optimizer shard all-gathers them, and one layer's gradients before their reduce-scatter.
* Norms keep the statistics their fused kernels return for the backward: RmsNorm's reciprocal RMS, LayerNorm's
  mean and variance (fp32 per token each; the paper ignores them).
* Under sequence parallel MindSpore keeps the input of the column-parallel matmuls (QKV, the MLP's first)
  all-gathered: the weight-gradient MatMul reads the forward's AllGather output (validate IR), where Megatron
  keeps the split norm output and gathers it again in the backward; 2·s·b·h·(1 - 1/t) compute-dtype bytes more
  per layer and micro batch. recompute.comm marks those matmuls `recompute_comm_op` (MindFormers'
  select_comm_recompute), which makes the backward gather again as Megatron does: the paper's bytes, one more
  all-gather of each input in the backward.
* Full recompute without recompute.comm (MindSpore's mp_comm_recompute=False) repeats no collective: the
  recomputed forward reads the forward's all-gathered inputs and the attention's reduce-scatter output (its
  all-reduce output without sequence parallel), which stay on the device with the layer input.
* Activation offload (offload.layers; docs/planner.md): an offloaded layer keeps its Q, K and V on the device
  and moves everything else it keeps (as counted above), as the compiled graph moves it, to host memory; the
  copies cross hardware.host_link_gbps and count where they outlast the slot's forward third (out) or backward
  two thirds (back).
* The output logits are kept in the compute dtype, cast to fp32 for the loss, and the fp32 softmax
  of the loss is kept for its backward: (compute bytes + 8) per logit of one micro batch on the
  last stage (vocab split over t).

Predicted step time (assumptions are returned with the prediction)
------------------------------------------------------------------
Hardware FLOPs of the busiest pipeline stage at `efficiency` x peak, plus tensor-parallel
collectives (on the critical path), times ``(m + p - 1)`` micro-batch slots (1F1B bubble
``(p-1)/m``; interleaved ``m + (p-1)/v`` slots, bubble ``(p-1)/(v·m)``), plus pipeline send/recv (v times
as many with v chunks, not overlapped), plus the part of the data-parallel gradient reduction that
does not overlap the last micro batch's backward (2/3 of its compute). Bandwidths come from the
hardware profile: a group inside one node uses intra_node_gbps, otherwise inter_node_gbps; ranks
are ordered tensor-parallel innermost, then data parallel, then pipeline.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mindscale.perf import flops
from mindscale.config import Config, ConfigError, UserError, apply_override, config_from_tree
from mindscale.perf.gemm_peak import device_peak_tflops
from mindscale.config import OPTIMIZER_SHARD_MIN_KIB, Layout, offload_layer_counts

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MOMENT_BYTES = 4  # AdamW's moments are fp32 whatever param_dtype (mindscale/train/loop/optim.py)
# Fraction of the peak the hardware FLOPs are assumed to run at (matmul-bound training step).
DEFAULT_EFFICIENCY = {"Ascend": 0.55, "GPU": 0.55, "CPU": 0.3}
FLASH_STATS_WIDTH = 8  # FlashAttentionScore returns softmax max and sum as (B, N, S, 8) fp32


_PER_CONFIG: dict[tuple[str, int], tuple[Config, object]] = {}


def _per_config(name: str, cfg: Config, derive):
    """derive(cfg), kept per config object (the planner never changes a config; with_overrides makes new ones): a
    search asks each candidate's layout and model key thousands of times."""
    key = (name, id(cfg))
    hit = _PER_CONFIG.get(key)
    if hit is None or hit[0] is not cfg:
        if len(_PER_CONFIG) > 8192:
            _PER_CONFIG.clear()
        hit = _PER_CONFIG[key] = (cfg, derive(cfg))
    return hit[1]


def _layout(cfg: Config) -> Layout:
    return _per_config("layout", cfg, Layout.of)


class PlanError(UserError):
    """A plan that cannot be made (bad --devices, no fitting layout): one line with the fix."""


# ----------------------------------------------------------------------------------------------
# Activation memory (Korthikanti et al. 2022, §4), term by term


@dataclass(frozen=True)
class ActivationDtypes:
    """Bytes per stored element, whether dropout masks exist, and the norms' saved statistics."""
    act: int        # matmul inputs/outputs (compute dtype)
    norm: int       # norm inputs
    softmax: int    # saved softmax output of composite attention
    dropout: bool   # 1-byte masks after attention probs, attention out, MLP out, embedding
    norm_stats: int = 0  # bytes per token a norm keeps besides its input (the paper ignores them)


PAPER = ActivationDtypes(act=2, norm=2, softmax=2, dropout=True)


def mindspore_dtypes(compute_dtype: str, rms_norm: bool = True) -> ActivationDtypes:
    """MindScale's dtypes on MindSpore; the norms' statistics as the fused kernels return them for the backward:
    RmsNorm's reciprocal RMS, LayerNorm's mean and variance (fp32 per token each)."""
    act = DTYPE_BYTES[compute_dtype]
    return ActivationDtypes(act=act, norm=4, softmax=4, dropout=False, norm_stats=4 if rms_norm else 8)


def layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int, kv_heads: int, ffn: int, *,
                           mlp: str = "gelu", t: int = 1, sp: bool = False, recompute: str = "none",
                           flash: bool = False, dtypes: ActivationDtypes = PAPER, head_dim: int | None = None,
                           gathered: bool = False, comm: bool = True) -> float:
    """Bytes one transformer layer keeps for backward, for one micro batch of `batch` sequences.

    With MHA, a 4h GELU MLP and `PAPER` dtypes: sbh(34 + 5as/h) (t = 1), sbh(10 + 24/t + 5as/(ht))
    (tensor parallel), sbh/t(34 + 5as/h) (+ sequence parallel), 34sbh/t (selective, with sp),
    2sbh (full). `head_dim`: the width of a head where it is not hidden / heads (Qwen3).

    Two ways MindSpore keeps more than the paper (Megatron) under tensor parallel, both read from the validate
    IR (docs/planner.md, "What MindSpore keeps beyond the paper"):
    * `gathered`: under sequence parallel the column-parallel matmuls (QKV, the MLP's first) keep their input
      all-gathered over t for their weight gradients, where Megatron keeps it split and gathers it again in the
      backward: the two norm outputs are kept whole, 2·s·b·h·(1 - 1/t) more (MindSpore without recompute.comm).
    * `comm` False (full recompute): the recomputed forward repeats no communication but reads the forward's
      outputs of it, which stay: under sequence parallel both all-gathered inputs and the attention's
      reduce-scatter output, 2·s·b·h + s·b·h/t; without it the attention's all-reduce output, s·b·h."""
    sbh = seq * batch * hidden
    head_dim = head_dim or hidden // heads
    split = t if sp else 1
    if recompute == "full":                              # only the layer input is kept
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
    if flash:
        scores = seq * batch * heads * FLASH_STATS_WIDTH * 4 * 2
    elif recompute == "selective":
        scores = 0                                       # recomputed from Q, K, V in backward
    else:
        per_score = dtypes.softmax + (mask + dtypes.act if dtypes.dropout else
                                      (dtypes.act if dtypes.softmax != dtypes.act else 0))
        scores = heads * seq * seq * batch * per_score
    return replicated / split + norm_out / (1 if gathered else split) + (inner + scores) / t


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
    m, moe = cfg.model, cfg.model.moe
    if not moe.enabled or recompute == "full":
        return 0.0
    act, t, tokens = DTYPE_BYTES[m.compute_dtype], cfg.parallel.model_parallel, local_tokens(cfg)
    slots = expert_slots(cfg)
    router = tokens * moe.num_experts * 4 * (2 + moe.top_k)
    routed = (slots + moe.top_k * tokens) * m.hidden_size * act
    inner = 4 * (slots * moe.expert_ffn(m.ffn_hidden_size) + tokens * moe.shared_expert_ffn_hidden_size) * act / t
    return router + routed + inner


def _model_layer_activation_bytes(cfg: Config, recompute: str, flash: bool, gathered: bool | None = None) -> float:
    """One layer's kept bytes for one micro batch on one rank, as MindSpore keeps them (layer_activation_bytes with
    the model's dtypes): its S/cp tokens under context parallel, and the keys and values gathered from the other cp
    ranks, which the attention's backward reads. Under sequence parallel the column-parallel inputs are kept
    gathered unless recompute.comm gathers them again in the backward (`gathered` overrides: a fully recomputed
    layer's rematerialised forward keeps them gathered either way; read from dense layers' IR, a mixture of
    experts' counted alike). A mixture of experts: the dense layer without its MLP, plus routed_activation_bytes."""
    m, p = cfg.model, cfg.parallel
    comm = cfg.recompute.comm
    local = layer_activation_bytes(m.seq_length // p.context_parallel, cfg.train.micro_batch_size, m.hidden_size,
                                   m.num_heads, m.kv_heads, 0 if m.moe.enabled else m.ffn_hidden_size,
                                   mlp="swiglu" if m.spec.gated_mlp else "gelu",
                                   t=p.model_parallel, sp=p.sequence_parallel, recompute=recompute, flash=flash,
                                   dtypes=mindspore_dtypes(m.compute_dtype, m.spec.rms_norm), head_dim=m.head_size,
                                   gathered=not comm if gathered is None else gathered, comm=comm)
    local += routed_activation_bytes(cfg, recompute)
    # full recompute rematerialises the gather only if it repeats communication (recompute.comm, MindSpore's
    # mp_comm_recompute); otherwise the gathered K and V are kept like any communication output
    return local + (0.0 if recompute == "full" and comm else gathered_kv_bytes(cfg))


def rematerialised_bytes(cfg: Config, flash: bool) -> float:
    """What a fully recomputed layer adds while its backward runs: its activations, recomputed, with the
    column-parallel inputs gathered (gathered again with recompute.comm; without, the forward's kept all-gather
    outputs are read, already counted in what the layer kept)."""
    remat = _model_layer_activation_bytes(cfg, "none", flash, gathered=True)
    if cfg.recompute.comm or not _layout(cfg).sp:
        return remat
    return remat - 2 * local_tokens(cfg) * cfg.model.hidden_size * DTYPE_BYTES[cfg.model.compute_dtype]


def local_tokens(cfg: Config) -> int:
    """Tokens of one micro batch on one rank: micro_batch_size x seq_length / context_parallel."""
    return cfg.train.micro_batch_size * cfg.model.seq_length // cfg.parallel.context_parallel


def _kv_bytes(cfg: Config, tokens: int) -> float:
    """K and V of `tokens` tokens on one rank (kv heads split over tp), in the compute dtype."""
    m = cfg.model
    return 2 * tokens * m.kv_heads * m.head_size / cfg.parallel.model_parallel * DTYPE_BYTES[m.compute_dtype]


def gathered_kv_bytes(cfg: Config) -> float:
    """colossalai_cp: per layer and micro batch, the K and V of the other cp ranks' tokens, all-gathered for
    the rank's queries and kept for the backward (the all-gather's output is FlashAttentionScoreGrad's
    input). 0 without context parallel and under ulysses_cp, whose all-to-all keeps the bytes it moves."""
    p = cfg.parallel
    if p.context_parallel == 1 or p.context_parallel_algo != "colossalai_cp":
        return 0.0
    return _kv_bytes(cfg, local_tokens(cfg) * (p.context_parallel - 1))


def context_parallel_bytes_per_layer(cfg: Config) -> float:
    """Ring bytes one rank sends per layer and micro batch for context parallel, forward and backward.
    colossalai_cp: K and V all-gathered forward and their gradients reduce-scattered backward, (c-1)/c of the
    whole-sequence tensors each way (again forward when full recompute repeats communication).
    ulysses_cp: q, k, v and the attention output all-to-all forward and back in the backward, (c-1)/c of
    the rank's own [S/c, heads/t] tensors each."""
    m, p = cfg.model, cfg.parallel
    c = p.context_parallel
    if c == 1:
        return 0.0
    share = (c - 1) / c
    if p.context_parallel_algo == "ulysses_cp":
        q_and_out = 2 * local_tokens(cfg) * m.num_heads * m.head_size / p.model_parallel * DTYPE_BYTES[m.compute_dtype]
        return 2 * share * (q_and_out + _kv_bytes(cfg, local_tokens(cfg)))
    passes = 3 if cfg.recompute.mode == "full" and cfg.recompute.comm else 2
    return passes * share * _kv_bytes(cfg, local_tokens(cfg) * c)


def offload_resident_bytes(cfg: Config) -> float:
    """What an offloaded layer keeps on the device per micro batch: its Q, K and V (the rank's heads and tokens),
    which the attention kernel reads through reshapes (Tensor methods, no primitive that Cell.offload marks);
    MindSpore moves every other activation the backward reads (the validate IR of tests/dryrun/test_offload.py)."""
    m, p = cfg.model, cfg.parallel
    queries = local_tokens(cfg) * m.num_heads * m.head_size / p.model_parallel * DTYPE_BYTES[m.compute_dtype]
    return queries + _kv_bytes(cfg, local_tokens(cfg))


def offloaded_layer_bytes(cfg: Config, layout: Layout | None = None) -> float:
    """Bytes one offloaded layer moves to host memory in the forward and back in the backward, per micro batch on
    one rank, as the compiled graph moves them (tests/dryrun/test_offload.py; equal at full size for llama3_405b,
    docs/planner.md): what the layer keeps without recompute (_model_layer_activation_bytes: under sequence
    parallel its column-parallel inputs gathered, or split with recompute.comm), less what stays resident. When
    each layer is its own reused graph (graph_reuse "layer": one micro batch a step) the compute-dtype copies of
    its matmul weights move too, where they differ from the parameter dtype (the casts are ops of the offloaded
    layer; in a reused loss network, graph_reuse "model", they are not moved)."""
    m, layout = cfg.model, layout or _layout(cfg)
    cb = DTYPE_BYTES[m.compute_dtype]
    weights = flops.layer_matmul_params(m) / layout.tp * cb \
        if layout.graph_reuse == "layer" and m.compute_dtype != m.param_dtype else 0.0
    kept = _model_layer_activation_bytes(cfg, "none", layout.attention == "flash")
    return kept - offload_resident_bytes(cfg) + weights


# ----------------------------------------------------------------------------------------------
# Per-rank parameters: every parameter of the model, sliced as the plan and the optimizer shard slice it


@dataclass(frozen=True)
class ParameterSlice:
    name: str
    shape: tuple       # the full parameter
    split: tuple       # parts per dimension (the sharding plan; all 1 when not sharded)
    local: tuple       # this rank's model-parallel slice, before the optimizer shard
    stages: tuple      # the pipeline stages that hold it (a tied embedding: the first and the last)
    trainable: bool
    itemsize: int      # stored (param dtype)
    read_itemsize: int  # as the op that reads it takes it: a MatMul in the compute dtype

    @property
    def replicas(self) -> int:
        """Split parts multiplied out: how many distinct slices exist in one stage."""
        return math.prod(self.split)


# The ops that read their weight in the compute dtype (the layer casts it first, and MindSpore's
# parallel optimizer all-gathers the cast slice): matmuls and embedding lookups; norms read fp32.
READ_IN_COMPUTE_DTYPE = ("matmul", "gather")

_MODELS: dict[str, object] = {}
_TABLES: dict[tuple, tuple] = {}
_STAGE_BYTES: dict[tuple, dict] = {}
_GRADIENT_BYTES: dict[tuple, tuple] = {}
_STAGE_PARAMS: dict[tuple, list] = {}
_LAYER_PARAMS: dict[tuple, int] = {}


def _model_key(cfg: Config) -> str:
    """What the parameters of one decoder layer and of the ends depend on (dataclass reprs: a fifth of the
    search's time went to dataclasses.asdict + json before); not the number of layers."""
    return _per_config("model key", cfg,
                       lambda c: repr((dataclasses.replace(c.model, num_layers=1), c.finetune.lora)))


def _slices_key(cfg: Config, layout: Layout) -> tuple:
    """What parameter_slices depends on."""
    return (_model_key(cfg), cfg.model.num_layers, layout.sharded, layout.tp, layout.ep, layout.vocab_parallel,
            layout.pp, layout.stages_of_layers)


def _stored_key(cfg: Config, layout: Layout, stage: int) -> tuple:
    """What a stage's stored bytes and gradient traffic depend on: not recompute, which the search varies
    most (the tables are asked for every recompute variant of a layout)."""
    return (_slices_key(cfg, layout), layout.dp, layout.cp, layout.optimizer_shard, layout.accumulation_shard,
            layout.accumulates_in_graph, stage)  # cp: the optimizer shards over the stage's dp x cp x tp ranks


def _one_layer_model(cfg: Config, layout: Layout):
    """The model with its first decoder layer only, built without weights. CausalLM builds every decoder
    layer from the same (model config, layout), so layer i's parameters are layer 0's with `layers.0.`
    renamed; building the other layers cost the planner 80% of its time (126 layers of 405B)."""
    import models
    from mindspore.nn.utils import no_init_parameters

    key = _model_key(cfg)
    if key not in _MODELS:  # "none" builds no lazy_inline cells, and the one layer is neither recomputed nor offloaded
        kinds = len(set(_built_layers(cfg.model)))  # a mixture of experts with dense first layers: one of each
        one = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, num_layers=kinds, moe=dataclasses.replace(cfg.model.moe, dense_layers=kinds - 1)))
        with no_init_parameters():
            _MODELS[key] = models.build_model(one, dataclasses.replace(
                layout, graph_reuse="none", sharded=True, cpu_kernels=False, stages_of_layers=(0,) * kinds,
                chunks_of_layers=(0,) * kinds, layers_per_stage=(kinds,), recomputed=(), offloaded=()))
    return _MODELS[key]


def _built_layers(m) -> list[int]:
    """Per layer of the model, the layer of _one_layer_model whose parameters it has: 0, or (dense first layers,
    DeepSeek-V3) 0 for the dense layers and 1 for the layers with experts."""
    dense = m.moe.dense_layers if m.spec.moe else 0
    return [0 if i < dense or not dense else 1 for i in range(m.num_layers)]


def _every_layer(names: list[str], built: list[int]) -> list[tuple[str, str]]:
    """(name in the model, name in the one-layer model) of every parameter, in the model's order: the
    embeddings, the layers (layer i as the built layer built[i]), the final norm and head."""
    layer = [i for i, n in enumerate(names) if n.startswith("layers.")]
    before, after = names[:layer[0]], names[layer[-1] + 1:]
    own = {b: [n for n in names if n.startswith(f"layers.{b}.")] for b in set(built)}
    return ([(n, n) for n in before] +
            [(f"layers.{i}.{n[len(f'layers.{b}.'):]}", n) for i, b in enumerate(built) for n in own[b]] +
            [(n, n) for n in after])


def parameter_slices(cfg: Config, layout: Layout | None = None) -> tuple[ParameterSlice, ...]:
    """Every parameter of the model (as the trainer builds it, without weights) with the plan's split of it
    for `layout`. Cached: the search re-plans many layouts of one model."""
    from models.sharding import parameter_splits

    layout = layout or _layout(cfg)
    key = _slices_key(cfg, layout)
    if key in _TABLES:
        return _TABLES[key]
    model = _one_layer_model(cfg, layout)
    splits = parameter_splits(model, cfg, layout)
    # a tied output head on the last stage reads the embedding: MindSpore keeps a copy of it there
    tied_copy = (layout.pp - 1,) if cfg.model.tie_embeddings and layout.pp > 1 else ()
    pb, cb = DTYPE_BYTES[cfg.model.param_dtype], DTYPE_BYTES[cfg.model.compute_dtype]
    params = {p.name: p for p in model.get_parameters()}
    table = []
    for name, built in _every_layer(list(params), _built_layers(cfg.model)):
        p, (split, reader) = params[built], splits[built]
        stages = (layout.stage_of(name),) + (tied_copy if name == "tok_embeddings.weight" else ())
        table.append(ParameterSlice(name, tuple(p.shape), split, tuple(d // s for d, s in zip(p.shape, split)),
                                    stages, p.requires_grad, pb, cb if reader.startswith(READ_IN_COMPUTE_DTYPE) else pb))
    _TABLES[key] = tuple(table)
    return _TABLES[key]


def optimizer_shard(p: ParameterSlice, layout: Layout) -> int:
    """Into how many parts MindSpore's parallel optimizer cuts this parameter's first dimension: all the
    ranks of the stage that hold the same slice, for parameters (frozen ones too, as compiled) of at
    least OPTIMIZER_SHARD_MIN_KIB in full whose first dimension divides (else 1: kept whole)."""
    ranks = layout.stage_devices // p.replicas
    full_bytes = math.prod(p.shape) * p.itemsize
    if not (layout.optimizer_shard and ranks > 1 and full_bytes >= OPTIMIZER_SHARD_MIN_KIB * 1024):
        return 1
    return ranks if p.local and p.local[0] % ranks == 0 else 1


def stored_shapes(cfg: Config, stage: int, layout: Layout | None = None) -> dict[str, tuple]:
    """The shape of every parameter one rank of `stage` stores, by the name MindSpore gives it: the
    weights, AdamW's moments (adam_m.*, adam_v.*) and, when the graph accumulates micro batches, the
    gradient buffers (accu_grads.*: the model-parallel slice, or with parallel.gradient_accumulation_shard
    the optimizer's shard of it). tools/dryrun.py compares these with the compiled shapes, name by name."""
    layout = layout or _layout(cfg)
    shapes = {}
    for p in parameter_slices(cfg, layout):
        if stage not in p.stages:
            continue
        shard = optimizer_shard(p, layout)
        stored = (p.local[0] // shard, *p.local[1:]) if p.local else p.local
        shapes[p.name] = stored
        if p.trainable:
            shapes[f"adam_m.{p.name}"] = shapes[f"adam_v.{p.name}"] = stored
            if layout.accumulates_in_graph:
                shapes[f"accu_grads.{p.name}"] = stored if layout.accumulation_shard else p.local
    return shapes


def stage_bytes(cfg: Config, stage: int, layout: Layout | None = None) -> dict:
    """Bytes one rank of `stage` holds: weights (every slice it stores), grads (the accumulation buffers
    when the graph keeps them, else one gradient per trained parameter as the optimizer receives it)
    and optimizer (AdamW's two moments); the same three figures tools/dryrun.py reads from the
    compiled graph, and equal to them (tests/dryrun/test_dryrun.py)."""
    layout = layout or _layout(cfg)
    key = _stored_key(cfg, layout, stage)
    if key in _STAGE_BYTES:
        return dict(_STAGE_BYTES[key])
    itemsize = DTYPE_BYTES[cfg.model.param_dtype]
    size = {name: math.prod(shape) * (MOMENT_BYTES if name.startswith("adam_") else itemsize)
            for name, shape in stored_shapes(cfg, stage, layout).items()}
    trained = {p.name for p in parameter_slices(cfg, layout) if p.trainable}
    kind = {"adam_m": "optimizer", "adam_v": "optimizer", "accu_grads": "grads"}
    out = {"weights": 0, "grads": 0, "optimizer": 0}
    for name, n in size.items():
        prefix = name.split(".", 1)[0]
        out[kind.get(prefix, "weights")] += n
        if prefix not in kind and name in trained and not layout.accumulates_in_graph:
            out["grads"] += n
    _STAGE_BYTES[key] = out
    return dict(out)


def stage_params(cfg: Config, layout: Layout | None = None) -> list[float]:
    """Parameters of one rank's model-parallel slices in each pipeline stage (before the optimizer shard)."""
    layout = layout or _layout(cfg)
    key = _slices_key(cfg, layout)
    if key not in _STAGE_PARAMS:
        out = [0] * layout.pp
        for p in parameter_slices(cfg, layout):
            for stage in p.stages:
                out[stage] += math.prod(p.local)
        _STAGE_PARAMS[key] = out
    return list(_STAGE_PARAMS[key])


def layer_slice_params(cfg: Config, layout: Layout) -> int:
    """Parameters of the largest decoder layer's slices on a rank (its experts split over ep, the rest over tp;
    the last layer: a mixture of experts' layers with experts follow its dense ones)."""
    key = _slices_key(cfg, layout)
    if key not in _LAYER_PARAMS:
        last = f"layers.{cfg.model.num_layers - 1}."
        _LAYER_PARAMS[key] = sum(math.prod(p.local) for p in parameter_slices(cfg, layout)
                                 if p.name.startswith(last))
    return _LAYER_PARAMS[key]


def in_flight_forwards(pp: int, interleave: int, micro_batches: int, stage: int) -> int:
    """Chunk forwards (one model chunk, one micro batch) whose activations `stage` holds at its peak.

    Without interleave, 1F1B: min(p - k, m) micro batches of the whole stage. Interleaved 1F1B
    (Narayanan et al. 2021, §2.2.2; Megatron-LM's forward_backward_pipelining_with_interleaving): stage
    k runs 2(p - k - 1) + (v - 1)p warm-up chunk forwards, then one more before its first backward,
    so it holds min(2(p - k - 1) + (v - 1)p + 1, v·m) of them; the first stage v·p + p - 1, i.e.
    p·(1 + (p - 1)/(p·v)) micro batches' worth of its layers when chunks are even (Korthikanti et al.
    2022, §4.2.3)."""
    if interleave == 1:
        return min(pp - stage, micro_batches) if pp > 1 else 1
    return min(2 * (pp - stage - 1) + (interleave - 1) * pp + 1, interleave * micro_batches)


def chunk_forwards(pp: int, interleave: int, forwards: int) -> list[int]:
    """How many of a stage's first `forwards` forwards run each model chunk under interleaved 1F1B: groups of p
    micro batches run chunk 0, then chunk 1, ... (Megatron's get_model_chunk_id: the k-th forward, from 0, runs
    chunk k // p mod v), so every round of p x v forwards runs each chunk p times, a last partial round its
    first chunks."""
    rounds, rest = divmod(forwards, pp * interleave)
    return [rounds * pp + min(pp, max(0, rest - c * pp)) for c in range(interleave)]


def _in_flight_bytes(layout: Layout, stage: int, per_layer: list[float]) -> float:
    """Bytes the stage holds at its peak when its i-th layer (in order, chunk 0 first) keeps per_layer[i] per
    micro batch: each chunk forward in flight (in_flight_forwards) holds its chunk's layers."""
    chunks = [0.0] * layout.interleave
    for i, layer in enumerate(layout.layers_of_stage(stage)):
        chunks[layout.chunks_of_layers[layer]] += per_layer[i]
    in_flight = in_flight_forwards(layout.pp, layout.interleave, layout.micro_steps, stage)
    forwards = chunk_forwards(layout.pp, layout.interleave, in_flight)
    return sum(held * times for held, times in zip(chunks, forwards))


def _stage_layer_roles(layout: Layout, stage: int, recomputed: int | None, offloaded: int | None) -> list[str]:
    """Per layer of `stage` in order: recomputed (the first r), offloaded (the next o), or kept; r and o default
    to the layout's (Layout.recomputed, Layout.offloaded), the search overrides them."""
    r = layout.recomputed_in(stage) if recomputed is None else recomputed
    o = layout.offloaded_in(stage) if offloaded is None else offloaded
    n = layout.layers_per_stage[stage]
    return ["recomputed"] * min(r, n) + ["offloaded"] * min(o, n - min(r, n)) + ["kept"] * max(0, n - r - o)


def stage_host_bytes(cfg: Config, stage: int, offloaded: int | None = None) -> float:
    """Host memory one rank of `stage` fills at its peak with offloaded activations: every chunk forward in flight
    holds its offloaded layers' moved bytes there (offload.layers; 0 without)."""
    layout = _layout(cfg)
    roles = _stage_layer_roles(layout, stage, None, offloaded)
    if "offloaded" not in roles:
        return 0.0
    moved = offloaded_layer_bytes(cfg, layout)
    return _in_flight_bytes(layout, stage, [moved if role == "offloaded" else 0.0 for role in roles])


def stage_memory(cfg: Config, stage: int, recomputed: int | None = None, offloaded: int | None = None) -> dict:
    """Memory breakdown (bytes) of one device of pipeline stage `stage`.

    weights, grads, optimizer: what the rank stores (stage_bytes, exact). transient: what lives only
    during the step, estimated: the compute-dtype copy of the weights (and, with the optimizer shard,
    their all-gathered slices), and one layer's gradients before they are reduce-scattered.
    `recomputed` and `offloaded` override the numbers of recomputed and offloaded layers of this stage (used
    by the search). An offloaded layer keeps only offload_resident_bytes on the device; while any layer
    offloads, two layers' moved bytes are on the device on their way (one leaving in a forward, one
    prefetched for a backward)."""
    m, hw = cfg.model, cfg.hardware
    layout = _layout(cfg)
    stored = stage_bytes(cfg, stage, layout)
    pb, cb = DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[m.compute_dtype]
    params = stage_params(cfg, layout)[stage]
    largest_layer = layer_slice_params(cfg, layout)
    transient = (params * cb if (cb != pb or layout.optimizer_shard) else 0) + \
        (largest_layer * pb if layout.optimizer_shard else 0)

    roles = _stage_layer_roles(layout, stage, recomputed, offloaded)
    flash = layout.attention == "flash"
    # per config: a search's bisections ask them of one config for each number of recomputed or offloaded layers
    kept = _per_config("kept", cfg, lambda c: _model_layer_activation_bytes(c, "none", flash))
    resident = {"kept": kept, "offloaded": offload_resident_bytes(cfg) if "offloaded" in roles else 0.0,
                "recomputed": _per_config("recomputed", cfg, lambda c: _model_layer_activation_bytes(
                    c, layout.recompute, flash)) if "recomputed" in roles else 0.0}
    activations = _in_flight_bytes(layout, stage, [resident[role] for role in roles])
    if "recomputed" in roles and layout.recompute == "full":
        activations += rematerialised_bytes(cfg, flash)  # one layer at a time during backward
    if "offloaded" in roles:
        activations += 2 * offloaded_layer_bytes(cfg, layout)  # one layer's on its way out, one's prefetched back
    if stage == layout.pp - 1:
        sb = local_tokens(cfg)
        t = layout.tp
        activations += sb * m.hidden_size * 4 / (t if layout.sp else 1)    # final norm input
        # the logits in the compute dtype (Layout.logit_split: whole on each rank of a tp group unless split),
        # and the loss's fp32 work, split over t
        logit_parts = math.prod(layout.logit_split) // layout.token_rows
        activations += sb * m.vocab_size * (cb / logit_parts + 8 / t)
    reserve = (hw.memory_gib - hw.memory_pool_gib) * GIB  # outside MindSpore's pool: runtime, HCCL buffers
    parts = {**stored, "transient": transient, "activations": activations, "reserve": reserve}
    parts["total"] = sum(parts.values())
    return parts


def memory_budget_gib(cfg: Config) -> float:
    """What a plan may fill: memory_margin of MindSpore's memory pool (hardware.memory_pool_gib, the ceiling
    the runtime sets), plus what is left outside the pool."""
    hw = cfg.hardware
    return hw.memory_gib - hw.memory_pool_gib + hw.memory_pool_gib * hw.memory_margin


# ----------------------------------------------------------------------------------------------
# Communication and time


def _bandwidth(cfg: Config, span: int) -> float:
    """Bytes/s of a group whose ranks span `span` consecutive devices."""
    hw = cfg.hardware
    gbps = hw.intra_node_gbps if span <= hw.devices_per_node else hw.inter_node_gbps
    return gbps * 1e9


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
        # the tied head's copy gathers the stored-dtype slice it received (tied_embedding_exchange_bytes)
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
    m, layout = cfg.model, _layout(cfg)
    t, stages, micro_batches = layout.tp, layout.pp, layout.micro_steps
    hidden = local_tokens(cfg) * m.hidden_size      # elements of one micro batch's hidden states on the rank
    x = hidden * DTYPE_BYTES[m.compute_dtype]                               # as a layer's matmuls take them
    # Per layer and micro batch, averaged over the stage's layers (tp_all_reduces: what each role adds)
    roles = _stage_layer_roles(layout, stage, None, None)
    all_reduces = sum(tp_all_reduces(cfg, role) for role in roles) / max(1, len(roles))
    tp_per_layer = all_reduces * 2 * (t - 1) / t * x if t > 1 else 0.0
    # The vocabulary-split lookup (first stage) and head (last stage), per micro batch: Megatron's
    # all-reduce one way (the lookup's forward, the head input's backward), or under sequence parallel a
    # reduce-scatter and an all-gather: 2(t-1)/t of the hidden states either way.
    vocab_ends = (stage == 0) + (stage == stages - 1) if layout.vocab_parallel else 0
    tp_vocab = vocab_ends * micro_batches * 2 * (t - 1) / t * x if t > 1 else 0.0
    # the stage's layers with experts (a mixture of experts' dense first layers have none: DeepSeek-V3)
    experts = [i >= m.moe.dense_layers for i in sorted(layout.layers_of_stage(stage))] if m.moe.enabled else []
    if any(experts) and t > 1:  # the experts' w2 partial sums (and w1/w3 input gradients): E x C slots, not T
        tp_per_layer += 2 * 2 * (t - 1) / t * (expert_slots(cfg) - local_tokens(cfg)) * m.hidden_size * \
            DTYPE_BYTES[m.compute_dtype] * sum(experts) / len(experts)
    tp = tp_per_layer * layout.layers_per_stage[stage] * micro_batches + tp_vocab
    ep_per_layer = sum(expert_alltoall_bytes(cfg, role) for role, routed in zip(roles, experts) if routed) / \
        max(1, len(roles))
    ep = ep_per_layer * layout.layers_per_stage[stage] * micro_batches
    cp_per_layer = context_parallel_bytes_per_layer(cfg)
    cp = cp_per_layer * layout.layers_per_stage[stage] * micro_batches
    dp_once, dp_micro = gradient_reduce_bytes(cfg, stage)
    dp = dp_once + dp_micro * micro_batches
    sends = pipeline_sends(stages, layout.interleave, stage)                # activations out, grads back
    stream = hidden * DTYPE_BYTES[m.residual_dtype]                         # what a stage sends: the residual stream
    tied = tied_embedding_exchange_bytes(cfg, stage)
    pp = (sends * micro_batches * stream / (t if layout.sp else 1) if stages > 1 else 0.0) + tied
    return {"dp_grad_reduce": dp, "dp_per_micro_batch": dp_micro, "tp_per_layer": tp_per_layer,
            "tp_vocab": tp_vocab, "tp": tp, "cp_per_layer": cp_per_layer, "cp": cp, "ep_per_layer": ep_per_layer,
            "ep": ep, "pp_send_recv": pp, "pp_sends_per_micro_batch": sends if stages > 1 else 0,
            "pp_tied_embedding": tied, "total": dp + tp + cp + ep + pp}


def tied_embedding_exchange_bytes(cfg: Config, stage: int) -> float:
    """Bytes a rank of the first or last stage sends once per step for a tied output head under a pipeline.
    MindSpore's pipeline pass shares the embedding between the two stages by sending it, not by Megatron's
    all-reduce of the two copies' gradients: the first stage sends its stored slice of the weight (the
    optimizer shard's, in the stored dtype) to the last, which all-gathers it in that dtype, computes the
    head's gradient, reduce-scatters it and sends its slice back (validate IR of llama3_2_3b's last stage:
    Receive of tok_embeddings.weight [32064, 3072] fp32, AllGather fp32, ReduceScatter, Send fp32 back to
    rank 0). 0 on the other stages and without a pipeline or a tied head."""
    layout = _layout(cfg)
    if not (cfg.model.tie_embeddings and layout.pp > 1 and stage in (0, layout.pp - 1)):
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
    m, ep = cfg.model, cfg.parallel.expert_parallel
    if ep == 1:
        return 0.0
    passes = 6 if role == "recomputed" and _layout(cfg).recompute == "full" else 4
    return passes * (ep - 1) / ep * expert_slots(cfg) * m.hidden_size * DTYPE_BYTES[m.compute_dtype]


def tp_all_reduces(cfg: Config, role: str) -> float:
    """Tensor-parallel traffic of one layer of `role` (_stage_layer_roles) per micro batch, in all-reduces of its
    hidden states (2(t-1)/t of them each; an all-gather or a reduce-scatter is half of one): 4, Megatron's two
    forward and two backward (all-gather + reduce-scatter pairs under sequence parallel); with recompute.comm, what
    MindSpore gathers or reduces again in the backward (validate IR, docs/planner.md): a fully recomputed layer
    repeats the forward collectives its backward reads, the attention's all-reduce (1), or under sequence
    parallel both all-gathers and the attention's reduce-scatter (1.5; the MLP's reduce-scatter feeds only the
    layer output); any other layer all-gathers its two column-parallel inputs again under sequence parallel (1)."""
    layout = _layout(cfg)
    if not cfg.recompute.comm:
        return 4.0
    if role == "recomputed" and layout.recompute == "full":
        return 4 + (1.5 if layout.sp else 1.0)
    return 4 + (1.0 if layout.sp else 0.0)


def pipeline_sends(pp: int, interleave: int, stage: int) -> int:
    """Stage-boundary sends of one stage per micro batch (activations forward, gradients back). Each of
    its v chunks sends its output to the next stage and its input gradient to the previous one, except
    the model's first chunk (stage 0, chunk 0: nothing to send back) and its last (stage p-1, chunk v-1:
    the loss): 2v - [k = 0] - [k = p-1]; v = 1 gives 1 at the ends, 2 in the middle."""
    return 2 * interleave - (stage == 0) - (stage == pp - 1)


def _stage_flops_per_token(cfg: Config, stage: int) -> float:
    """Hardware FLOPs per token of one stage (whole tensor-parallel group)."""
    m, layout = cfg.model, _layout(cfg)
    output = 6 * flops.output_params(m)
    per_layer = (flops.model_flops_per_token(m) - output) / m.num_layers
    extra = flops.recompute_flops_per_token(m, layout.recompute, layout.recomputed_in(stage))
    per_layer += flops.routing_flops_per_token(m, local_tokens(cfg))
    return layout.layers_per_stage[stage] * per_layer + extra + (output if stage == layout.pp - 1 else 0)


def predict(cfg: Config, peak_tflops: float, efficiency: float) -> dict:
    m, layout = cfg.model, _layout(cfg)
    d, t, cp, stages, micro_steps = layout.dp, layout.tp, layout.cp, layout.pp, layout.micro_steps
    tokens_per_micro_batch = local_tokens(cfg)  # on one rank: its sequence chunk under context parallel
    flop_rate = peak_tflops * 1e12 * efficiency
    # a cp group's ranks are t apart, a data-parallel group's t x cp, a pipeline's t x cp x d
    tp_bw, cp_bw = _bandwidth(cfg, t), _bandwidth(cfg, t * cp)
    ep_bw = _bandwidth(cfg, t * cp * layout.ep)  # an expert-parallel group: ep of the data-parallel ranks
    dp_bw, pp_bw = _bandwidth(cfg, t * cp * d), _bandwidth(cfg, t * cp * d * stages)
    slots, comm, copies = [], [], []
    for k in range(stages):
        c = communication(cfg, k)
        compute = tokens_per_micro_batch * _stage_flops_per_token(cfg, k) / t / flop_rate
        slots.append(compute + (c["tp_per_layer"] * layout.layers_per_stage[k] + c["tp_vocab"] / micro_steps) / tp_bw
                     + c["cp_per_layer"] * layout.layers_per_stage[k] / cp_bw
                     + c["ep_per_layer"] * layout.layers_per_stage[k] / ep_bw)
        copies.append(offload_copy_s(cfg, k))
        comm.append(c)
    slot = max(busy + offload_exposed_s(copy, busy) for busy, copy in zip(slots, copies))
    # 1F1B over a pipeline's micro batches; accumulation steps run one after another. Interleaved 1F1B:
    # the warm-up and cool-down run chunks of 1/v of a stage, so the bubble is (p-1)/v slots
    v = layout.interleave
    pipeline = (micro_steps + (stages - 1) / v) * slot
    pp_time = max(c["pp_send_recv"] for c in comm) / pp_bw
    # the once-per-step part overlaps the last micro batch's backward; a per-micro-batch reduce-scatter
    # (gradient_accumulation_shard) overlaps its own micro batch's
    per_micro = max(c["dp_per_micro_batch"] for c in comm) / dp_bw
    once = max(c["dp_grad_reduce"] - c["dp_per_micro_batch"] * micro_steps for c in comm) / dp_bw
    dp_exposed = max(0.0, once - 2 / 3 * slot) + micro_steps * max(0.0, per_micro - 2 / 3 * slot)
    step = pipeline + pp_time + dp_exposed
    tokens_per_s = cfg.global_batch_size * m.seq_length / step
    devices = cfg.devices
    recomputed = len(layout.recomputed)
    return {
        "step_time_s": step, "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / devices,
        "samples_per_s_per_device": cfg.global_batch_size / step / devices,
        "tflops_per_device": tokens_per_s * flops.model_flops_per_token(m) / devices / 1e12,
        "mfu": flops.mfu(tokens_per_s, devices, peak_tflops, m),
        "hfu": flops.hfu(tokens_per_s, devices, peak_tflops, m, layout.recompute, recomputed),
        "bubble_fraction": bubble_fraction(stages, v, micro_steps),
        "pipeline_interleave": v,
        "compute_s": micro_steps * slot,
        "comm_exposed_s": pp_time + dp_exposed,
        "offload_copy_s": max(copies),
        "offload_exposed_s": (micro_steps + (stages - 1) / v) * (slot - max(slots)),
        "peak_tflops": peak_tflops, "efficiency": efficiency,
        "assumptions": [
            f"hardware FLOPs run at {efficiency:.0%} of the {peak_tflops:g} TFLOP/s peak",
            "tensor-parallel collectives are on the critical path (not overlapped)",
            *([f"mixture of experts: the experts' padding slots (capacity beyond the top_k per token) run at the same "
               f"rate ({flops.routing_flops_per_token(m, tokens_per_micro_batch) / 1e9:.3g} GFLOP per token and "
               "layer beyond the model FLOPs); the dispatch and combine gathers are not timed"] if m.moe.enabled
              else []),
            *([f"expert parallel (ep={layout.ep}): its AlltoAlls are on the critical path (not overlapped); experts "
               "are assumed evenly loaded (the capacity bounds the slowest)"] if layout.ep > 1 else []),
            *([f"context parallel ({layout.cp_algo}, c={cp}): its K/V all-gathers or all-to-alls are on the "
               "critical path (not overlapped), and the causal work is balanced over the cp ranks (it is not: "
               "without head-tail chunks the last chunk's queries see the most keys; flash skips the masked "
               "blocks, so its rank is the slowest)"] if cp > 1 else []),
            f"1F1B pipeline: {micro_steps + stages - 1} micro-batch slots of the busiest stage per step "
            f"(bubble (p-1)/m = {(stages - 1) / micro_steps:.1%})" if stages > 1 and v == 1 else
            f"interleaved 1F1B pipeline (Narayanan et al. 2021), v={v} chunks per stage: {micro_steps} + "
            f"{stages - 1}/{v} micro-batch slots of the busiest stage per step (bubble (p-1)/(v·m) = "
            f"{bubble_fraction(stages, v, micro_steps):.1%}); assumed: MindSpore's {layout.scheduler} scheduler "
            "orders chunks as Megatron-LM does and keeps each stage's work balanced per chunk (a dry run "
            "compiles the chunk placement, never the timing)" if stages > 1 else "no pipeline bubble",
            *([f"pipeline sends: {pipeline_sends(stages, v, 1 if stages > 2 else 0)} per micro batch on a middle "
               "stage (2v), counted in full on the critical path (not overlapped with compute)"] if v > 1 else []),
            *([f"activation offload ({sum(layout.offloaded_in(k) for k in range(stages))} layers): each crosses "
               f"the host link ({cfg.hardware.host_link_gbps:g} GB/s each way, full duplex) out in its micro batch's "
               "forward and back in its backward; copies run on their own stream and overlap the slot's forward "
               "third (out) and backward two thirds (in) without slowing compute; what does not overlap is exposed "
               f"({max(copies):.3g} s each way per micro batch on the busiest stage)"] if layout.offloaded else []),
            "data-parallel gradient reduction overlaps the last micro batch's backward (2/3 of its compute), "
            "a per-micro-batch reduce-scatter its own micro batch's; the rest is exposed",
            "bandwidths: hardware profile, intra-node for groups within devices_per_node, else inter-node",
            "optimizer update, data loading and host overhead are not counted",
        ],
    }


def offload_copy_s(cfg: Config, stage: int) -> float:
    """Seconds one rank of `stage` spends copying one micro batch's offloaded activations over the host link, each
    way (out in the forward, back in the backward: full duplex, so the two directions do not add)."""
    layout = _layout(cfg)
    n = layout.offloaded_in(stage)
    if not n:
        return 0.0
    return n * offloaded_layer_bytes(cfg, layout) / (cfg.hardware.host_link_gbps * 1e9)


def offload_exposed_s(copy_s: float, slot_s: float) -> float:
    """What offload copies add to a micro-batch slot of `slot_s` seconds: the copy out overlaps the slot's forward
    (a third), the copy back its backward (two thirds); the rest waits."""
    return max(0.0, copy_s - slot_s / 3) + max(0.0, copy_s - 2 * slot_s / 3)


def bubble_fraction(pp: int, interleave: int, micro_batches: int) -> float:
    """Idle share of the ideal step: (p-1)/m for 1F1B, (p-1)/(v·m) interleaved (Narayanan et al. 2021, §2.2)."""
    return (pp - 1) / (interleave * micro_batches)


def plan(cfg: Config, peak_tflops: float | None = None, efficiency: float | None = None) -> dict:
    """The plan of `cfg` (tools/plan.py --json, docs/planner.md): params, FLOPs, worst-stage memory, fits, comm bytes, prediction."""
    peak = peak_tflops if peak_tflops is not None else device_peak_tflops(cfg)
    eff = efficiency if efficiency is not None else DEFAULT_EFFICIENCY[cfg.hardware.device_target]
    layout = _layout(cfg)
    recomputed = [layout.recomputed_in(k) for k in range(layout.pp)]
    stages = [stage_memory(cfg, k) for k in range(layout.pp)]
    worst = max(range(len(stages)), key=lambda k: stages[k]["total"])
    comm = communication(cfg, worst)
    budget = memory_budget_gib(cfg)
    total_gib = stages[worst]["total"] / GIB
    host = offload_plan(cfg)
    return {
        "config": cfg.run.name,
        "hardware": cfg.hardware.name,
        "devices": cfg.devices,
        "layout": {"data_parallel": cfg.parallel.data_parallel, "model_parallel": cfg.parallel.model_parallel,
                   "expert_parallel": cfg.parallel.expert_parallel, "experts": cfg.model.moe.num_experts,
                   "context_parallel": cfg.parallel.context_parallel,
                   "context_parallel_algo": cfg.parallel.context_parallel_algo,
                   "pipeline_stage": cfg.parallel.pipeline_stage, "micro_batch_num": cfg.parallel.micro_batch_num,
                   "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.global_batch_size,
                   "gradient_accumulation_steps": cfg.parallel.gradient_accumulation_steps,
                   "sequence_parallel": cfg.parallel.sequence_parallel,
                   "optimizer_shard": cfg.parallel.optimizer_shard,
                   "gradient_accumulation_shard": cfg.parallel.gradient_accumulation_shard,
                   "recompute": cfg.recompute.mode,
                   "recompute_layers": recomputed, "recompute_comm": cfg.recompute.comm,
                   "layers_per_stage": list(layout.layers_per_stage),
                   "offload_layers": [layout.offloaded_in(k) for k in range(layout.pp)],
                   "pipeline_interleave": layout.interleave, "pipeline_scheduler": layout.scheduler,
                   "attention": layout.attention},
        "params": flops.param_count(cfg.model),
        "matmul_params": flops.matmul_param_count(cfg.model),
        "flops_per_token": flops.model_flops_per_token(cfg.model),
        "hflops_per_token": flops.hardware_flops_per_token(cfg.model, layout.recompute, len(layout.recomputed)),
        "memory_gib": {k: v / GIB for k, v in stages[worst].items()},
        "memory_stage": worst,
        "memory_gib_per_stage": [s["total"] / GIB for s in stages],
        "in_flight_forwards_per_stage": [in_flight_forwards(layout.pp, layout.interleave, layout.micro_steps, k)
                                         for k in range(layout.pp)],
        "device_memory_gib": cfg.hardware.memory_gib,
        "memory_pool_gib": cfg.hardware.memory_pool_gib,
        "memory_budget_gib": budget,
        "fits": total_gib <= budget and host["fits"],
        "offload": host,
        "comm_bytes_per_step": comm,
        "predicted": predict(cfg, peak, eff),
    }


def offload_plan(cfg: Config) -> dict:
    """Activation offload (offload.layers) of `cfg`: layers per stage, the bytes one layer moves per micro batch
    and what it keeps on the device, host memory per stage against hardware.host_memory_gib, traffic per step
    each way on the busiest stage and its copy time per micro batch (predict counts what is exposed)."""
    layout, hw = _layout(cfg), cfg.hardware
    per_stage = [layout.offloaded_in(k) for k in range(layout.pp)]
    if not layout.offloaded:
        return {"layers_per_stage": per_stage, "fits": True}
    host = [stage_host_bytes(cfg, k) / GIB for k in range(layout.pp)]
    moved = offloaded_layer_bytes(cfg, layout)
    return {"layers_per_stage": per_stage, "backward_prefetch": layout.offload_prefetch,
            "bytes_per_layer": moved, "resident_bytes_per_layer": offload_resident_bytes(cfg),
            "host_gib_per_stage": host, "host_memory_gib": hw.host_memory_gib, "host_link_gbps": hw.host_link_gbps,
            "bytes_per_step": max(per_stage) * moved * layout.micro_steps,
            "copy_s_per_micro_batch": max(offload_copy_s(cfg, k) for k in range(layout.pp)),
            "fits": max(host) <= hw.host_memory_gib}


# ----------------------------------------------------------------------------------------------
# Re-planning and search


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with `--set`-style overrides applied and re-validated (raises ConfigError)."""
    tree = _copied(_per_config("tree", cfg, Config.to_dict))
    for assignment in overrides:
        apply_override(tree, assignment)
    return config_from_tree(tree)


def _copied(node):
    """A config tree's copy, new containers throughout (nothing shared between the configs made from it). A
    search makes thousands of configs from a few: dataclasses.asdict, which deep-copies every leaf, was a fifth
    of its time."""
    if isinstance(node, dict):
        return {key: _copied(value) for key, value in node.items()}
    return [_copied(value) for value in node] if isinstance(node, list) else node


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
    """Same model/context/pipeline parallel and global batch on `devices` cards: data_parallel changes."""
    p = cfg.parallel
    dp = p.data_parallel_for(devices)
    if dp is None:
        raise PlanError(f"--devices {devices} is not a multiple of model_parallel x context_parallel x pipeline_stage "
                        f"= {p.model_parallel} x {p.context_parallel} x {p.pipeline_stage} = {p.replica_devices}; "
                        "pick a multiple or change them with --set")
    batch = _batch_overrides(cfg, dp, p.pipeline_stage, cfg.train.micro_batch_size)
    if batch is None:
        raise PlanError(f"global batch {cfg.global_batch_size} cannot be split over data_parallel={dp} x "
                        f"micro_batch_size={cfg.train.micro_batch_size} (x >= {p.pipeline_stage} micro batches); "
                        "set train.global_batch_size or train.micro_batch_size with --set")
    try:
        sharded = p.optimizer_shard and dp > 1
        micro = any(o.split("=")[1] != "1" for o in batch)  # micro_batch_num or accumulation steps > 1
        return with_overrides(cfg, [f"parallel.data_parallel={dp}", *batch,
                                    f"parallel.optimizer_shard={str(sharded).lower()}",
                                    f"parallel.gradient_accumulation_shard="
                                    f"{str(sharded and micro and p.gradient_accumulation_shard).lower()}",
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


def interleaved_offset(layers: int, stages: int, interleave: int) -> list | int:
    """stage_offset for v chunks per stage: the stage totals of `balanced_offset`, each split over its
    chunks as evenly as it goes, the extra layers in its later chunks (stage 0 holds its chunk 0 for
    2p - 1 of its v·p + p - 1 forwards in flight, the others p times: the lighter chunk 0, the less
    memory). Per stage (an int or p ints) when v divides every stage's layers, else per chunk (v lists
    of p ints on top of layers // (p·v))."""
    offset = balanced_offset(layers, stages)
    if interleave == 1:
        return offset
    per_stage = [layers // stages + o for o in ([offset] * stages if isinstance(offset, int) else offset)]
    if all(n % interleave == 0 for n in per_stage):
        return offset
    base = layers // (stages * interleave)
    return [[n // interleave + (chunk >= interleave - n % interleave) - base for n in per_stage]
            for chunk in range(interleave)]


def interleave_choices(layers: int, stages: int, micro_batches: int, largest: int = 8) -> list[int]:
    """Chunks per stage the search tries: 1, and with a pipeline every v <= `largest` that leaves each
    chunk a layer (p·v <= layers) where the micro batches come in groups of p (Megatron-LM's interleaved
    schedule needs m to be a multiple of p; Narayanan et al. 2021, §2.2.2)."""
    if stages == 1 or micro_batches % stages:
        return [1]
    return [v for v in range(1, largest + 1) if stages * v <= layers]


def _fewest_layers_that_fit(cfg: Config, role: str) -> list[int] | None:
    """Fewest layers per stage that make every stage fit when they are `role` ("recomputed" in cfg's recompute
    mode, or "offloaded"), or None if even all of a stage's layers do not."""
    budget = memory_budget_gib(cfg) * GIB
    out = []
    for k, n in enumerate(_layout(cfg).layers_per_stage):
        fits = lambda r: stage_memory(cfg, k, **{role: r})["total"] <= budget  # noqa: E731
        if fits(0):
            out.append(0)
            continue
        if not fits(n):
            return None
        low, high = 1, n   # from one such layer on, memory falls with each more: bisect
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(mid) else (mid + 1, high)
        out.append(low)
    return out


def _memory_candidates(base: Config, shard: list[str]) -> list[list[str]]:
    """The ways the search tries to fit `base` (no recompute, no offload) with `shard` (the accumulation-buffer
    setting, recompute.comm): as it is, selective recompute, the fewest fully recomputed layers per stage that fit,
    and offload (`_offload_candidate`)."""
    try:
        fitted = with_overrides(base, shard) if shard else base
    except ConfigError:  # e.g. an accumulation shard the layout cannot take
        return []
    out = [shard, shard + ["recompute.mode=selective"]]
    full = _fewest_layers_that_fit(with_overrides(fitted, ["recompute.mode=full"]), "recomputed")
    if full is not None and any(full):
        out.append(shard + ["recompute.mode=full", f"recompute.layers={_yaml(full)}"])
    if full is not None:
        # an offloaded layer keeps more on the device (Q, K, V) than a recomputed one (its input): where recomputing
        # every layer does not fit, offloading cannot ...
        offload = _offload_candidate(fitted, max(full))
    else:
        # ... unless a recomputed layer keeps its communication outputs (tensor parallel without recompute.comm),
        # which outweigh Q, K and V: then offload alone may fit
        offload = _offload_candidate(fitted, None) if _layout(fitted).tp > 1 and not fitted.recompute.comm else None
    if offload:
        out.append(shard + offload)
    return out


def _fits_as_is(base: Config, overrides: list[str]) -> bool:
    """Whether every stage of `base` with `overrides` fits without recompute or offload (False if they do not
    validate)."""
    try:
        cfg = with_overrides(base, overrides) if overrides else base
    except ConfigError:
        return False
    budget = memory_budget_gib(cfg) * GIB
    return all(stage_memory(cfg, k)["total"] <= budget for k in range(_layout(cfg).pp))


def _offload_candidate(base: Config, recompute_fits: int | None) -> list[str] | None:
    """Overrides that fit `base` with the fewest offloaded layers per stage after recomputing the fewest r layers
    of every stage for which host memory holds what is offloaded, r below `recompute_fits` (that many fit by
    recompute alone; None: no number does, r is 0); None if there is no such r, or if its hardware and mode cannot
    offload (validate.py's rules). The more a stage recomputes, the less it offloads: after r = 0, r is bisected."""
    def fitted(r: int) -> list[str] | None:
        recompute = ["recompute.mode=full", f"recompute.layers={r}"] if r else []
        cfg = with_overrides(base, recompute + ["offload.layers=1"])
        offloaded = _fewest_layers_that_fit(cfg, "offloaded")
        if offloaded is None or not any(offloaded):
            return None
        host = max(stage_host_bytes(cfg, k, n) for k, n in enumerate(offloaded)) / GIB
        return recompute + [f"offload.layers={_yaml(offloaded)}"] if host <= cfg.hardware.host_memory_gib else None

    try:
        if recompute_fits is None:
            return fitted(0)
        first = fitted(0) if recompute_fits else None
        if first or not recompute_fits:
            return first
        low, high = 1, recompute_fits
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fitted(mid) else (mid + 1, high)
        return fitted(low) if low < recompute_fits else None
    except ConfigError:  # no host link in the profile, CPU, PyNative, no lazy_inline
        return None


def _layout_overrides(cfg: Config, dp: int, tp: int, pp: int, mbs: int, v: int = 1, ep: int = 1) -> list[str] | None:
    m = cfg.model
    widths = (m.num_heads, m.kv_heads, m.ffn_hidden_size, m.vocab_size,
              *((m.moe.expert_ffn(m.ffn_hidden_size),) if m.moe.enabled else ()))
    if any(x % tp for x in widths) or tp > cfg.hardware.devices_per_node:
        return None
    if pp > m.num_layers or (tp > 1 and m.seq_length % tp):
        return None
    batch = _batch_overrides(cfg, dp, pp, mbs)
    if batch is None:
        return None
    offset = interleaved_offset(m.num_layers, pp, v)
    return [f"parallel.data_parallel={dp}", f"parallel.model_parallel={tp}", f"parallel.pipeline_stage={pp}",
            f"parallel.expert_parallel={ep}",
            *batch, f"train.micro_batch_size={mbs}", f"train.global_batch_size={cfg.global_batch_size}",
            f"parallel.pipeline_interleave={v}", "parallel.pipeline_scheduler=1f1b",
            f"parallel.stage_offset={_yaml(offset)}", f"parallel.sequence_parallel={str(tp > 1).lower()}",
            f"parallel.optimizer_shard={str(dp > 1).lower()}", "parallel.gradient_accumulation_shard=false"]


def _yaml(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def search(cfg: Config, devices: int, top: int = 5, peak_tflops: float | None = None,
           efficiency: float | None = None, micro_batch_sizes: tuple = (1, 2, 4)) -> list[dict]:
    """Valid (dp, mp, pp, interleave, micro batches, recompute, recompute.comm, offload; a mixture of experts'
    expert_parallel) layouts for `devices` keeping the global batch, ranked by predicted tokens/s among those that
    fit. Each entry: overrides, plan. The config's context_parallel c is kept, not searched: the layouts share
    devices / c among dp x mp x pp."""
    peak = peak_tflops if peak_tflops is not None else device_peak_tflops(cfg)
    found = []
    cp = cfg.parallel.context_parallel
    if devices % cp:
        raise PlanError(f"--devices {devices} is not a multiple of parallel.context_parallel={cp}; pick a multiple "
                        "or change it with --set")
    shapes = [(tp, pp, mbs) for tp in _divisors(devices // cp) for pp in _divisors(devices // cp // tp)
              for mbs in micro_batch_sizes]
    for tp, pp, mbs in shapes:
        dp = devices // (tp * pp * cp)
        micro = cfg.global_batch_size // (dp * mbs)
        experts = cfg.model.moe.num_experts
        expert_splits = [e for e in _divisors(dp) if experts % e == 0] if experts else [1]
        for v, ep in ((v, ep) for v in interleave_choices(cfg.model.num_layers, pp, micro) for ep in expert_splits):
            layout = _layout_overrides(cfg, dp, tp, pp, mbs, v, ep)
            if layout is None:
                continue
            try:
                base = with_overrides(cfg, layout + ["recompute.mode=none", "recompute.layers=null",
                                                     "recompute.comm=false", "offload.layers=0"])
            except ConfigError:
                continue
            shards = [[]]
            if _layout(base).accumulates_in_graph and _layout(base).optimizer_shard and cfg.run.reuse_layer_graph:
                shards.append(["parallel.gradient_accumulation_shard=true"])
            candidates = []
            for shard in shards:
                candidates += _memory_candidates(base, shard)
                # with tensor parallel, also repeating its communication in the backward instead of keeping its
                # outputs: that only adds communication, so only where the layout does not fit as it is
                if tp > 1 and not _fits_as_is(base, shard):
                    candidates += _memory_candidates(base, shard + ["recompute.comm=true"])
            for extra in candidates:
                try:
                    candidate = with_overrides(base, extra) if extra else base
                except ConfigError:  # e.g. an accumulation shard the layout cannot take
                    continue
                result = plan(candidate, peak, efficiency)
                if result["fits"]:
                    keeps = [] if any(x.startswith("recompute.mode=") for x in extra) else ["recompute.mode=none"]
                    if any(offload_layer_counts(cfg)) and not any(x.startswith("offload.") for x in extra):
                        keeps.append("offload.layers=0")
                    if cfg.recompute.comm and "recompute.comm=true" not in extra:
                        keeps.append("recompute.comm=false")
                    sets = list({o.split("=", 1)[0]: o for o in layout + keeps + extra}.values())  # last wins
                    found.append({"overrides": sets, "plan": result})
    if not found:
        raise PlanError(f"no layout of {cfg.run.name} fits {devices} x {cfg.hardware.name} "
                        f"({cfg.hardware.memory_gib:g} GiB) at global batch {cfg.global_batch_size}; "
                        "use more devices, a smaller micro batch or a shorter sequence")
    found.sort(key=lambda c: (-c["plan"]["predicted"]["tokens_per_s"], c["plan"]["memory_gib"]["total"]))
    return found[:top]

