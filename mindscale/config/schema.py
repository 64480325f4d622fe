"""Every key a user can write, in one documented dataclass per section (Megatron-Core style).

The meaning of each key is the field's `doc`; docs/config.md is generated from it
(`python tools/config.py --doc`). Loading, typing and validation live in mindscale/config/load.py
and validate.py; decisions derived from the parallel keys, in mindscale/config/layout.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from models.archs import ARCHS
from models.spec import ArchSpec

ArchName = Literal[tuple(ARCHS)]  # the registered architectures


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field carrying its documentation."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class RunConfig:
    name: str = doc("Run name; the run folder is <output_dir>/<name>.", "run")
    output_dir: str = doc("Parent folder of run folders (relative to the working directory).", "output")
    seed: int = doc("Seed for weights, data order and dropout.", 1234)
    device_target: Literal["auto", "Ascend", "GPU", "CPU"] = doc(
        "Backend; auto picks Ascend, then GPU, then CPU.", "auto"
    )
    mode: Literal["graph", "pynative"] = doc("MindSpore execution mode.", "graph")
    reuse_layer_graph: bool = doc(
        "Graph mode: reuse compiled graphs (MindSpore lazy_inline): one decoder layer's for every layer with "
        "the same recompute setting and stage (compile time at 32 layers halves on CPU), or, in a sharded "
        "layout with several micro batches per step, the whole loss network's, called per micro batch "
        "(needed by parallel.gradient_accumulation_shard). false compiles every layer and micro batch on "
        "its own; the numbers are the same.",
        True,
    )
    compile_cache: bool = doc(
        "Graph mode: keep the train step's compiled graph in <run>/compile_cache/<key>/rank_<r>/ (MindSpore's "
        "compile cache), so a relaunch or a --max-restarts restart of an unchanged graph loads it instead of "
        "compiling again. The key hashes the sources of mindscale/ and models/, this config (less the run's "
        "name, folders, logging and checkpoint keys), the device and MindSpore's version; a change of any "
        "compiles afresh (docs/launch.md). false compiles at every launch.",
        True,
    )
    tensorboard: bool = doc(
        "The logging rank also writes every scalar of each metrics.jsonl record (loss, lr, loss_scale, "
        "skipped_steps, throughput, MFU, ...) as TensorBoard events in <run>/tensorboard/ (needs tensorboardX); "
        "view with `tensorboard --logdir <output_dir>` after `make extras` (docs/monitoring.md).",
        False,
    )
    max_restarts: int = doc(
        "scripts/run_distribute.sh (--max-restarts N overrides it): after a worker fails or stalls, relaunch "
        "every worker from the newest committed (healthy) checkpoint, at most this many times, then give up "
        "with exit 1. A worker's exit status 2 (bad input) and a health guard's stop (train.max_skipped_steps, "
        "a non-finite loss) are never retried. With NNODES > 1 every node restarts together, through the shared "
        "run folder (docs/launch.md). Needs checkpoint.resume=true. 0 = no restarts.",
        0,
    )
    hang_timeout_s: float = doc(
        "scripts/run_distribute.sh: seconds without a worker heartbeat (written after every step) after which "
        "the launcher names the stalled rank and its last step, dumps that rank's Python stacks into its "
        "log and stops the job (exit 1, or a restart under max_restarts). Must exceed the longest step plus "
        "a checkpoint save, and the longest validation batch (the first compiles the validation graph; a pass "
        "beats at each batch); a rank's first step (the compile) is not timed. On Ascend HCCL_EXEC_TIMEOUT is "
        "derived from it (docs/launch.md). 0 = off.",
        1800.0,
    )
    stop_vote_interval: Optional[int] = doc(
        "Sharded layouts: the ranks vote on a graceful stop (SIGTERM/SIGUSR1) every this many steps, so all stop "
        "after the same step; a vote is a collective of its own. null = agreed by the ranks from measured costs: "
        "the fewest steps that keep a vote under 0.1% of the training time, at most 10 s of steps "
        "(mindscale/train/resilience/stop.py). Data-parallel runs vote at every step inside the loss's all-reduce, at no "
        "cost, whatever this says.",
        None,
    )


@dataclass
class HardwareConfig:
    name: str = doc("Profile name (a file in configs/hardware/ or 'inline').", "cpu")
    device_target: Literal["Ascend", "GPU", "CPU"] = doc("Backend this profile describes.", "CPU")
    peak_tflops: Optional[float] = doc(
        "Dense fp16/bf16 peak per device in TFLOP/s; null on CPU = measure a GEMM once and cache.", None
    )
    memory_gib: float = doc("Device memory per device in GiB.", 16.0)
    memory_reserve_gib: float = doc("Memory the framework/runtime keeps for itself per device.", 0.0)
    memory_margin: float = doc("Fraction of usable memory a plan may fill (planner 'fits' test).", 0.9)
    max_device_memory_gib: Optional[float] = doc(
        "The ceiling of MindSpore's device memory pool per device (mindspore.runtime.set_memory max_size, set at "
        "start on Ascend/GPU and logged); null = memory_gib - memory_reserve_gib, leaving the reserve to the "
        "runtime and HCCL buffers. The planner's budget is memory_margin of the same number.",
        None,
    )
    devices_per_node: int = doc("Devices per server (intra-node vs inter-node links).", 1)
    intra_node_gbps: float = doc(
        "Intra-node bandwidth, GB/s each way: of one link between two devices when "
        "intra_node_mesh, else of one device in a ring.",
        10.0,
    )
    intra_node_mesh: bool = doc(
        "The devices of a server are fully meshed, each pair by its own link, and a collective of l ranks of a "
        "server uses l-1 links at once (HCCL's Mesh algorithm); false = a ring at intra_node_gbps per device "
        "(docs/planner.md, speed model).",
        False,
    )
    intra_node_latency_us: float = doc("Latency α of one collective step inside a server, µs (HCCL's α–β model).", 0.0)
    inter_node_gbps: float = doc("Per-device inter-node bandwidth, GB/s each way (its NIC).", 10.0)
    inter_node_latency_us: float = doc("Latency α of one collective step between servers, µs.", 0.0)
    matmul_efficiency: Optional[float] = doc(
        "Fraction of peak_tflops a wide matmul runs at (the planner's speed model, fitted on published "
        "measurements: docs/planner.md); null = every FLOP at a flat 0.55 (Ascend, GPU) or 0.3 (CPU).",
        None,
    )
    matmul_half_width: float = doc(
        "A matmul dimension (rows, contraction or columns) of this size halves its efficiency: each dimension x "
        "scales it by x / (x + matmul_half_width). 0 = no effect of shape.",
        0.0,
    )
    attention_efficiency: Optional[float] = doc(
        "Fraction of the peak the attention core (QK^T, scores x V) runs at, of the FLOPs it computes (flash "
        "attention: the causal half); null = matmul_efficiency.",
        None,
    )
    vector_ns_per_element: float = doc(
        "Nanoseconds the memory-bound operators (norms, residual adds, rotary, activations, the loss) take per "
        "element of a layer's [tokens, hidden] activations, and of the head's [tokens, vocabulary] logits, on one "
        "device, forward and backward together (the speed model; 0 = not timed).",
        0.0,
    )
    speed_error: Optional[float] = doc(
        "The speed model's median absolute error on the published measurements it was fitted against "
        "(bench/published_ascend.yaml, BENCHMARKS.md); tools/plan.py --search states it beside its ranking. "
        "null = not calibrated.",
        None,
    )
    host_link_gbps: Optional[float] = doc(
        "Per-device link to host memory, GB/s each way (PCIe): what offloaded activations move over "
        "(offload.layers); null = none.",
        None,
    )
    host_memory_gib: Optional[float] = doc(
        "Host memory per device that offloaded activations may fill, GiB; null = none.", None
    )
    failures_per_device_hour: float = doc(
        "Unexpected job interruptions per device-hour; a job of N devices fails every 1 / (N x this) hours (the "
        "planner's goodput, docs/planner.md). Default: LLaMA-3's 419 in 54 days on 16,384 GPUs (Llama 3 report, "
        "section 3.3.4).",
        419 / (54 * 24 * 16384),
    )
    storage_gbps: float = doc(
        "Checkpoint storage bandwidth per device, GB/s, writing or reading with every device at once (the shared "
        "filesystem's aggregate over the devices): a save's write and a restart's load (the planner's goodput).",
        1.0,
    )
    requeue_s: float = doc(
        "Seconds a scheduler takes from a failed job to its requeued processes starting (the planner's goodput).", 600.0
    )
    relaunch_s: float = doc(
        "Seconds the launcher's own restart takes from a failure to new processes starting (the planner's goodput).",
        30.0,
    )
    flash_attention: bool = doc("Whether ops.flash_attention_score exists on this device.", False)
    soc_version: Optional[Literal["ascend910", "ascend910b", "ascend910_93", "ascend950"]] = doc(
        "The chip as MindSpore names it (its get_ascend_soc_version()); null off Ascend. ascend910 (910A) has no "
        "bf16 matmul (refused) and saturates fp16 overflow instead of giving inf/nan, so the train step reads "
        "the device's float status to detect overflow (docs/models.md); the profile decides, so the dry run "
        "compiles what that chip runs.",
        None,
    )
    source: str = doc("Where the numbers come from.", "")

    @property
    def memory_pool_gib(self) -> float:
        """What MindSpore's memory pool may take per device: the one number the runtime sets and the planner
        budgets (docs/launch.md "Day one on a cluster")."""
        if self.max_device_memory_gib is not None:
            return self.max_device_memory_gib
        return self.memory_gib - self.memory_reserve_gib


@dataclass
class MoeConfig:
    num_experts: int = doc(
        "Routed experts E per layer (model.arch mixtral, qwen3_moe); 0 = a dense MLP (the other families).", 0
    )
    top_k: int = doc("Experts each token is routed to (softmax over E router logits, then the k largest).", 2)
    ffn_hidden_size: Optional[int] = doc(
        "Inner width of one routed expert's SwiGLU (Qwen3-MoE's "
        "moe_intermediate_size); null = model.ffn_hidden_size (Mixtral).",
        None,
    )
    shared_expert_ffn_hidden_size: int = doc(
        "Inner width of a shared SwiGLU expert every token passes through, added to the routed experts' output "
        "(DeepSeek-style, ungated); 0 = none (Mixtral, Qwen3-MoE).",
        0,
    )
    norm_topk_prob: bool = doc(
        "Renormalise the k chosen probabilities to sum to 1 (Mixtral: always; Qwen3-MoE: its norm_topk_prob).", True
    )
    aux_loss_coeff: float = doc(
        "Weight of the load-balancing loss (Switch Transformer / Mixtral form, E x sum_e f_e P_e per layer, "
        "averaged over the layers with experts) added to the training loss; logged as aux_loss. f and P count the "
        "tokens the loss trains (SFT: its loss mask, so padding and prompts are left out). 0 = not added (still "
        "logged).",
        0.01,
    )
    seq_aux_loss_coeff: float = doc(
        "Weight alpha of DeepSeek-V3's sequence-wise balance loss (its report's eq. 17-20: per sequence, "
        "sum_e f_e P_e with f_e = E/(top_k T) x the sequence's tokens choosing e and P_e their mean normalised "
        "router score, averaged over the sequences and over the layers with experts), added to the training "
        "loss beside aux_loss_coeff's batch-wise loss; logged as seq_aux_loss. T counts the tokens the loss "
        "trains, as for aux_loss_coeff. DeepSeek-V3: 0.0001. 0 = not added (still logged).",
        0.0,
    )
    bias_update_rate: float = doc(
        "Sigmoid router: auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2; Megatron's "
        "moe_router_bias_update_rate): after each optimizer step that is not skipped, every expert's router_bias "
        "moves by this x sign(mean load - its load), its load the tokens that chose it over the whole global "
        "batch (every micro batch and every rank). DeepSeek-V3: 0.001. 0 = the bias stays as loaded (frozen). "
        "Under pipeline stages each stage moves the biases of its own layers (docs/models.md, DeepSeek-V3).",
        0.0,
    )
    capacity_factor: Optional[float] = doc(
        "Token dropping: each expert takes at most ceil(top_k x T x capacity_factor / E) of the T tokens of a "
        "data-parallel rank (first slot-1 choices, then in token order); the rest of its tokens pass it by. "
        "null = dropless: the capacity is T, nothing is dropped, at E/top_k times the expert compute of a "
        "factor of 1 (docs/models.md, mixture of experts).",
        None,
    )

    dispatch: Literal["capacity", "grouped"] = doc(
        "How tokens reach their experts. capacity: a static buffer of capacity_factor's slots per expert, batched "
        "matmuls, every parallel style (the strategy plan). grouped: dropless over each rank's tokens sorted by "
        "expert, GroupedMatmul with per-expert token counts (Ascend; on CPU a loop over the experts, E times the "
        "work) and, under expert parallel, AlltoAllV to the experts' ranks inside a self-defined shard "
        "(MindFormers 1.9's parallel_core path); needs capacity_factor null, and sharded, tensor and context "
        "parallel 1 (docs/models.md, mixture of experts).",
        "capacity",
    )

    def expert_ffn(self, dense_ffn: int) -> int:
        """The inner width of one routed expert."""
        return self.ffn_hidden_size or dense_ffn

    router: Literal["softmax", "sigmoid"] = doc(
        "Router scores: softmax over the E logits, the top_k largest chosen (Mixtral, Qwen3-MoE); sigmoid "
        "(DeepSeek-V3): a sigmoid per expert in fp32, the choice made on the scores plus a per-expert correction "
        "bias (router_bias, a parameter that is not trained: bias_update_rate moves it), the "
        "weights the unbiased scores of the chosen experts.",
        "softmax",
    )
    num_groups: int = doc(
        "Sigmoid router: the E experts form this many equal groups; a token chooses among the "
        "experts of its topk_groups best groups, a group scored by the sum of its two best biased "
        "scores (DeepSeek-V3's n_group). 1 = no group limit.",
        1,
    )
    topk_groups: int = doc("Sigmoid router: the groups a token may choose from (DeepSeek-V3's topk_group).", 1)
    routed_scaling_factor: float = doc(
        "Sigmoid router: the chosen weights (after norm_topk_prob) are multiplied by this (DeepSeek-V3: 2.5).", 1.0
    )
    dense_layers: int = doc(
        "The first this many layers have a dense SwiGLU MLP of model.ffn_hidden_size instead of "
        "experts (DeepSeek-V3's first_k_dense_replace: 3).",
        0,
    )

    def capacity(self, tokens: int) -> int:
        """Slots per expert for the `tokens` of one data-parallel rank (MindFormers' calculate_expert_capacity,
        at most all of them)."""
        if self.capacity_factor is None:
            return tokens
        return min(tokens, math.ceil(self.top_k * tokens * self.capacity_factor / self.num_experts))


@dataclass
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3; model.arch deepseek_v3 only): low-rank query and key/value
    projections, each head's key and query a no-position part and a rotary part, the rotary key shared by
    every head (models/mla.py)."""

    q_lora_rank: Optional[int] = doc(
        "Rank of the query's down-projection (an RMSNorm between it and the up-"
        "projection); null = one full query projection.",
        1536,
    )
    kv_lora_rank: int = doc("Rank of the compressed key/value latent (what a KV cache of MLA would hold).", 512)
    qk_nope_head_dim: int = doc("Per-head width of the query/key part without positions.", 128)
    qk_rope_head_dim: int = doc("Per-head width of the rotary query/key part (the key's is shared by all heads).", 64)
    v_head_dim: int = doc("Per-head width of the values.", 128)
    rope_interleave: bool = doc(
        "The rotary part's weights store the pairs interleaved (x0, x1), (x2, x3), ... as "
        "DeepSeek's checkpoints do (Hugging Face's rope_interleave, true for DeepSeek-V3): "
        "they are de-interleaved into the rotate-half layout before the rotation.",
        True,
    )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    arch: ArchName = doc(
        "Model family (one entry each in models/archs/): "
        + ", ".join(f"{spec.name} ({spec.summary})" for spec in ARCHS.values())
        + ".",
        "llama",
    )
    vocab_size: int = doc("Vocabulary size.", 32000)
    hidden_size: int = doc("Model width h.", 4096)
    num_layers: int = doc("Transformer layers L.", 32)
    num_heads: int = doc("Attention heads a.", 32)
    num_kv_heads: Optional[int] = doc("Key/value heads (GQA); null = num_heads.", None)
    head_dim: Optional[int] = doc(
        "Width of one attention head; null = hidden_size / num_heads (Qwen3 32B: 128, "
        "with hidden_size 5120 and 64 heads).",
        None,
    )
    ffn_hidden_size: int = doc("MLP inner width (SwiGLU: per gate).", 11008)
    seq_length: int = doc("Training sequence length s (GPT: also the number of learned positions).", 4096)
    rope_theta: float = doc("RoPE base (LLaMA, Qwen2).", 10000.0)
    rope_scaling: Literal["none", "llama3"] = doc(
        "RoPE frequency scaling: llama3 (LLaMA-3.1/3.2, Hugging Face's rope_type llama3) divides the "
        "low frequencies by rope_scaling_factor and blends the band between the two wavelength limits below.",
        "none",
    )
    rope_scaling_factor: float = doc("llama3 scaling: the factor low frequencies are divided by.", 8.0)
    rope_low_freq_factor: float = doc(
        "llama3 scaling: wavelengths above original_max_positions / this are scaled fully.", 1.0
    )
    rope_high_freq_factor: float = doc("llama3 scaling: wavelengths below original_max_positions / this are kept.", 4.0)
    rope_original_max_positions: int = doc("llama3 scaling: the context length the model was pretrained at.", 8192)
    norm_eps: float = doc("Epsilon of RMSNorm/LayerNorm.", 1e-5)
    tie_embeddings: bool = doc("Share the input embedding with the output projection.", False)
    attention: Literal["auto", "flash", "composite"] = doc(
        "Attention kernel: flash (Ascend A2 FlashAttentionScore, float16 or bfloat16 compute only), composite "
        "(matmul+softmax), auto = flash where the hardware profile has it and compute_dtype is one it takes "
        "(docs/models.md).",
        "auto",
    )
    compute_dtype: Literal["float32", "float16", "bfloat16"] = doc(
        "Dtype of matmuls and of the residual stream (see fp32_residual_connection); norms, softmax and the "
        "loss compute in fp32.",
        "float32",
    )
    param_dtype: Literal["float32", "float16", "bfloat16"] = doc("Dtype of stored weights.", "float32")
    fp32_residual_connection: bool = doc(
        "Keep the residual stream (embedding rows, residual adds, what pipeline stages send) in fp32, "
        "Megatron-Core's key; off, it is in compute_dtype, as in Megatron-Core and MindFormers, and with "
        "bf16 the stage sends move half the bytes. Norms compute in fp32 either way.",
        False,
    )
    init_std: float = doc("Std of the normal weight init.", 0.02)
    moe: MoeConfig = doc(
        "Mixture of experts: the feed-forward of every layer is E routed SwiGLU experts.", factory=MoeConfig
    )
    mla: MlaConfig = doc(
        "Multi-head latent attention's widths (model.arch deepseek_v3; ignored by the others).", factory=MlaConfig
    )
    mtp_depth: int = doc(
        "Multi-token prediction (DeepSeek-V3 report, section 2.2): D sequential modules after the decoder, "
        "module k predicting the token k + 1 places after the next from the previous depth's hidden state and "
        "the embedding of the token k places ahead, through one more decoder block and the shared embedding "
        "and output head; trained only, never used to generate. 0 = off. model.arch deepseek_v3 "
        "(docs/models.md#multi-token-prediction).",
        0,
    )
    mtp_loss_weight: float = doc(
        "Multi-token prediction's weight lambda: the loss adds lambda / mtp_depth x the sum of the modules' "
        "cross entropies (DeepSeek-V3: 0.3 for its first 10T tokens, then 0.1).",
        0.3,
    )

    @property
    def residual_dtype(self) -> str:
        return "float32" if self.fp32_residual_connection else self.compute_dtype

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def spec(self) -> ArchSpec:
        """What the family is: traits, sharding plan, HF adapter, LoRA targets (models/archs/)."""
        return ARCHS[self.arch]

    @property
    def rope_scaling_params(self) -> tuple | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_positions) of llama3 scaling, or None."""
        if self.rope_scaling == "none":
            return None
        return (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_positions,
        )

    @property
    def head_size(self) -> int:
        """The width of one attention head's queries and keys: model.head_dim, or hidden_size / num_heads when it is
        null; under multi-head latent attention model.mla's qk_nope_head_dim + qk_rope_head_dim."""
        if self.spec.mla:
            return self.mla.qk_head_dim
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rope_head_size(self) -> int:
        """The width of the rotary part of a query or key head: all of it, or MLA's qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.spec.mla else self.head_size

    @property
    def value_head_size(self) -> int:
        """The width of one head's values (MLA's v_head_dim; else the head width)."""
        return self.mla.v_head_dim if self.spec.mla else self.head_size


@dataclass
class ParallelConfig:
    data_parallel: int = doc("Data-parallel degree d.", 1)
    model_parallel: int = doc("Tensor (model) parallel degree t.", 1)
    pipeline_stage: int = doc("Pipeline stages p.", 1)
    micro_batch_num: int = doc("Micro batches per step through the pipeline (pipeline_stage > 1).", 1)
    stage_offset: Union[int, list] = doc(
        "Extra layers per stage on top of num_layers // pipeline_stage (int for all stages or "
        "one per stage, MindFormers' `offset`). With pipeline_interleave v > 1 also a list of v lists of "
        "pipeline_stage ints: extra layers per chunk on top of num_layers // (pipeline_stage x v).",
        0,
    )
    pipeline_interleave: int = doc(
        "Model chunks per stage v (Megatron's virtual pipeline, MindFormers' pp_interleave_num): each "
        "stage's layers split into v chunks, placed round-robin (chunk k on stage k mod p), so the "
        "bubble shrinks to (p-1)/(v x m) at the cost of v chunks' activations in flight. Needs "
        "run.reuse_layer_graph (MindSpore interleaves only a lazy_inline graph).",
        1,
    )
    pipeline_scheduler: Literal["1f1b", "gpipe", "seqpipe", "seqvpp", "seqsmartvpp", "zero_bubble_v"] = doc(
        "MindSpore's pipeline scheduler (pipeline_config): 1f1b, gpipe, seqpipe, seqvpp, seqsmartvpp or "
        "zero_bubble_v; anything but 1f1b needs pipeline_interleave > 1 (MindSpore 2.9 refuses it). "
        "zero_bubble_v is refused: it needs the chunks placed in a V, which MindScale does not build "
        "(docs/dryrun.md, interleaved pipeline).",
        "1f1b",
    )
    context_parallel: int = doc(
        "Context-parallel degree c (MindFormers' context_parallel, Megatron's --context-parallel-size): every "
        "activation is split along the sequence over c ranks, [B, S/c, h]; attention gathers what it needs "
        "(context_parallel_algo). Devices = d x t x c x p. Needs flash attention, train.micro_batch_size 1 and "
        "a seq_length that c divides (docs/dryrun.md, context parallel).",
        1,
    )
    context_parallel_algo: Literal["colossalai_cp", "ulysses_cp"] = doc(
        "How attention sees the whole sequence under context_parallel (MindFormers' names): colossalai_cp "
        "all-gathers K and V over the c ranks (each rank's queries attend to the whole sequence; the "
        "backward reduce-scatters their gradients); ulysses_cp swaps the sequence split for a head split "
        "with an all-to-all before attention and back after it (heads and kv heads divisible by t x c).",
        "colossalai_cp",
    )
    context_parallel_load_balance: bool = doc(
        "Head-tail load balance of colossalai_cp's causal attention (MindSpore's flash attention load balance, "
        "enable_flash_attention_load_balance): each rank's query chunk is cut in two halves and rank i computes "
        "its own first half and the second half of rank c-1-i (exchanged by all-gathers over the pair, the "
        "output sent back), so every rank attends the same number of (query, key) pairs; contiguous chunks "
        "leave the last rank (2c-1)/c of the mean work. Needs colossalai_cp, an even context_parallel, a "
        "seq_length divisible by 2 x context_parallel, and pairs MindSpore 2.9 can group on Ascend (model_parallel "
        "a multiple of 8, or each cp group inside half a server) (docs/dryrun.md, context parallel).",
        False,
    )
    expert_parallel: int = doc(
        "Expert-parallel degree e: the routed experts of each layer split over e of the data-parallel ranks "
        "(e divides data_parallel and model.moe.num_experts); tokens reach their experts by AlltoAll, and an "
        "expert's gradients reduce over the data_parallel / e ranks that hold it (docs/models.md).",
        1,
    )
    tp_x: int = doc(
        "2D tensor parallel (MindSpore's high-dimension tensor parallel, MindFormers' tp_x): the first of the "
        "degrees the tensor degree t splits into, t = tp_x x tp_y (x tp_z). The attention and MLP projections of "
        "LLaMA and Qwen then split each weight over both (x along the hidden width, y along the other) and "
        "trade each all-reduce for an all-gather over one degree and a reduce-scatter over the other; the "
        "residual stream stays split over the hidden width. 1 with tp_y 1: 1D tensor parallel "
        "(docs/dryrun.md, 2D and 3D tensor parallel).",
        1,
    )
    tp_y: int = doc("2D tensor parallel: the second degree, t = tp_x x tp_y (x tp_z) (tp_x).", 1)
    tp_z: int = doc(
        "3D tensor parallel (MindSpore's high-dimension tensor parallel, MindFormers' tp_z): with tp_x and tp_y, "
        "the third degree, t = tp_x x tp_y x tp_z. The residual stream's tokens then split over z and y and its "
        "width over x; each projection all-gathers its weight over z as well, and the attention core receives "
        "q, k and v redistributed to a head split over t. 1: 2D (or 1D) tensor parallel "
        "(docs/dryrun.md, 2D and 3D tensor parallel).",
        1,
    )
    sequence_parallel: bool = doc("Shard norms/dropout activations along the sequence (needs t > 1).", False)
    vocab_emb_dp: bool = doc("Keep the embedding data-parallel instead of vocab-sharded over t.", True)
    optimizer_shard: bool = doc("Shard optimizer states (and master weights) over data parallel.", False)
    gradient_accumulation_steps: int = doc(
        "Micro steps accumulated per optimizer step, in one compiled graph. With several workers on Ascend/GPU "
        "it compiles under semi-auto parallel (data-parallel strategies only, if that is all the layout has), "
        "which ends each micro batch's backward before the next one's forward and reduces the gradients once "
        "per step; on CPU under DATA_PARALLEL, which does not order them (docs/launch.md).",
        1,
    )
    gradient_accumulation_shard: bool = doc(
        "With optimizer_shard and a pipeline (pipeline_stage > 1; without one MindSpore's compile of it grows "
        "exponentially with the layer count, docs/dryrun.md): keep the "
        "gradient-accumulation buffers sharded over the data-parallel replicas (MindSpore's "
        "gradient_accumulation_shard). Saves most of one full gradient copy (param_dtype) per rank; costs a "
        "reduce-scatter of the gradients per micro batch instead of one per step.",
        False,
    )

    @property
    def devices(self) -> int:
        """The devices (ranks) of the layout, d x t x c x p: the one count (Config.devices and Layout.devices
        are this number)."""
        return self.data_parallel * self.replica_devices

    @property
    def replica_devices(self) -> int:
        """The devices of one data-parallel replica (t x c x p): a world must be a multiple of it."""
        return self.model_parallel * self.context_parallel * self.pipeline_stage

    def replica_product(self, prefix: str = "") -> str:
        """`replica_devices` as its degrees, for messages: 'model_parallel=4 x context_parallel=8 x
        pipeline_stage=1' (context_parallel only when used; each key after `prefix`)."""
        degrees = {
            "model_parallel": self.model_parallel,
            **({"context_parallel": self.context_parallel} if self.context_parallel > 1 else {}),
            "pipeline_stage": self.pipeline_stage,
        }
        return " x ".join(f"{prefix}{key}={n}" for key, n in degrees.items())

    def data_parallel_for(self, world: int) -> int | None:
        """The data_parallel with which this layout uses `world` devices; None if no data_parallel does."""
        return world // self.replica_devices if world >= 1 and world % self.replica_devices == 0 else None


@dataclass
class RecomputeConfig:
    mode: Literal["none", "selective", "full"] = doc(
        "none; selective = attention core + activations (Korthikanti et al. 2022); full = whole layer.", "none"
    )
    layers: Union[int, list, None] = doc(
        "Layers recomputed: null = all; int = the first n of every stage; list = n per stage.", None
    )
    comm: bool = doc(
        "Repeat tensor-parallel communication in the backward instead of keeping its outputs: fully "
        "recomputed layers recompute their collectives too (MindSpore's mp_comm_recompute); under "
        "sequence parallel every other layer regathers the input of its column-parallel matmuls "
        "(all-gathers it again; MindFormers' select_comm_recompute), keeping 2·s·b·h·(1 - 1/t) bytes fewer "
        "(docs/planner.md).",
        False,
    )


@dataclass
class OffloadConfig:
    layers: Union[int, list] = doc(
        "Layers whose activations go to host memory in the forward pass and are prefetched back in the backward "
        "(MindSpore's Cell.offload; MindFormers' swap_config.layer_swap) instead of staying on the device: int = n "
        "of every stage, list = n per stage, 0 = none. A stage offloads the first n layers it does not recompute "
        "(a layer is recomputed or offloaded, never both: MindSpore ignores offload on a recomputed op), so with a "
        "list recompute.layers + offload.layers may not exceed a stage's layers. Ascend graph mode with "
        "run.reuse_layer_graph (MindSpore offloads only inside a lazy_inline graph); refused on CPU, where MindSpore "
        "2.9 compiles the marks and moves nothing (docs/models.md), and with context.memory_optimize_level O1, where "
        "its SOMAS keeps the host copies in device memory (docs/dryrun.md).",
        0,
    )
    backward_prefetch: int = doc(
        "How many operators before the backward op that reads an offloaded activation its copy back to the device "
        "starts (MindSpore's backward_prefetch, MindFormers' default_prefetch).",
        1,
    )


@dataclass
class CommunicationConfig:
    """MindSpore's communication optimisations (docs/communication.md): copies of a micro batch whose collectives
    overlap each other's compute, the fusion of collectives, and the overlap passes of MindSpore's
    parallel_speed_up_json. Every key is off by default: none has been run on Ascend here, and each is proved
    only to compile (tests/dryrun/test_communication.py)."""

    micro_batch_interleave: int = doc(
        "Multi-copy parallel (MindSpore's nn.MicroBatchInterleaved, MindFormers' micro_batch_interleave_num): each "
        "micro batch's rows are split into this many copies of the loss network, and MindSpore orders one copy's "
        "tensor-parallel collectives beside the other copy's compute. Wraps the loss network inside the pipeline "
        "and accumulation micro batches, as MindFormers does; the step averages the copies' losses. Needs an "
        "Ascend profile, parallel.model_parallel > 1 (without it a copy has no collectives to hide), "
        "train.micro_batch_size divisible by it, and run.reuse_layer_graph=false: MindSpore 2.9 interleaves the "
        "copies only in an inlined loss network (docs/communication.md). 1 = off.",
        1,
    )
    allreduce_fusion: bool = doc(
        "Fuse the gradient all-reduces of a layer: MindSpore's backend merges the all-reduces that share a "
        "parameter's comm_fusion index (models/sharding.py gives each layer its own, the embedding and the head "
        "theirs), communication group and dtype into one (set_auto_parallel_context comm_fusion allreduce). "
        "false leaves one all-reduce per parameter: MindSpore 2.9 fuses none by default. No size threshold: "
        "MindSpore's fusion by size skips MindScale's train step, a graph of sub-graphs, and its backend splits "
        "by size in data-parallel mode only (docs/communication.md).",
        False,
    )
    allgather_fusion: bool = doc(
        "Fuse the optimizer shard's weight all-gathers that share a comm_fusion index, group and dtype "
        "(comm_fusion allgather), as allreduce_fusion does the gradients'. Needs parallel.optimizer_shard.",
        False,
    )
    reducescatter_fusion: bool = doc(
        "Fuse the optimizer shard's gradient reduce-scatters that share a comm_fusion index, group and dtype "
        "(comm_fusion reducescatter). Needs parallel.optimizer_shard.",
        False,
    )
    grad_matmul_communication_overlap: bool = doc(
        "parallel_speed_up_json: in the backward, overlap a tensor-parallel collective with the weight-gradient "
        "MatMul that does not depend on it (Ascend backend pass). Needs parallel.model_parallel > 1.",
        False,
    )
    recomputation_communication_overlap: bool = doc(
        "parallel_speed_up_json: overlap a recomputed layer's tensor-parallel collectives with the backward "
        "compute of the layer before it. Needs recompute.mode full, parallel.model_parallel > 1 and "
        "run.reuse_layer_graph (MindSpore marks the recomputed collectives only in reused graphs).",
        False,
    )
    grad_computation_allreduce_overlap: bool = doc(
        "parallel_speed_up_json: overlap the data-parallel gradient all-reduce with the backward compute. Needs "
        "parallel.data_parallel > 1 without parallel.optimizer_shard (whose gradients are reduce-scattered).",
        False,
    )
    computation_allgather_overlap: bool = doc(
        "parallel_speed_up_json: overlap the optimizer shard's weight all-gathers with the forward compute. Needs "
        "parallel.optimizer_shard with parallel.data_parallel > 1.",
        False,
    )
    pp_1f1b_overlap: bool = doc(
        "parallel_speed_up_json: under the 1f1b pipeline schedule, overlap one micro batch's forward "
        "collectives with another's backward compute (all kinds of collective). Needs parallel.pipeline_stage > 1 "
        "with parallel.pipeline_scheduler 1f1b.",
        False,
    )
    enable_allreduce_slice_to_reducescatter: bool = doc(
        "parallel_speed_up_json: an all-reduce whose result is only sliced becomes a reduce-scatter. Needs "
        "parallel.model_parallel > 1.",
        False,
    )
    enable_communication_fusion: bool = doc(
        "parallel_speed_up_json: fuse small collectives of the same kind and group in the Ascend backend "
        "(MindSpore's task-level communication fusion).",
        False,
    )
    computation_communication_fusion_level: int = doc(
        "parallel_speed_up_json: the level of MindSpore's fused MatMul-collective kernels (MatMul with "
        "AllReduce, AllGather with MatMul, MatMul with ReduceScatter: MC2 on Ascend); 0 = off. Needs "
        "parallel.model_parallel > 1.",
        0,
    )

    @property
    def speed_up(self) -> dict:
        """The parallel_speed_up_json options set (MindSpore's names and value types), {} when none is."""
        options = {name: True for name in SPEED_UP_SWITCHES if getattr(self, name)}
        if self.pp_1f1b_overlap:  # MindSpore takes the collectives to overlap as a string here, not a bool
            options["pp_1f1b_overlap"] = PP_1F1B_COLLECTIVES
        if self.computation_communication_fusion_level:
            options["computation_communication_fusion_level"] = self.computation_communication_fusion_level
        return options

    @property
    def comm_fusion(self) -> dict:
        """MindSpore's comm_fusion for set_auto_parallel_context: the collectives fused by their comm_fusion index
        ({} = none). Mode auto: the fusion turned on; its size threshold changes nothing on MindScale's graphs."""
        kinds = {"allreduce": self.allreduce_fusion, "allgather": self.allgather_fusion}
        kinds["reducescatter"] = self.reducescatter_fusion
        return {kind: {"mode": "auto", "config": None} for kind, on in kinds.items() if on}


# the boolean options of MindSpore's parallel_speed_up_json that CommunicationConfig exposes under their own names
SPEED_UP_SWITCHES = (
    "grad_matmul_communication_overlap",
    "recomputation_communication_overlap",
    "grad_computation_allreduce_overlap",
    "computation_allgather_overlap",
    "enable_allreduce_slice_to_reducescatter",
    "enable_communication_fusion",
)
PP_1F1B_COLLECTIVES = "AlltoAll,AlltoAllV,AllGather,ReduceScatter,AllReduce"  # MindSpore's own value for `true`


@dataclass
class TrainConfig:
    micro_batch_size: int = doc("Sequences per device per micro step.", 1)
    global_batch_size: Optional[int] = doc(
        "Sequences per optimizer step; null = micro_batch_size x data_parallel x micro_batch_num "
        "x gradient_accumulation_steps (must equal it when given).",
        None,
    )
    steps: int = doc("Optimizer steps.", 100)
    lr: float = doc("Peak learning rate.", 3e-4)
    min_lr: float = doc("Final learning rate of the decay.", 3e-5)
    warmup_steps: int = doc("Linear warm-up steps.", 0)
    lr_schedule: Literal["cosine", "linear", "constant"] = doc("Decay after warm-up.", "cosine")
    weight_decay: float = doc("AdamW decoupled weight decay (not on norms and biases).", 0.1)
    adam_beta1: float = doc("AdamW beta1.", 0.9)
    adam_beta2: float = doc("AdamW beta2.", 0.95)
    adam_eps: float = doc("AdamW epsilon.", 1e-8)
    grad_clip: float = doc("Global gradient-norm clip; 0 = off.", 1.0)
    loss_scale: Union[str, float, None] = doc(
        "'auto' (dynamic for fp16, none otherwise), 'dynamic', a fixed number, or null.", "auto"
    )
    log_interval: int = doc("Steps between metric lines.", 1)
    max_skipped_steps: int = doc(
        "Consecutive steps skipped for non-finite gradients (fp16 overflow) that stop the run with exit 1 "
        "and a line naming the cause: a loss scale that cannot recover, or a diverged run. A dynamic scale "
        "starting at 2^16 needs at most ~16 halvings to find a usable scale; 0 = never stop. Steps skipped "
        "for loss spikes count too.",
        50,
    )
    loss_spike_factor: Optional[float] = doc(
        "Skip the optimizer update of a step whose loss exceeds this factor x the median loss of the last "
        "50 updated steps (once there are 10), and say so; decided inside the compiled step from the global "
        "loss, before the update. null = off. Not with pipeline stages (only the last holds the loss).",
        None,
    )
    eval_interval: int = doc(
        "Steps between validation passes over data.valid_path or data.valid_blend (and after the last step); "
        "0 = off. A pass is "
        "a forward-only graph, compiled once, over the same held-out batches every time (docs/monitoring.md). "
        "Not with gradient accumulation in a sharded layout.",
        0,
    )
    eval_steps: int = doc(
        "Batches of train.global_batch_size sequences per validation pass: the first eval_steps x "
        "global_batch_size sequences of data.valid_path (or data.valid_blend), in stored order, whatever the "
        "world size.",
        10,
    )


@dataclass
class BlendSource:
    path: Optional[str] = doc("MindRecord folder from tools/preprocess_data.py (required).", None)
    weight: Optional[float] = doc(
        "Relative share of the samples (required, > 0; a blend's weights are normalised).", None
    )


@dataclass
class DataConfig:
    path: str = doc("MindRecord folder from tools/preprocess_data.py, or 'synthetic'.", "synthetic")
    blend: Optional[list[BlendSource]] = doc(
        "Weighted blend of MindRecord folders instead of data.path: a list of {path, weight}. After every step "
        "the samples drawn from each source are within one of weight share x samples so far; a source drawn "
        "past its end starts its next epoch, shuffled anew. All sources need the same tokenizer, fields and "
        "sequence length. The order is an index in <run>/index/ built once (docs/data.md). null = data.path.",
        None,
    )
    valid_path: Optional[str] = doc(
        "Held-out MindRecord folder for train.eval_interval: tools/preprocess_data.py --valid-fraction writes "
        "it as <output>/valid. null = no validation.",
        None,
    )
    valid_blend: Optional[list[BlendSource]] = doc(
        "Weighted blend of held-out folders instead of data.valid_path (a list of {path, weight}, as data.blend). "
        "With several, each source is validated on its own calls, its weight's share of train.eval_steps in whole "
        "steps (at least one), in stored order, and logged with a loss of its own (val_loss_by_source); each must "
        "hold its share.",
        None,
    )
    tokenizer: Optional[str] = doc(
        "SentencePiece .model file or Hugging Face tokenizer folder (tokenizer.json, "
        "tokenizer_config.json); checked against vocab_size and the data's manifest.",
        None,
    )
    shuffle: bool = doc("Shuffle samples deterministically by run.seed.", True)
    verify_checksums: bool = doc(
        "Hash every shard against its manifest's checksum before the first step, by the process that builds the "
        "run's sample index (a resume reuses the index and hashes nothing). false: only each shard's size is "
        "checked (docs/data.md).",
        True,
    )
    eos_id: int = doc("End-of-sequence id used to join documents.", 2)
    pad_id: int = doc("Padding id (ignored in the loss).", 0)
    max_packed_examples: int = doc(
        "Packed SFT data under flash attention: the most examples one packed sample may hold. FlashAttentionScore's "
        "TND layout takes each row's example ends in this many slots plus one for its padding (MindFormers' "
        "eod_pad_length); train.micro_batch_size x (this + 1) must stay within the kernel's 1024 sequences per "
        "call. A sample holding more is refused. Composite attention takes any number.",
        127,
    )


@dataclass
class CheckpointConfig:
    save_interval: int = doc("Steps between checkpoints; 0 = only at the end.", 0)
    keep_last: int = doc("Complete checkpoints kept in the run folder.", 2)
    load_path: Optional[str] = doc(
        "Weights to start from (MindScale checkpoint or Hugging Face folder); optimizer state is not loaded.", None
    )
    resume: bool = doc(
        "Continue from the newest step in the run folder that every rank committed and can read "
        "(an unreadable one is skipped, named on one line).",
        True,
    )
    resume_step: Optional[int] = doc(
        "Resume from exactly this committed step (refused if any rank cannot read "
        "it; later steps leave the run's history).",
        None,
    )
    save_at_end: bool = doc("Save a checkpoint after the last step.", True)
    async_save: bool = doc(
        "Write checkpoints on a background thread from host copies of the tensors (one "
        "more copy of the saved state in host memory); the step is committed at the next "
        "save or the end. metrics.jsonl's save_blocked_s shows what saving cost training.",
        False,
    )


@dataclass
class ProfileConfig:
    enable: bool = doc("Profile steps [start_step, stop_step) with mindspore.profiler.", False)
    start_step: int = doc("First profiled step.", 2)
    stop_step: int = doc("Step after the last profiled step.", 4)


# SFT prompt templates (mindscale/train/data/templates.py registers one per name).
TEMPLATE_NAMES = ("alpaca", "llama2", "llama3", "hf")  # hf: the tokenizer folder's own chat_template


@dataclass
class LoraConfig:
    rank: int = doc("LoRA rank r of the adapters (Hu et al. 2021); 0 = off (full fine-tune).", 0)
    alpha: float = doc("LoRA scale numerator: adapters add alpha/rank * B A x.", 16.0)
    dropout: float = doc("Dropout on the adapters' input during training.", 0.0)
    target_modules: list = doc(
        "Linear layers that get adapters, by name: wq, wk, wv, wo (attention), w1, w2, w3 (MLP; w3 LLaMA only).",
        factory=lambda: ["wq", "wv"],
    )


@dataclass
class FinetuneConfig:
    lora: LoraConfig = doc(
        "Low-rank adapters; with rank > 0 only the adapters train and are saved.", factory=LoraConfig
    )
    hf_dims: bool = doc(
        "Take the model dims from checkpoint.load_path's Hugging Face config.json instead of "
        "model: (seq_length and dtypes stay the config's).",
        False,
    )
    template: Optional[str] = doc(
        "SFT prompt template (alpaca, llama2, llama3, or hf: the tokenizer folder's "
        "chat_template) that tools/generate.py wraps a text prompt in; null = the raw "
        "text after BOS.",
        None,
    )


@dataclass
class Config:
    run: RunConfig = doc("Run identity and backend.", factory=RunConfig)
    hardware: HardwareConfig = doc(
        "Device profile (name of configs/hardware/<name>.yaml or a mapping).", factory=HardwareConfig
    )
    model: ModelConfig = doc("Model dimensions.", factory=ModelConfig)
    parallel: ParallelConfig = doc("Parallel layout.", factory=ParallelConfig)
    recompute: RecomputeConfig = doc("Activation recompute.", factory=RecomputeConfig)
    offload: OffloadConfig = doc("Activation offload to host memory.", factory=OffloadConfig)
    communication: CommunicationConfig = doc(
        "Communication optimisations: multi-copy overlap, fused collectives, MindSpore's overlap passes.",
        factory=CommunicationConfig,
    )
    train: TrainConfig = doc("Optimisation.", factory=TrainConfig)
    data: DataConfig = doc("Training data.", factory=DataConfig)
    checkpoint: CheckpointConfig = doc("Saving and loading.", factory=CheckpointConfig)
    profile: ProfileConfig = doc("Profiler window.", factory=ProfileConfig)
    finetune: FinetuneConfig = doc(
        "Fine-tuning: LoRA adapters, model dims from a Hugging Face checkpoint, the generation prompt template.",
        factory=FinetuneConfig,
    )
    context: dict = doc(
        "Passed to mindspore.set_context as is (jit_level, ...; the memory pool's ceiling is "
        "hardware.max_device_memory_gib).",
        factory=dict,
    )

    @property
    def run_dir(self) -> Path:
        """The run folder, <run.output_dir>/<run.name>: what a run writes goes in it (docs/design.md, "Contracts")."""
        return Path(self.run.output_dir) / self.run.name

    @property
    def devices(self) -> int:
        """parallel.devices."""
        return self.parallel.devices

    @property
    def samples_per_step(self) -> int:
        """Sequences per optimizer step, all ranks and micro batches: micro_batch_size x data_parallel x
        micro_batch_num x gradient_accumulation_steps, which the key train.global_batch_size must equal when
        given (validate.py)."""
        p = self.parallel
        return self.train.micro_batch_size * p.data_parallel * p.micro_batch_num * p.gradient_accumulation_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
