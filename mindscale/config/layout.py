"""Every decision derived from a config's parallel layout, computed once (torchtitan's ParallelDims).

`Layout.of(cfg, device, world)` is what the model, the sharding plan, recompute, the train step,
the data pipeline and the planner ask for degrees, micro steps, stages, recomputed layers, the
attention kernel, the CPU kernels and the loss form (sharded or not), instead of deriving them.

Rank order (MindSpore's device matrix, tensor parallel innermost): rank = stage * (dp * cp * tp) +
dp_index * (cp * tp) + cp_index * tp + tp_index. Ranks that differ only in tp_index, cp_index or stage read
the same rows; ranks that differ in cp_index hold different sequence chunks of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindscale.config.schema import Config

# MindSpore's parallel optimizer keeps parameters smaller than this whole (its parallel_optimizer_threshold,
# default 64 KB; passed to it explicitly so the planner and the compiler share one number)
OPTIMIZER_SHARD_MIN_KIB = 64
# The compute dtypes FlashAttentionScore takes for query, key and value, as MindSpore 2.9 documents the op
# (docs/models.md, "Ascend-only kernels"); the dry run does not check kernel dtypes
FLASH_ATTENTION_DTYPES = ("float16", "bfloat16")
# The most sequences one FlashAttentionScore call takes in the TND layout (the length of actual_seq_qlen), as
# MindSpore 2.9 documents the op's input_layout: a rank's micro batch of packed rows gives it
# micro_batch_size x (Layout.packed_examples + 1) (models/attention.py, FlashAttention.sequence_ends)
FLASH_TND_MAX_SEQUENCES = 1024


@dataclass(frozen=True)
class Layout:
    device: str  # Ascend | GPU | CPU: the device the graph is compiled for
    dp: int  # data parallel
    tp: int  # tensor parallel (parallel.model_parallel)
    pp: int  # pipeline stages
    cp: int  # context parallel (parallel.context_parallel): activations split along the sequence
    cp_algo: str  # colossalai_cp (K/V all-gathered) | ulysses_cp (all-to-all to a head split)
    cp_load_balance: bool  # colossalai_cp's queries balanced head-tail by MindSpore (load_balanced_chunks)
    ep: int  # expert parallel: routed experts split over ep of the dp ranks (models/moe.py)
    devices: int  # ranks in all, dp x tp x cp x pp (ParallelConfig.devices)
    micro_batch_size: int
    micro_steps: int  # micro batches per optimizer step (pipeline micro batches or accumulation)
    sharded: bool  # semi-auto parallel: the plan's .shard() strategies are compiled
    data_parallel_mode: bool  # several workers, no strategies: DATA_PARALLEL with an explicit all-reduce
    tp_x: int  # 2D tensor parallel's degrees, tp = tp_x x tp_y (x tp_z) (both 1: 1D; see nd_tp)
    tp_y: int
    tp_z: int  # 3D tensor parallel's third degree, tp = tp_x x tp_y x tp_z (1: 2D or 1D; see nd_tp)
    sp: bool  # sequence parallel (parallel.sequence_parallel, with tp > 1): norms and
    # residual adds split tokens over dp x tp, rowwise outputs reduce-scatter
    optimizer_shard: bool
    accumulation_shard: bool  # gradient-accumulation buffers sharded like the optimizer state
    vocab_parallel: bool  # embedding and output head split over the vocabulary (tp > 1, not vocab_emb_dp)
    attention: str  # flash | composite (auto: flash on Atlas A2 in a dtype FlashAttentionScore takes)
    packed_examples: int | None  # flash: the most examples a packed row may hold (data.max_packed_examples), whose
    # ends FlashAttentionScore's TND layout takes; composite: None (any number)
    fused_norm: bool  # the RmsNorm kernel (Atlas A2) instead of composite RMSNorm
    cpu_kernels: bool  # CPU-only fast paths (models/cpu_kernels.py; the train step's MatMul norm)
    grouped_matmul: bool  # MindSpore's GroupedMatmul kernel for moe.dispatch grouped (none on CPU: a masked loop)
    interleave: int  # model chunks per stage v (parallel.pipeline_interleave)
    scheduler: str  # MindSpore's pipeline scheduler (parallel.pipeline_scheduler)
    stages_of_layers: tuple  # pipeline stage of each decoder layer
    chunks_of_layers: tuple  # which of its stage's v chunks each decoder layer is in (0 .. v-1)
    layers_per_stage: tuple
    recomputed: tuple  # indices of the recomputed decoder layers
    recompute: str  # none | selective | full
    recompute_comm: bool  # recompute.comm: the backward repeats tensor-parallel communication (regathered)
    offloaded: tuple  # indices of the layers whose activations go to host memory (never recomputed ones)
    offload_prefetch: int  # offload.backward_prefetch: operators ahead that a copy back starts
    graph_reuse: str  # layer | model | none: which compiled graph is reused (MindSpore lazy_inline)

    @classmethod
    def of(cls, cfg: Config, device: str | None = None, world: int | None = None) -> "Layout":
        """`device` defaults to the hardware profile's and `world` to the config's device count: the
        layout a run on that hardware compiles. A stand-alone process (world 1) is never sharded."""
        parallel, model = cfg.parallel, cfg.model
        device = device or cfg.hardware.device_target
        world = cfg.devices if world is None else world
        micro_steps = parallel.micro_batch_num if parallel.pipeline_stage > 1 else parallel.gradient_accumulation_steps
        # Accumulation with several workers on an accelerator compiles sharded too, with data-parallel
        # strategies only: the parallel passes make each micro batch's backward end before the next one's
        # forward starts, and reduce the accumulated gradients once. Under DATA_PARALLEL nothing orders the
        # micro batches (docs/launch.md, "Gradient accumulation with several workers"); CPU has only that.
        sharded = world > 1 and (
            parallel.model_parallel > 1
            or parallel.pipeline_stage > 1
            or parallel.context_parallel > 1
            or parallel.expert_parallel > 1
            or (parallel.optimizer_shard and parallel.data_parallel > 1)
            or (micro_steps > 1 and device != "CPU")
        )
        a2_kernels = cfg.hardware.flash_attention and device == "Ascend"
        nd_tp = sharded and parallel.tp_x * parallel.tp_y > 1
        chunks = chunk_layer_counts_of(cfg)
        counts = stage_totals(chunks)
        placed = [
            (stage, chunk)
            for chunk, per_stage in enumerate(chunks)
            for stage, n in enumerate(per_stage)
            for _ in range(n)
        ]
        stages = [stage for stage, _ in placed]
        flash = model.attention == "flash" or (
            model.attention == "auto" and a2_kernels and model.compute_dtype in FLASH_ATTENTION_DTYPES
        )
        recomputed = tuple(_first_layers(recompute_layer_counts(cfg), stages))
        return cls(
            device=device,
            dp=parallel.data_parallel,
            tp=parallel.model_parallel,
            pp=parallel.pipeline_stage,
            cp=parallel.context_parallel,
            cp_algo=parallel.context_parallel_algo,
            cp_load_balance=parallel.context_parallel_load_balance and parallel.context_parallel > 1,
            ep=parallel.expert_parallel,
            devices=cfg.devices,
            micro_batch_size=cfg.train.micro_batch_size,
            micro_steps=micro_steps,
            sharded=sharded,
            data_parallel_mode=world > 1 and not sharded,
            tp_x=parallel.tp_x if nd_tp else 1,
            tp_y=parallel.tp_y if nd_tp else 1,
            tp_z=parallel.tp_z if nd_tp else 1,
            sp=parallel.sequence_parallel and parallel.model_parallel > 1,
            optimizer_shard=parallel.optimizer_shard and parallel.data_parallel > 1,
            accumulation_shard=parallel.gradient_accumulation_shard,
            vocab_parallel=parallel.model_parallel > 1 and not parallel.vocab_emb_dp,
            attention="flash" if flash else "composite",
            packed_examples=cfg.data.max_packed_examples if flash else None,
            # the RmsNorm kernel where the model has RMSNorm, but under 2D tensor parallel, whose residual stream
            # is split along the width RmsNorm normalises over (the composite norm all-reduces its mean)
            fused_norm=(a2_kernels or flash) and not nd_tp,
            cpu_kernels=device == "CPU" and not sharded,
            grouped_matmul=device != "CPU",
            interleave=parallel.pipeline_interleave,
            scheduler=parallel.pipeline_scheduler,
            stages_of_layers=tuple(stages),
            chunks_of_layers=tuple(chunk for _, chunk in placed),
            layers_per_stage=tuple(counts),
            recomputed=recomputed,
            recompute=cfg.recompute.mode,
            recompute_comm=cfg.recompute.comm,
            offloaded=tuple(_first_layers(offload_layer_counts(cfg), stages, skip=recomputed)),
            offload_prefetch=cfg.offload.backward_prefetch,
            graph_reuse=_graph_reuse(cfg, sharded, micro_steps),
        )

    # -- degrees and groups ---------------------------------------------------------------------
    @property
    def stage_devices(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def nd_tp(self) -> bool:
        """2D tensor parallel (parallel.tp_x x tp_y = tp, compiled only sharded): the projections' MatMuls split
        their weights over the x and y degrees and MindSpore replaces each MatMul's all-reduce by an all-gather
        and a reduce-scatter (enable_nd_tp); the residual stream and norms are split along the hidden width over
        (x, y), the attention and MLP inside over (y, x), the tp order of every other op's strategy. 3D (tp_z > 1,
        MindSpore's 3D layout): the stream's tokens split over (z, y) and its width over x, the MLP inside tokens over
        (z, x) and width over y; each projection all-gathers its weight over z (models/layers.py, tp_mesh)."""
        return self.tp_x * self.tp_y > 1

    @property
    def tensor_split(self) -> tuple[int, int, int]:
        """(tp_x, tp_y, tp_z): (1, 1, 1) in 1D, tp_z 1 in 2D."""
        return self.tp_x, self.tp_y, self.tp_z

    @property
    def recomputes_attention_view(self) -> bool:
        """Whether the backward recomputes the flash-attention output's [B·S, heads·d] view that wo reads, rather than
        keep it (models/attention.py, FlashAttention.merge_rows). Kept, it is a second buffer wherever a layer runs as
        a kernel graph of its own (a step of more than 64 layer-graph calls: docs/planner.md, "One kernel graph or
        many"); recomputed, the backward reshapes the output the kernel's backward keeps anyway. At t = 1 that took
        the many-graph step's executed peak from 7,805 to 7,677 MiB (llama2_7b widths, 2 stages, 65 micro batches;
        the one-graph step 7,684). Under tensor parallel it removed nothing and added 80 MiB to the one-graph step
        (llama2_13b widths, tp 2), so it is not done there; nor under ulysses, whose all-to-all reshapes its own."""
        return self.attention == "flash" and self.tp == 1 and not self.ulysses

    @property
    def token_rows(self) -> int:
        """Into how many parts the token dimension of [B*S, h] activations is split: data parallel x context
        parallel. With one row per data-parallel rank (validate.py asks micro_batch_size 1 under cp) part
        dp_index * cp + cp_index is row dp_index's sequence chunk cp_index, i.e. [B, S/cp, h] per rank."""
        return self.dp * self.cp

    @property
    def logit_split(self) -> tuple[int, int]:
        """How the [tokens, vocabulary] logits are split, (rows, vocabulary): over the vocabulary by a
        vocab-parallel head (Megatron's); by a data-parallel head (vocab_emb_dp) under sequence parallel, over
        the tokens of the sequence-parallel split, so each tp rank computes the logits of its own tokens only
        (MindFormers' (dp x mp, 1) head) rather than all-gathering the hidden states, computing all its rows'
        logits and reduce-scattering their gradient back (gpt_1t's last stage compiled one such pair of
        [tokens, h] a micro batch, 12% of its traffic); otherwise over data parallel only."""
        if self.vocab_parallel:
            return self.token_rows, self.tp
        return (self.token_rows * self.tp, 1) if self.sp else (self.token_rows, 1)

    @property
    def row_blocks(self) -> int:
        """Into how many data-parallel blocks of rows the batch of a compiled graph falls: dp in a sharded graph
        (its shapes are global, each rank computing one block), 1 where every worker compiles its own rows."""
        return self.dp if self.sharded else 1

    @property
    def regathered(self) -> tuple:
        """Layers that regather: their column-parallel matmuls all-gather their sequence-parallel input again in the
        backward instead of keeping the forward's gathered copy (recompute.comm under sequence parallel); a fully recomputed
        layer repeats all of its tensor-parallel communication instead (MindSpore's mp_comm_recompute)."""
        if not (self.recompute_comm and self.sp and self.sharded):
            return ()
        full = set(self.recomputed) if self.recompute == "full" else set()
        return tuple(i for i in range(len(self.stages_of_layers)) if i not in full)

    @property
    def ulysses(self) -> bool:
        """Attention on a head split: the all-to-all form of context parallel."""
        return self.cp > 1 and self.cp_algo == "ulysses_cp"

    @property
    def attention_imbalance(self) -> float:
        """The busiest context-parallel rank's causal attention work over the mean rank's, for a long sequence:
        (2c-1)/c under colossalai_cp's contiguous chunks (the last chunk's queries see the most keys, and flash
        skips the masked blocks), 1 with head-tail load balance (load_balanced_chunks), under ulysses_cp (every
        rank attends the whole sequence on its own heads) and without context parallel."""
        if self.cp == 1 or self.ulysses or self.cp_load_balance:
            return 1.0
        return (2 * self.cp - 1) / self.cp

    @property
    def rows_per_step(self) -> int:
        """Rows (sequences) one rank feeds per optimizer step: all its micro batches, stacked."""
        return self.micro_batch_size * self.micro_steps

    @property
    def accumulates_in_graph(self) -> bool:
        """Under the micro-batch marks of MindSpore's Pipeline and GradAccumulation cells (train.loop.step's
        MicroBatches), the compiler accumulates the sharded gradients into `accu_grads` buffers and reduces
        them once per step."""
        return self.sharded and self.micro_steps > 1

    def recomputed_in(self, stage: int) -> int:
        """How many layers of `stage` are recomputed."""
        return sum(1 for i in self.recomputed if self.stages_of_layers[i] == stage)

    def offloaded_in(self, stage: int) -> int:
        """How many layers of `stage` offload their activations to host memory."""
        return sum(1 for i in self.offloaded if self.stages_of_layers[i] == stage)

    def stage_of_rank(self, rank: int) -> int:
        return rank // self.stage_devices

    def data_rank(self, rank: int) -> int:
        """Which data-parallel share of each micro batch `rank` reads (0 .. dp-1)."""
        return rank % self.stage_devices // (self.cp * self.tp)

    def context_rank(self, rank: int) -> int:
        """Which sequence chunk (0 .. cp-1) `rank` holds: context_positions(seq, cp, this)."""
        return rank % (self.cp * self.tp) // self.tp

    def context_ranks(self, rank: int) -> list[int]:
        """The cp group of `rank`: the ranks holding the other sequence chunks of its rows, tp apart."""
        first = rank - self.context_rank(rank) * self.tp
        return [first + i * self.tp for i in range(self.cp)]

    def expert_ranks(self, rank: int) -> list[int]:
        """The ep group of `rank` under grouped dispatch (tp = cp = 1): the ranks of its stage whose data-parallel
        shares differ only in their last ep digit, the inner axis of GroupedExperts' (dp/ep, ep) device matrix."""
        share = self.data_rank(rank)
        first = rank - rank % self.stage_devices + share - share % self.ep
        return [first + i for i in range(self.ep)]

    def load_balance_partner(self, rank: int) -> int:
        """The rank with which `rank` exchanges half its queries under parallel.context_parallel_load_balance:
        cp index c pairs with cp-1-c of the same cp group (load_balanced_chunks)."""
        return self.context_ranks(rank)[self.cp - 1 - self.context_rank(rank)]

    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.stage_devices, (stage + 1) * self.stage_devices)

    @property
    def logging_rank(self) -> int:
        """The rank that writes metrics.jsonl and the step lines: the first of the last pipeline stage, which
        holds the loss (the other stages compute zeros)."""
        return self.stage_ranks(self.pp - 1)[0]

    def layers_of_stage(self, stage: int) -> list[int]:
        """The decoder layers `stage` holds, in order: one block, or with interleave v chunks p apart."""
        return [i for i, s in enumerate(self.stages_of_layers) if s == stage]

    def stage_of(self, path: str) -> int:
        """The stage of a cell or parameter path: embeddings on the first stage, layer i on its stage,
        final norm, head and loss on the last."""
        head, *rest = path.split(".")
        if head == "layers":
            return self.stages_of_layers[int(rest[0])]
        return 0 if head in ("", "tok_embeddings", "pos_embeddings") else self.pp - 1


def _graph_reuse(cfg: Config, sharded: bool, micro_steps: int) -> str:
    """run.reuse_layer_graph: one graph per micro batch when a sharded step has several (MindSpore allows
    lazy_inline only on the outermost cell there), else one graph per decoder-layer kind."""
    if not cfg.run.reuse_layer_graph:
        return "none"
    return "model" if sharded and micro_steps > 1 else "layer"


def _first_layers(counts: list[int], stages_of_layers: list[int], skip: tuple = ()) -> list[int]:
    """Global indices of the first counts[k] layers each stage k holds, passing over `skip`: the recomputed
    layers (skip nothing), then the offloaded ones (skip the recomputed: a layer is never both, MindSpore ignores
    offload on a recomputed op; validate.py refuses a list that would need it)."""
    left, skipped = list(counts), set(skip)
    chosen = []
    for i, stage in enumerate(stages_of_layers):
        if left[stage] and i not in skipped:
            chosen.append(i)
            left[stage] -= 1
    return chosen


def stage_layer_counts(num_layers: int, stages: int, offset: int | list) -> list[int]:
    """Layers per pipeline stage: num_layers // stages plus the stage's offset."""
    offsets = [offset] * stages if isinstance(offset, int) else list(offset)
    return [num_layers // stages + o for o in offsets]


def chunk_layer_counts(num_layers: int, stages: int, interleave: int, offset: int | list) -> list[list[int]]:
    """Layers per model chunk, [chunk][stage]; layers fill chunk 0 of stages 0..p-1, then chunk 1, and so on
    (Megatron's and MindFormers' round-robin). An offset of v lists of p ints is per chunk, on top of
    num_layers // (p x v); an int or p ints is per stage, each stage's layers split evenly over its chunks
    (validate.py refuses a stage count that v does not divide)."""
    if isinstance(offset, list) and offset and isinstance(offset[0], list):
        return [[num_layers // (stages * interleave) + o for o in row] for row in offset]
    return [[n // interleave for n in stage_layer_counts(num_layers, stages, offset)]] * interleave


def chunk_layer_counts_of(cfg: Config) -> list[list[int]]:
    parallel = cfg.parallel
    return chunk_layer_counts(
        cfg.model.num_layers, parallel.pipeline_stage, parallel.pipeline_interleave, parallel.stage_offset
    )


def stage_totals(chunks: list[list[int]]) -> list[int]:
    """Layers each stage holds, over its chunks."""
    return [sum(column) for column in zip(*chunks)]


def recompute_layer_counts(cfg: Config) -> list[int]:
    """Number of recomputed layers in each pipeline stage (0 everywhere when mode is none)."""
    per_stage = stage_totals(chunk_layer_counts_of(cfg))
    if cfg.recompute.mode == "none":
        return [0] * len(per_stage)
    layers = cfg.recompute.layers
    if layers is None:
        return per_stage
    if isinstance(layers, int):
        return [min(layers, n) for n in per_stage]
    return list(layers)


def offload_layer_counts(cfg: Config) -> list[int]:
    """Number of layers each pipeline stage asks to offload (offload.layers per stage; an int for every stage)."""
    layers = cfg.offload.layers
    return list(layers) if isinstance(layers, list) else [layers] * cfg.parallel.pipeline_stage


def context_positions(seq_length: int, cp: int, index: int) -> range:
    """The sequence positions context-parallel rank `index` holds: chunk `index` of cp equal, contiguous
    chunks (MindSpore splits a dimension so; the compiled RoPE tables and the ids follow it). With the causal
    mask, chunk c's queries see (c + 1/2) / cp of the keys on average; load_balanced_chunks evens the work."""
    size = seq_length // cp
    return range(index * size, (index + 1) * size)


def flash_causal_band(seq_length: int, cp: int, index: int) -> tuple[int, int, int]:
    """(sparse_mode, pre_tokens, next_tokens) of FlashAttentionScore on context-parallel rank `index` when
    its queries are chunk `index` of a causal (sparse_mode 2) attention over all seq_length keys: what
    MindSpore 2.9's parallel pass writes into the op (flash_attention_score_info.cc, "left-up causal to
    right-down band"): sparse_mode 4, a band whose right-down aligned diagonal is moved back by the keys
    after the chunk. tests/unit check that this band is the causal mask's rows of the chunk, and
    tests/dryrun that the compiled op carries these numbers."""
    q_len = seq_length // cp
    after = seq_length - (index + 1) * q_len  # keys after the chunk's last query
    return 4, seq_length + after, -after


def load_balanced_chunks(cp: int, index: int) -> tuple[int, int]:
    """Which two of 2·cp equal query chunks context-parallel rank `index` attends under
    parallel.context_parallel_load_balance: MindSpore 2.9's flash attention load balance
    (flash_attention_score_info.cc, ComputeReplaceGraphForLoadBalance) cuts each rank's contiguous chunk in two,
    keeps its first half (chunk 2·index) and takes the second half of rank cp-1-index (chunk 2·cp-1-2·index) by an
    all-gather over the pair, sending that half's output back the same way. Head-tail: every rank gets one chunk
    of the first half of the sequence and one of the second, the same number of causal (query, key) pairs. Each
    half has its own band, flash_causal_band(seq_length, 2 * cp, chunk)."""
    return 2 * index, 2 * cp - 1 - 2 * index


def ascend_pair_groups(first: int, second: int) -> bool:
    """Whether MindSpore 2.9 creates a communication group of these two ranks on Ascend: its
    DeviceManager::CheckDeviceList (device_manager.cc, IsFeasibleDeiveList) takes two ranks of one server of 8 only
    within a half (local ranks 0-3 or 4-7) or 4 apart, and two ranks of two servers only at the same local rank.
    The groups of strategies are whole dimensions of the device matrix and pass; the load balance's pairs may not
    (llama3_1_8b_128k's tp4 x cp8 pairs ranks 0 and 28, a compile failure measured under the dry run)."""
    if first // 8 != second // 8:
        return first % 8 == second % 8
    low, high = sorted((first % 8, second % 8))
    return high - low == 4 or high < 4 or low >= 4
