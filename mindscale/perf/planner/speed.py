"""The speed model: how long a micro batch's kernels run on one device, and how long a collective takes.

Compute (docs/planner.md, "Speed model"). Every matmul of a layer, [M, K] x [K, N] on one rank, runs at

    matmul_efficiency x s(M) x s(K) x s(N) of the peak,  s(x) = x / (x + matmul_half_width)

so a narrow matmul (a small model, or a wide one cut by tensor parallel) runs worse than a wide one. Training runs a
layer's matmuls three times (forward, the input gradient, the weight gradient), four with full recompute. The
attention core (QK^T and scores x V: 12·H·Q·T FLOPs a token, forward and backward) runs at attention_efficiency;
flash attention computes the causal half of it, the composite core all of it. What is neither (norms, residual adds,
rotary, activations, the loss: memory-bound passes over the activations) takes vector_ns_per_element for every
element of a layer's [tokens, h] hidden states and of the head's [tokens, V] logits on the rank, forward and
backward together. The four numbers are the hardware profile's, fitted on published measurements
(bench/published_ascend.yaml); a profile without them runs every FLOP at the flat DEFAULT_EFFICIENCY of its device,
the planner's model before calibration (and `--efficiency` asks for that).

Collectives follow HCCL's own cost model (Hockney's α–β; hicann/hccl docs/zh/user_guide/coll_algo_intro): inside a
server whose devices are fully meshed (hardware.intra_node_mesh) a collective of l ranks runs HCCL's Mesh algorithm,
each rank using its l-1 links at once (an all-reduce of n bytes: 2α + 2n/(l·B_link)); between servers the
hierarchical algorithms cut the data by the l ranks of each server first, so every rank's own NIC carries (S-1)/S of
n/l across S servers. The communication module counts ring bytes (2(r-1)/r of n for an all-reduce over r ranks);
`collective_s` turns them back into n and times them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindscale.config import Config, Layout
from mindscale.perf import flops
from mindscale.perf.planner.activations import expert_slots, local_tokens
from mindscale.perf.planner.caches import _layout

# Fraction of the peak every FLOP runs at when the profile has no fitted speed model (`--efficiency` overrides it).
DEFAULT_EFFICIENCY = {"Ascend": 0.55, "GPU": 0.55, "CPU": 0.3}


@dataclass(frozen=True)
class SpeedModel:
    """The compute half of the speed model: a wide matmul's fraction of the peak, the width at which one dimension
    halves it, the attention core's fraction, and the seconds per activation element of the memory-bound rest
    (docstring above). `calibrated`: fitted on published measurements (the profile's), not the flat default."""

    matmul_efficiency: float
    matmul_half_width: float
    attention_efficiency: float
    vector_s_per_element: float
    calibrated: bool

    @classmethod
    def of(cls, cfg: Config, efficiency: float | None = None) -> "SpeedModel":
        """The profile's fitted model, or every FLOP at `efficiency` (default: the device's flat one)."""
        hw = cfg.hardware
        if efficiency is None and hw.matmul_efficiency is not None:
            return cls(
                hw.matmul_efficiency,
                hw.matmul_half_width,
                hw.attention_efficiency if hw.attention_efficiency is not None else hw.matmul_efficiency,
                hw.vector_ns_per_element * 1e-9,
                True,
            )
        flat = efficiency if efficiency is not None else DEFAULT_EFFICIENCY[hw.device_target]
        return cls(flat, 0.0, flat, 0.0, False)

    def matmul(self, m: float, k: float, n: float) -> float:
        """Fraction of the peak a [m, k] x [k, n] matmul runs at."""

        def s(x: float) -> float:
            return x / (x + self.matmul_half_width)

        return self.matmul_efficiency * s(m) * s(k) * s(n)


@dataclass(frozen=True)
class Matmul:
    """One weight's matmul on one rank: [m, k] x [k, n], `count` of them (the experts a rank holds)."""

    m: float
    k: float
    n: float
    count: int = 1

    @property
    def flops(self) -> float:
        return 2 * self.m * self.k * self.n * self.count


def layer_matmuls(cfg: Config, experts: bool) -> list[Matmul]:
    """The forward matmuls of one decoder layer on one rank for one micro batch; `experts`: a mixture-of-experts
    layer (else a dense one: a dense family, or a mixture's dense first layers). Column-parallel weights are cut
    along N, row-parallel along K (tensor parallel t); the rows are the rank's tokens (gathered under sequence
    parallel), an expert's rows its slots."""
    m, layout = cfg.model, _layout(cfg)
    t, h, tokens = layout.tp, m.hidden_size, local_tokens(cfg)
    out = _attention_matmuls(cfg, tokens, t)
    if experts:
        moe = m.moe
        slots = expert_slots(cfg) / moe.num_experts * layout.ep  # one expert's rows on the rank holding it
        width, held = moe.expert_ffn(m.ffn_hidden_size) / t, moe.num_experts // layout.ep
        out += [Matmul(tokens, h, moe.num_experts), Matmul(slots, h, width, 2 * held), Matmul(slots, width, h, held)]
        if moe.shared_expert_ffn_hidden_size:
            shared = moe.shared_expert_ffn_hidden_size / t
            out += [Matmul(tokens, h, shared, 2), Matmul(tokens, shared, h)]
        return out
    inner = m.ffn_hidden_size / t
    return out + [Matmul(tokens, h, inner, 2 if m.spec.gated_mlp else 1), Matmul(tokens, inner, h)]


def _attention_matmuls(cfg: Config, tokens: int, t: int) -> list[Matmul]:
    """q, k, v and o; under multi-head latent attention the low-rank down-projections (not split) and the
    up-projections (split over the heads)."""
    model = cfg.model
    h = model.hidden_size
    if not model.spec.mla:
        return [
            Matmul(tokens, h, model.num_heads * model.head_size / t),
            Matmul(tokens, h, model.kv_heads * model.head_size / t, 2),
            Matmul(tokens, model.num_heads * model.head_size / t, h),
        ]
    mla, heads = model.mla, model.num_heads / t
    q = (
        [Matmul(tokens, h, mla.q_lora_rank), Matmul(tokens, mla.q_lora_rank, heads * mla.qk_head_dim)]
        if mla.q_lora_rank
        else [Matmul(tokens, h, heads * mla.qk_head_dim)]
    )
    return q + [
        Matmul(tokens, h, mla.kv_lora_rank + mla.qk_rope_head_dim),
        Matmul(tokens, mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
        Matmul(tokens, heads * mla.v_head_dim, h),
    ]


def matmul_s(matmuls: list[Matmul], peak: float, speed: SpeedModel) -> float:
    """Seconds the forward of `matmuls` takes at `peak` FLOP/s."""
    return sum(mm.flops / (peak * speed.matmul(mm.m, mm.k, mm.n)) for mm in matmuls)


def in_copies(matmuls: list[Matmul], copies: int) -> list[Matmul]:
    """The matmuls of a micro batch split into `copies` (communication.micro_batch_interleave): each copy's take
    1/copies of the rows, so the same FLOPs run on narrower, slightly slower matmuls."""
    return [Matmul(mm.m / copies, mm.k, mm.n, mm.count * copies) for mm in matmuls]


def attention_core_s(cfg: Config, peak: float, speed: SpeedModel) -> float:
    """Seconds one layer's attention core takes forward on one rank for one micro batch: 4·H·Q·S FLOPs a token
    (QK^T and scores x V over the whole sequence S), half of them under flash attention's causal skip, on the
    busiest context-parallel rank (Layout.attention_imbalance: the last of colossalai_cp's contiguous chunks
    computes (2c-1)/c of the mean causal work)."""
    layout = _layout(cfg)
    core = 4 * flops.core_width(cfg.model) / layout.tp * cfg.model.seq_length * local_tokens(cfg)
    if layout.attention == "flash" and speed.calibrated:
        core *= layout.attention_imbalance / 2
    return core / (peak * speed.attention_efficiency)


def stage_compute_s(cfg: Config, stage: int, peak: float, speed: SpeedModel) -> float:
    """Seconds one micro batch's forward and backward of `stage` computes on one rank: its layers' matmuls and
    attention cores three times (four for a fully recomputed layer; a selectively recomputed layer repeats its
    composite core's forward, nothing under flash attention, which keeps no S x S tensor) with their memory-bound
    passes (a third of them again when recomputed), and the output head and loss on the last stage."""
    model, layout = cfg.model, _layout(cfg)
    copies = cfg.communication.micro_batch_interleave
    stream_split = layout.tp if layout.sp or layout.nd_tp else 1  # the residual stream split by tokens or width
    vector_s = speed.vector_s_per_element * local_tokens(cfg) * model.hidden_size / stream_split
    dense_s = matmul_s(in_copies(layer_matmuls(cfg, experts=False), copies), peak, speed) + vector_s / 3
    expert_s = (
        matmul_s(in_copies(layer_matmuls(cfg, experts=True), copies), peak, speed) + vector_s / 3
        if model.spec.moe
        else dense_s
    )
    core_s = attention_core_s(cfg, peak, speed)
    recomputed = set(layout.recomputed)
    total = 0.0
    for i in layout.layers_of_stage(stage):
        forward = expert_s if model.spec.moe and i >= model.moe.dense_layers else dense_s
        again = i in recomputed
        total += forward * (4 if again and layout.recompute == "full" else 3)
        repeat_core = again and (layout.recompute == "full" or layout.attention == "composite")
        total += core_s * (4 if repeat_core else 3)
    if stage == layout.pp - 1:
        head = _head(cfg, layout)
        head_s = 3 * matmul_s([head], peak, speed) + speed.vector_s_per_element * head.m * head.n
        # each multi-token-prediction module: its projection [T, 2h] -> h (not split), a block, the head again
        projection = Matmul(local_tokens(cfg), 2 * model.hidden_size, model.hidden_size)
        module_s = 3 * (matmul_s([projection], peak, speed) + expert_s + core_s) + head_s
        total += head_s + model.mtp_depth * module_s
    return total


def _head(cfg: Config, layout: Layout) -> Matmul:
    """The output head's matmul on one rank: the vocabulary split over tp (vocab parallel), or the tokens split
    over tp under sequence parallel, or all of both (a data-parallel head without sequence parallel: every tp rank
    computes its rows' whole logits, Layout.logit_split)."""
    rows, vocab = layout.logit_split
    tokens = local_tokens(cfg) * layout.token_rows / rows
    return Matmul(tokens, cfg.model.hidden_size, cfg.model.vocab_size / vocab)


# ------------------------------------------------------------------------------------------------ collectives


def ranks_per_server(layout: Layout, stride: int, size: int, devices_per_node: int) -> int:
    """How many ranks of a group of `size` ranks `stride` apart share a server (ranks are numbered tensor parallel
    innermost, then context, data, pipeline parallel; a server holds devices_per_node consecutive ranks)."""
    if stride >= devices_per_node:
        return 1
    return max(1, min(size, devices_per_node // stride))


def collective_s(
    cfg: Config, ring_bytes: float, ranks: int, per_server: int, ops: float, alltoall: bool = False
) -> float:
    """Seconds a rank spends in collectives that move `ring_bytes` (ring accounting: 2(r-1)/r of the data for an
    all-reduce, (r-1)/r for an all-gather, reduce-scatter or all-to-all) over a group of `ranks`, `per_server` of
    them in each server, in `ops` separate operations (each pays the latency α of the links it uses)."""
    if ranks <= 1 or ring_bytes <= 0:
        return 0.0
    hw = cfg.hardware
    data = ring_bytes * ranks / (ranks - 1)  # the n of HCCL's formulas, summed over the operations
    servers = math.ceil(ranks / per_server)
    seconds = 0.0
    if per_server > 1:
        if hw.intra_node_mesh:  # Mesh: l-1 links at once; an all-to-all sends n/r on each
            seconds += data / ((ranks if alltoall else per_server) * hw.intra_node_gbps * 1e9)
        else:  # ring over the server's ranks at the device's bandwidth
            seconds += data * (per_server - 1) / per_server / (hw.intra_node_gbps * 1e9)
        seconds += ops * hw.intra_node_latency_us * 1e-6
    if servers > 1:
        across = data * (servers - 1) / servers / (1 if alltoall else per_server)
        seconds += across / (hw.inter_node_gbps * 1e9)
        seconds += ops * math.ceil(math.log2(servers)) * hw.inter_node_latency_us * 1e-6
    return seconds


def send_s(cfg: Config, bytes_: float, sends: float, across_servers: bool) -> float:
    """Seconds of point-to-point sends between neighbouring pipeline stages: one HCCS link inside a server, the
    rank's own NIC between servers."""
    hw = cfg.hardware
    if not sends:
        return 0.0
    gbps, latency = (
        (hw.inter_node_gbps, hw.inter_node_latency_us)
        if across_servers
        else (hw.intra_node_gbps, hw.intra_node_latency_us)
    )
    return bytes_ / (gbps * 1e9) + sends * latency * 1e-6
