"""Every rule that can be checked before compiling: ranges and the parallel arithmetic.

`validate(cfg)` raises ConfigError (one line: the key, the value, the fix).
"""

from __future__ import annotations

import dataclasses
import math

from mindscale.config.errors import ConfigError
from mindscale.config.layout import (
    FLASH_ATTENTION_DTYPES,
    FLASH_TND_MAX_SEQUENCES,
    Layout,
    chunk_layer_counts_of,
    offload_layer_counts,
    recompute_layer_counts,
    ascend_pair_groups,
    stage_layer_counts,
    stage_totals,
)
from mindscale.config.schema import TEMPLATE_NAMES, Config, ModelConfig, MoeConfig
from models.archs import ARCHS


def _speed_model(hw) -> None:
    """The planner's speed model keys (docs/planner.md): fractions of the peak in (0, 1], widths and latencies
    not negative."""
    for key in ("matmul_efficiency", "attention_efficiency", "speed_error"):
        value = getattr(hw, key)
        if value is not None and not 0 < value <= 1:
            raise ConfigError(f"hardware.{key}={value}: must be in (0, 1], or null")
    for key in ("matmul_half_width", "vector_ns_per_element", "intra_node_latency_us", "inter_node_latency_us"):
        if getattr(hw, key) < 0:
            raise ConfigError(f"hardware.{key}={getattr(hw, key)}: must be >= 0")


def _memory_pool(cfg: Config) -> None:
    hw = cfg.hardware
    if not 0 <= hw.memory_reserve_gib < hw.memory_gib:
        raise ConfigError(
            f"hardware.memory_reserve_gib={hw.memory_reserve_gib}: must be in [0, memory_gib={hw.memory_gib})"
        )
    if hw.max_device_memory_gib is not None and not 0 < hw.max_device_memory_gib <= hw.memory_gib:
        raise ConfigError(
            f"hardware.max_device_memory_gib={hw.max_device_memory_gib}: must be in (0, memory_gib="
            f"{hw.memory_gib}], or null for memory_gib - memory_reserve_gib"
        )
    if "max_device_memory" in cfg.context:
        raise ConfigError(
            f"context.max_device_memory={cfg.context['max_device_memory']!r}: the pool's ceiling is "
            "hardware.max_device_memory_gib (the planner budgets the same number); set that instead"
        )


def _positive(cfg: Config) -> None:
    for section, names in {
        "model": ["vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "seq_length"],
        "parallel": [
            "data_parallel",
            "model_parallel",
            "context_parallel",
            "pipeline_stage",
            "micro_batch_num",
            "pipeline_interleave",
            "gradient_accumulation_steps",
            "tp_x",
            "tp_y",
            "tp_z",
        ],
        "train": ["micro_batch_size", "steps", "log_interval"],
        "checkpoint": ["keep_last", "resume_step"],
        "run": ["stop_vote_interval"],
        "data": ["max_packed_examples"],
    }.items():
        for name in names:
            value = getattr(getattr(cfg, section), name)
            if value is not None and value < 1:
                raise ConfigError(f"{section}.{name}={value}: must be >= 1")
    for key, value in [
        ("model.rope_theta", cfg.model.rope_theta),
        ("model.norm_eps", cfg.model.norm_eps),
        ("model.init_std", cfg.model.init_std),
        ("hardware.memory_gib", cfg.hardware.memory_gib),
        ("hardware.failures_per_device_hour", cfg.hardware.failures_per_device_hour),
        ("hardware.storage_gbps", cfg.hardware.storage_gbps),
    ]:
        if value <= 0:
            raise ConfigError(f"{key}={value}: must be > 0")
    for key, value in [
        ("train.lr", cfg.train.lr),
        ("train.min_lr", cfg.train.min_lr),
        ("train.weight_decay", cfg.train.weight_decay),
        ("train.grad_clip", cfg.train.grad_clip),
        ("train.warmup_steps", cfg.train.warmup_steps),
        ("train.max_skipped_steps", cfg.train.max_skipped_steps),
        ("run.max_restarts", cfg.run.max_restarts),
        ("run.hang_timeout_s", cfg.run.hang_timeout_s),
        ("checkpoint.save_interval", cfg.checkpoint.save_interval),
        ("hardware.requeue_s", cfg.hardware.requeue_s),
        ("hardware.relaunch_s", cfg.hardware.relaunch_s),
    ]:
        if value < 0:
            raise ConfigError(f"{key}={value}: must be >= 0")
    if cfg.train.min_lr > cfg.train.lr:
        raise ConfigError(f"train.min_lr={cfg.train.min_lr} > train.lr={cfg.train.lr}: min_lr must not exceed lr")
    for key, value in [("train.adam_beta1", cfg.train.adam_beta1), ("train.adam_beta2", cfg.train.adam_beta2)]:
        if not 0 <= value < 1:
            raise ConfigError(f"{key}={value}: must be in [0, 1)")
    _memory_pool(cfg)
    if not 0 < cfg.hardware.memory_margin <= 1:
        raise ConfigError(f"hardware.memory_margin={cfg.hardware.memory_margin}: must be in (0, 1]")
    if cfg.hardware.peak_tflops is not None and cfg.hardware.peak_tflops <= 0:
        raise ConfigError(f"hardware.peak_tflops={cfg.hardware.peak_tflops}: must be > 0 or null (measure)")
    _speed_model(cfg.hardware)
    ls = cfg.train.loss_scale
    if isinstance(ls, str) and ls not in ("auto", "dynamic"):
        raise ConfigError(f"train.loss_scale={ls!r}: use 'auto', 'dynamic', a number or null")
    if isinstance(ls, float) and ls <= 0:
        raise ConfigError(f"train.loss_scale={ls}: a fixed loss scale must be > 0")
    factor = cfg.train.loss_spike_factor
    if factor is not None and factor <= 1:
        raise ConfigError(f"train.loss_spike_factor={factor}: must be > 1 (a multiple of the median loss) or null")
    if factor is not None and cfg.parallel.pipeline_stage > 1:
        raise ConfigError(
            f"train.loss_spike_factor={factor} needs the loss on every rank before the update, but with "
            f"parallel.pipeline_stage={cfg.parallel.pipeline_stage} only the last stage has it; set it "
            "to null"
        )
    if cfg.run.max_restarts and not cfg.checkpoint.resume:
        raise ConfigError(
            f"run.max_restarts={cfg.run.max_restarts} needs checkpoint.resume=true (a restart resumes "
            "from the newest committed checkpoint); set checkpoint.resume=true or run.max_restarts=0"
        )
    if cfg.profile.enable and not 0 <= cfg.profile.start_step < cfg.profile.stop_step:
        raise ConfigError(
            f"profile.start_step={cfg.profile.start_step}, profile.stop_step={cfg.profile.stop_step}: "
            "need 0 <= start_step < stop_step"
        )


def _blends(cfg: Config) -> None:
    """data.blend / data.valid_blend: a non-empty list of {path, weight > 0}, distinct paths, not next to the
    single-folder key it replaces."""
    for blend, single, unset in (("blend", "path", "synthetic"), ("valid_blend", "valid_path", None)):
        entries = getattr(cfg.data, blend)
        if entries is None:
            continue
        if not entries:
            raise ConfigError(f"data.{blend} is an empty list; list {{path, weight}} sources or set it to null")
        if getattr(cfg.data, single) != unset:
            raise ConfigError(
                f"data.{blend} and data.{single}={getattr(cfg.data, single)} are both set; a blend "
                f"replaces data.{single}: remove one (a single folder is a blend of one)"
            )
        seen = {}
        for i, entry in enumerate(entries):
            where = f"data.{blend}[{i}]"
            if not entry.path:
                raise ConfigError(f"{where} has no path; give each source {{path: FOLDER, weight: W}}")
            if entry.path == "synthetic":
                raise ConfigError(
                    f"{where}.path=synthetic: synthetic data cannot be blended; use MindRecord "
                    "folders, or data.path=synthetic alone"
                )
            if entry.weight is None:
                raise ConfigError(f"{where} ({entry.path}) has no weight; give each source a weight > 0")
            if not entry.weight > 0 or entry.weight == float("inf"):
                raise ConfigError(
                    f"{where}.weight={entry.weight}: must be a finite number > 0 (a share of the "
                    "samples; drop the source to leave it out)"
                )
            if entry.path in seen:
                raise ConfigError(
                    f"{where}.path={entry.path} repeats data.{blend}[{seen[entry.path]}]; list a "
                    "folder once and add the weights"
                )
            seen[entry.path] = i


def _evaluation(cfg: Config) -> None:
    train = cfg.train
    if train.eval_interval < 0:
        raise ConfigError(f"train.eval_interval={train.eval_interval}: must be >= 0 (0 = no validation)")
    if train.eval_steps < 1:
        raise ConfigError(f"train.eval_steps={train.eval_steps}: must be >= 1")
    if not train.eval_interval:
        return
    if (not cfg.data.valid_path or cfg.data.valid_path == "synthetic") and not cfg.data.valid_blend:
        raise ConfigError(
            f"train.eval_interval={train.eval_interval} needs data.valid_path (a held-out MindRecord "
            "folder: tools/preprocess_data.py --valid-fraction writes <output>/valid); set it, or "
            "set train.eval_interval=0"
        )
    if cfg.parallel.pipeline_stage == 1 and Layout.of(cfg).accumulates_in_graph:
        raise ConfigError(
            f"train.eval_interval={train.eval_interval} with parallel.gradient_accumulation_steps="
            f"{cfg.parallel.gradient_accumulation_steps} in a sharded layout: MindSpore 2.9 compiles no "
            "forward-only graph with gradient accumulation under semi-auto parallel (\"Current not "
            "support predict with grad_accu\", docs/monitoring.md); set gradient_accumulation_steps=1 "
            "or train.eval_interval=0"
        )


def _model_shapes(model: ModelConfig) -> None:
    if model.head_dim is not None and not model.spec.free_head_dim:
        raise ConfigError(
            f"model.head_dim={model.head_dim}: {model.arch} heads are hidden_size/num_heads wide; remove it"
        )
    if model.head_dim is None and not model.spec.mla and model.hidden_size % model.num_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads="
            f"{model.num_heads}; pick a head count that divides the width"
        )
    if model.num_heads % model.kv_heads:
        raise ConfigError(
            f"model.num_heads={model.num_heads} is not divisible by model.num_kv_heads={model.kv_heads}; "
            "GQA needs a whole number of query heads per kv head"
        )
    if model.head_size % 2 and model.spec.rotary:
        raise ConfigError(
            f"the head width {model.head_size} (model.head_dim, or hidden_size/num_heads) is odd; rotary "
            "embeddings need an even head dim"
        )
    if not model.spec.grouped_query and model.num_kv_heads not in (None, model.num_heads):
        raise ConfigError(f"model.num_kv_heads={model.num_kv_heads}: {model.arch} uses multi-head attention; remove it")
    if model.rope_scaling != "none" and not model.spec.rotary:
        raise ConfigError(
            f"model.rope_scaling={model.rope_scaling}: {model.arch} has learned positions, not RoPE; remove it"
        )
    if model.rope_scaling == "llama3" and not (
        model.rope_scaling_factor >= 1
        and 0 < model.rope_low_freq_factor < model.rope_high_freq_factor
        and model.rope_original_max_positions > 0
    ):
        raise ConfigError(
            f"model.rope_scaling=llama3 needs rope_scaling_factor >= 1, 0 < rope_low_freq_factor < "
            f"rope_high_freq_factor and rope_original_max_positions > 0 (got "
            f"{model.rope_scaling_params}); use the values of the checkpoint's config.json"
        )


def _multi_token_prediction(cfg: Config) -> None:
    """model.mtp_depth / mtp_loss_weight: non-negative, DeepSeek-V3 only, at least one position left to predict
    from, and a whole sequence on each rank (the modules shift the tokens along it)."""
    model = cfg.model
    for key in ("mtp_depth", "mtp_loss_weight"):
        if getattr(model, key) < 0:
            raise ConfigError(
                f"model.{key}={getattr(model, key)}: must be >= 0" + (" (0 = off)" if key == "mtp_depth" else "")
            )
    if not model.mtp_depth:
        return
    if model.arch != "deepseek_v3":
        raise ConfigError(
            f"model.mtp_depth={model.mtp_depth} with model.arch={model.arch}: multi-token prediction is built for "
            "deepseek_v3 only; set mtp_depth to 0"
        )
    if model.mtp_depth >= model.seq_length:
        raise ConfigError(
            f"model.mtp_depth={model.mtp_depth} >= model.seq_length={model.seq_length}: module k predicts from "
            "the first seq_length - k positions only; lower mtp_depth"
        )
    if cfg.parallel.context_parallel > 1:
        raise ConfigError(
            f"model.mtp_depth={model.mtp_depth} with parallel.context_parallel={cfg.parallel.context_parallel}: "
            "the modules shift the tokens along the sequence, which context parallel splits; set mtp_depth to 0 or "
            "context_parallel to 1"
        )


def _latent_attention(model: ModelConfig) -> None:
    """model.mla of a multi-head latent attention family (DeepSeek-V3): positive widths, an even rotary part,
    no RoPE scaling (YaRN is not built)."""
    if not model.spec.mla:
        return
    mla = model.mla
    widths = {
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "q_lora_rank": 1 if mla.q_lora_rank is None else mla.q_lora_rank,
    }
    bad = [f"model.mla.{key}={value}" for key, value in widths.items() if value < 1]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: must be >= 1 (q_lora_rank may be null)")
    if mla.qk_rope_head_dim % 2:
        raise ConfigError(
            f"model.mla.qk_rope_head_dim={mla.qk_rope_head_dim} is odd; rotary embeddings need an even width"
        )
    if mla.v_head_dim > mla.qk_head_dim:
        raise ConfigError(
            f"model.mla.v_head_dim={mla.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim="
            f"{mla.qk_head_dim}: the values are padded to the query width for the attention core; "
            "use a narrower v_head_dim"
        )
    if model.head_dim is not None:
        raise ConfigError(f"model.head_dim={model.head_dim}: {model.arch}'s head widths are model.mla's; remove it")
    if model.rope_scaling != "none":
        raise ConfigError(
            f"model.rope_scaling={model.rope_scaling} with {model.arch}: RoPE scaling of multi-head "
            "latent attention (DeepSeek-V3's YaRN) is not built; set it to none"
        )


def _grouped_dispatch(cfg: Config) -> None:
    """model.moe.dispatch grouped: dropless by construction; its self-defined shard splits rows over data
    parallel and experts over ep only (models/moe.py, GroupedExperts)."""
    moe, par = cfg.model.moe, cfg.parallel
    if moe.dispatch != "grouped":
        return
    if moe.capacity_factor is not None:
        raise ConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor} with model.moe.dispatch=grouped, which drops no "
            "token; set capacity_factor to null or dispatch to capacity"
        )
    if par.model_parallel > 1 or par.context_parallel > 1:
        raise ConfigError(
            f"model.moe.dispatch=grouped with parallel.model_parallel={par.model_parallel}, context_parallel="
            f"{par.context_parallel}: its experts split over expert_parallel only; set both to 1 or dispatch "
            "to capacity"
        )


def _router(cfg: Config) -> None:
    """The sigmoid router's groups and the dense first layers (DeepSeek-V3)."""
    model, moe = cfg.model, cfg.model.moe
    if moe.router == "softmax" and (moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) != (1, 1, 1.0):
        raise ConfigError(
            f"model.moe.num_groups={moe.num_groups}, topk_groups={moe.topk_groups}, routed_scaling_factor="
            f"{moe.routed_scaling_factor} with router softmax: group-limited routing and the scaling "
            "are built for the sigmoid router only; set router: sigmoid or remove them"
        )
    if not (moe.num_groups >= 1 and moe.num_experts % moe.num_groups == 0 and 1 <= moe.topk_groups <= moe.num_groups):
        raise ConfigError(
            f"model.moe.num_groups={moe.num_groups}, topk_groups={moe.topk_groups} with num_experts="
            f"{moe.num_experts}: need num_groups dividing the experts and 1 <= topk_groups <= num_groups"
        )
    per_group = moe.num_experts // moe.num_groups
    if moe.num_groups > 1 and (per_group < 2 or moe.top_k > moe.topk_groups * per_group):
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} with {moe.topk_groups} of {moe.num_groups} groups of "
            f"{per_group} experts: a group needs >= 2 experts (scored by its best two) and the kept "
            "groups >= top_k experts; choose fewer groups or a smaller top_k"
        )
    if not moe.routed_scaling_factor > 0:
        raise ConfigError(f"model.moe.routed_scaling_factor={moe.routed_scaling_factor}: must be > 0")
    if not 0 <= moe.dense_layers < model.num_layers:
        raise ConfigError(
            f"model.moe.dense_layers={moe.dense_layers} with model.num_layers={model.num_layers}: "
            "need 0 <= dense_layers < num_layers (at least one layer of experts)"
        )


def _no_moe_keys(cfg: Config) -> None:
    """A dense family has no router or experts: a model.moe key set on it would be silently ignored."""
    defaults = MoeConfig()
    for field in dataclasses.fields(MoeConfig):
        value = getattr(cfg.model.moe, field.name)
        if value != getattr(defaults, field.name):
            raise ConfigError(
                f"model.moe.{field.name}={value} with model.arch={cfg.model.arch}, a dense family, which has no "
                f"experts to apply it to; remove it, or use a mixture-of-experts arch"
            )


def _experts(cfg: Config) -> None:
    """model.moe and parallel.expert_parallel: an MoE family has experts, a dense one has none, and the expert
    split divides what it splits."""
    model, moe, ep = cfg.model, cfg.model.moe, cfg.parallel.expert_parallel
    if model.spec.moe and moe.num_experts <= 0:
        raise ConfigError(
            f"model.arch={model.arch} is a mixture of experts but model.moe.num_experts="
            f"{moe.num_experts}; set model.moe.num_experts (and top_k)"
        )
    if moe.num_experts and not model.spec.moe:
        moe_archs = [name for name, spec in ARCHS.items() if spec.moe]
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} with model.arch={model.arch}, a dense family; use "
            f"an MoE arch ({', '.join(moe_archs)}) or set num_experts to 0"
        )
    if ep < 1:
        raise ConfigError(f"parallel.expert_parallel={ep}: must be >= 1")
    if not model.spec.moe:
        if ep > 1:
            raise ConfigError(
                f"parallel.expert_parallel={ep} needs a mixture-of-experts model "
                "(model.moe.num_experts > 0); set it to 1"
            )
        _no_moe_keys(cfg)
        return
    if moe.num_experts < 0 or not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} with model.moe.num_experts={moe.num_experts}: need 1 <= "
            "top_k <= num_experts (a token is routed to k distinct experts)"
        )
    for key, value in [
        ("model.moe.ffn_hidden_size", moe.ffn_hidden_size),
        ("model.moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size),
    ]:
        if value is not None and value < 0:
            raise ConfigError(f"{key}={value}: must be >= 1 (or null/0 where it may be)")
    _router(cfg)
    _grouped_dispatch(cfg)
    for key in ("aux_loss_coeff", "seq_aux_loss_coeff", "bias_update_rate"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)}: must be >= 0 (0 = off)")
    if moe.bias_update_rate and cfg.train.eval_interval:
        raise ConfigError(
            f"model.moe.bias_update_rate={moe.bias_update_rate} with train.eval_interval="
            f"{cfg.train.eval_interval}: the held-out passes would add their tokens to the next step's expert "
            "counts; set eval_interval to 0 or bias_update_rate to 0"
        )
    if moe.bias_update_rate and moe.router != "sigmoid":
        raise ConfigError(
            f"model.moe.bias_update_rate={moe.bias_update_rate} with model.moe.router={moe.router}: only the "
            "sigmoid router has a bias to update; set bias_update_rate to 0 or use router: sigmoid"
        )
    if moe.capacity_factor is not None and not moe.capacity_factor > 0:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor}: must be > 0, or null (dropless)")
    if moe.num_experts % ep:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.expert_parallel="
            f"{ep}; choose an expert_parallel that divides the experts"
        )
    if cfg.parallel.data_parallel % ep:
        raise ConfigError(
            f"parallel.data_parallel={cfg.parallel.data_parallel} is not divisible by "
            f"parallel.expert_parallel={ep} (experts split over data-parallel ranks); choose an "
            "expert_parallel that divides data_parallel"
        )
    if ep > 1 and cfg.hardware.device_target == "CPU":
        raise ConfigError(
            f"parallel.expert_parallel={ep} on CPU: it compiles under semi-auto parallel, which "
            "MindSpore refuses on CPU; set expert_parallel=1 (data-parallel MoE runs on CPU), or use "
            "an Ascend hardware profile (tools/dryrun.py compiles it here)"
        )


def _tensor_parallel(cfg: Config) -> None:
    """parallel.model_parallel divides every width it splits; sequence parallel needs it and splits the sequence."""
    model, parallel = cfg.model, cfg.parallel
    mp = parallel.model_parallel
    for key, value in [
        ("model.num_heads", model.num_heads),
        ("model.num_kv_heads", model.kv_heads),
        ("model.ffn_hidden_size", model.ffn_hidden_size),
        *([("model.moe.ffn_hidden_size", model.moe.expert_ffn(model.ffn_hidden_size))] if model.spec.moe else []),
        *(
            [("model.moe.shared_expert_ffn_hidden_size", model.moe.shared_expert_ffn_hidden_size)]
            if model.moe.shared_expert_ffn_hidden_size
            else []
        ),
    ]:
        if value % mp:
            raise ConfigError(
                f"{key}={value} is not divisible by parallel.model_parallel={mp}; "
                f"choose a model_parallel that divides {value}"
            )
    if model.vocab_size % mp:  # the sharded loss splits the vocabulary over model_parallel, vocab_emb_dp or not
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} is not divisible by parallel.model_parallel={mp}; "
            f"pad the vocabulary to a multiple of {mp} (Megatron pads 50257 to 50304) or lower "
            "model_parallel"
        )
    if parallel.sequence_parallel and mp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.model_parallel > 1; set it to false")
    if parallel.sequence_parallel and model.seq_length % mp:
        raise ConfigError(
            f"model.seq_length={model.seq_length} is not divisible by parallel.model_parallel={mp} "
            "(sequence_parallel); change one of them"
        )


ND_TP_ARCHS = ("llama", "qwen2", "qwen3")  # whose projections, norms and residual adds have 2D/3D strategies


def _nd_tensor_parallel(cfg: Config) -> None:
    """parallel.tp_x x tp_y (x tp_z): 2D/3D tensor parallel of the LLaMA and Qwen projections (models/layers.py,
    Linear.nd_tp_strategies), compiled by MindSpore's dry run with and without pipeline stages (tests/dryrun/
    test_nd_tensor_parallel.py, 2D with context parallel and recompute.comm too)."""
    model, parallel = cfg.model, cfg.parallel
    tp_x, tp_y, tp_z, mp = parallel.tp_x, parallel.tp_y, parallel.tp_z, parallel.model_parallel
    if (tp_x, tp_y, tp_z) == (1, 1, 1):
        return
    three = tp_z > 1
    keys = f"parallel.tp_x={tp_x} x parallel.tp_y={tp_y}" + (f" x parallel.tp_z={tp_z}" if three else "")
    name = "3D tensor parallel" if three else "2D tensor parallel"
    leave = "or leave tp_x, tp_y and tp_z at 1 (1D tensor parallel)"
    if tp_x < 2 or tp_y < 2:
        raise ConfigError(f"{keys}: {name} needs tp_x and tp_y >= 2; set both, {leave}")
    if tp_x * tp_y * tp_z != mp:
        raise ConfigError(
            f"{keys} = {tp_x * tp_y * tp_z} is not the tensor degree parallel.model_parallel={mp}; choose degrees "
            f"whose product is model_parallel, {leave}"
        )
    if cfg.hardware.device_target == "CPU":
        raise ConfigError(
            f"{keys} on CPU: {name} compiles only under semi-auto parallel, which MindSpore refuses on "
            f"CPU; use an Ascend hardware profile (tools/dryrun.py compiles it here), {leave}"
        )
    if model.arch not in ND_TP_ARCHS:
        raise ConfigError(
            f"{keys} with model.arch={model.arch}: {name} is built for {', '.join(ND_TP_ARCHS)} only "
            f"(their layers have 2D/3D strategies); use one of them, {leave}"
        )
    if model.hidden_size % mp:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by parallel.model_parallel={mp} ({keys} splits "
            f"the projections' weights over all of them); choose degrees that divide it, {leave}"
        )
    if cfg.finetune.lora.rank:
        raise ConfigError(
            f"{keys} with finetune.lora.rank={cfg.finetune.lora.rank}: the LoRA adapters' strategies are 1D "
            f"(models/lora.py), so they would read the {name[:2]} projections' inputs and outputs through "
            f"redistributions; fine-tune with 1D tensor parallel: {leave.removeprefix('or ')}"
        )
    if parallel.sequence_parallel:
        raise ConfigError(
            f"{keys} with parallel.sequence_parallel=true: {name} already splits the residual stream and "
            f"norms over all t ranks, so sequence parallel has nothing left to split; set it to false, {leave}"
        )
    tokens = cfg.train.micro_batch_size * model.seq_length // parallel.context_parallel
    split = tp_z * math.lcm(tp_x, tp_y)
    if three and tokens % split:
        raise ConfigError(
            f"{keys}: a rank's {tokens} tokens per micro batch (train.micro_batch_size x model.seq_length / "
            f"parallel.context_parallel) are not divisible by tp_z x lcm(tp_x, tp_y) = {split} (3D tensor parallel "
            f"splits the residual stream's tokens over z and y, the projections' outputs over z and x); change "
            f"micro_batch_size or seq_length, {leave}"
        )


def _context_parallel(cfg: Config) -> None:
    """parallel.context_parallel: what the sequence split needs from the other keys."""
    model, parallel = cfg.model, cfg.parallel
    cp, mp = parallel.context_parallel, parallel.model_parallel
    if cp == 1:
        if parallel.context_parallel_algo != "colossalai_cp":
            raise ConfigError(
                f"parallel.context_parallel_algo={parallel.context_parallel_algo} needs "
                "parallel.context_parallel > 1; set context_parallel or drop the algorithm"
            )
        if parallel.context_parallel_load_balance:
            raise ConfigError(
                "parallel.context_parallel_load_balance=true without context parallel "
                "(parallel.context_parallel=1): there are no sequence chunks to balance; set context_parallel "
                "to an even degree > 1, or turn the load balance off"
            )
        return
    split = cp * mp if parallel.sequence_parallel else cp
    if model.seq_length % split:
        what = (
            f"parallel.context_parallel={cp} x parallel.model_parallel={mp} (sequence_parallel)"
            if parallel.sequence_parallel
            else f"parallel.context_parallel={cp}"
        )
        raise ConfigError(
            f"model.seq_length={model.seq_length} is not divisible by {what}; pick a context_parallel "
            f"that divides the sequence, or a seq_length that is a multiple of {split}"
        )
    if cfg.hardware.device_target == "CPU":
        raise ConfigError(
            f"parallel.context_parallel={cp} on CPU: it compiles under semi-auto parallel, which "
            "MindSpore refuses on CPU; set context_parallel=1, or use an Ascend hardware profile "
            "(tools/dryrun.py compiles it here)"
        )
    if Layout.of(cfg).attention != "flash":
        raise ConfigError(
            f"parallel.context_parallel={cp} needs flash attention (FlashAttentionScore shards "
            "its queries along the sequence and bands the causal mask per rank); use a 910B profile "
            "with model.attention=auto or flash and compute_dtype bfloat16 or float16"
        )
    if cfg.train.micro_batch_size != 1:
        raise ConfigError(
            f"parallel.context_parallel={cp} with train.micro_batch_size="
            f"{cfg.train.micro_batch_size}: tokens flow as [B*S, h] split over data_parallel x "
            "context_parallel, each rank's sequence chunk only with one row per data-parallel rank; "
            "set micro_batch_size=1 and raise micro_batch_num or gradient_accumulation_steps"
        )
    _context_parallel_load_balance(cfg)
    if parallel.context_parallel_algo == "ulysses_cp":
        for key, value in [("model.num_heads", model.num_heads), ("model.num_kv_heads", model.kv_heads)]:
            if value % (mp * cp):
                raise ConfigError(
                    f"{key}={value} is not divisible by parallel.model_parallel={mp} x "
                    f"parallel.context_parallel={cp} (ulysses_cp splits heads over both); use "
                    "context_parallel_algo=colossalai_cp or a smaller context_parallel"
                )


def _context_parallel_load_balance(cfg: Config) -> None:
    """parallel.context_parallel_load_balance (context_parallel > 1): MindSpore's load balance of colossalai_cp's
    queries, which splits each rank's chunk in two and pairs rank i with rank c-1-i."""
    parallel, seq = cfg.parallel, cfg.model.seq_length
    cp = parallel.context_parallel
    if not parallel.context_parallel_load_balance:
        return
    if parallel.context_parallel_algo != "colossalai_cp":
        raise ConfigError(
            f"parallel.context_parallel_load_balance=true with context_parallel_algo={parallel.context_parallel_algo}: "
            "every ulysses rank attends the whole sequence on its own heads, so its work is already balanced; "
            "turn the load balance off, or use context_parallel_algo=colossalai_cp"
        )
    if cp % 2:
        raise ConfigError(
            f"parallel.context_parallel_load_balance=true with an odd parallel.context_parallel={cp}: MindSpore "
            "pairs rank i with rank c-1-i and fails to compile the middle rank paired with itself (duplicate "
            "ranks in its exchange group); use an even context_parallel, or turn the load balance off"
        )
    if seq % (2 * cp):
        raise ConfigError(
            f"parallel.context_parallel_load_balance=true with model.seq_length={seq} not divisible by 2 x "
            f"parallel.context_parallel={2 * cp}: each rank's chunk is cut into two equal halves; use a "
            f"seq_length that is a multiple of {2 * cp}, or turn the load balance off"
        )
    layout = Layout.of(cfg)
    for rank in range(layout.devices):
        partner = layout.load_balance_partner(rank)
        if not ascend_pair_groups(rank, partner):
            index = layout.context_rank(rank)
            raise ConfigError(
                f"parallel.context_parallel_load_balance=true pairs ranks {rank} and {partner} (cp index {index} "
                f"with {cp - 1 - index}), a group MindSpore 2.9 cannot create on Ascend (two ranks of one server of 8 "
                "must share a half or be 4 apart, two of two servers the same local rank); use a model_parallel "
                "that is a multiple of 8 or a cp group inside half a server, or turn the load balance off"
            )


def _gradient_accumulation(cfg: Config) -> None:
    """parallel.gradient_accumulation_steps without a pipeline, and where parallel.gradient_accumulation_shard
    compiles."""
    parallel = cfg.parallel
    pp = parallel.pipeline_stage
    if pp > 1 and parallel.gradient_accumulation_steps > 1:
        raise ConfigError(
            f"parallel.gradient_accumulation_steps={parallel.gradient_accumulation_steps} with "
            f"parallel.pipeline_stage={pp}: a pipeline accumulates its micro batches; raise "
            "parallel.micro_batch_num instead and set gradient_accumulation_steps to 1"
        )
    if parallel.gradient_accumulation_shard and not (parallel.optimizer_shard and parallel.data_parallel > 1):
        raise ConfigError(
            "parallel.gradient_accumulation_shard=true needs parallel.optimizer_shard=true and "
            "parallel.data_parallel > 1 (it shards the buffers like the optimizer state); set it false"
        )
    if parallel.gradient_accumulation_shard and pp == 1:
        raise ConfigError(
            "parallel.gradient_accumulation_shard=true needs parallel.pipeline_stage > 1: with "
            "accumulation alone MindSpore 2.9 takes time exponential in the layer count to compile "
            "it (docs/dryrun.md); set it false, or use pipeline stages"
        )
    if parallel.gradient_accumulation_shard and cfg.model.tie_embeddings:
        raise ConfigError(
            "parallel.gradient_accumulation_shard=true with model.tie_embeddings=true: MindSpore 2.9 "
            "shards the shared embedding's accumulation buffer twice and the compile fails "
            "(docs/dryrun.md); set gradient_accumulation_shard false"
        )
    if parallel.gradient_accumulation_shard and not cfg.run.reuse_layer_graph:
        raise ConfigError(
            "parallel.gradient_accumulation_shard=true needs run.reuse_layer_graph=true (MindSpore "
            "shards accumulation buffers only in a reused, lazy_inline graph)"
        )


def _pipeline_schedule(cfg: Config) -> None:
    """The pipeline's micro batches, chunks per stage (parallel.pipeline_interleave) and scheduler."""
    parallel = cfg.parallel
    pp = parallel.pipeline_stage
    if pp == 1 and parallel.micro_batch_num != 1:
        raise ConfigError(
            f"parallel.micro_batch_num={parallel.micro_batch_num} needs parallel.pipeline_stage > 1; "
            "use parallel.gradient_accumulation_steps without a pipeline"
        )
    if pp > 1 and parallel.micro_batch_num < pp:
        raise ConfigError(
            f"parallel.micro_batch_num={parallel.micro_batch_num} < parallel.pipeline_stage={pp}: "
            "the pipeline would idle; use at least as many micro batches as stages"
        )
    v = parallel.pipeline_interleave
    if v > 1 and pp == 1:
        raise ConfigError(
            f"parallel.pipeline_interleave={v} needs parallel.pipeline_stage > 1 (it splits each "
            "stage into chunks); set it to 1"
        )
    if parallel.pipeline_scheduler != "1f1b" and v == 1:
        raise ConfigError(
            f"parallel.pipeline_scheduler={parallel.pipeline_scheduler} needs "
            "parallel.pipeline_interleave > 1 (MindSpore 2.9 allows only 1f1b without interleave); set "
            "the scheduler to 1f1b"
        )
    if v > 1 and not cfg.run.reuse_layer_graph:
        # MindSpore 2.9 (dry run): "Using pipeline parallel with interleave, should enable lazy_inline."
        raise ConfigError(
            f"parallel.pipeline_interleave={v} needs run.reuse_layer_graph=true (MindSpore "
            "interleaves only a lazy_inline graph); set it to true or pipeline_interleave to 1"
        )
    if parallel.pipeline_scheduler == "zero_bubble_v":
        # MindSpore 2.9's ZBV check (dry run): "When the segment is 1, the stage must be configured in
        # descending order"; Layout places chunks round-robin, not in the V it needs (docs/dryrun.md)
        raise ConfigError(
            "parallel.pipeline_scheduler=zero_bubble_v needs its chunks placed in a V (the second "
            "chunk on the stages in descending order), which MindScale does not build; use 1f1b, "
            "gpipe, seqpipe, seqvpp or seqsmartvpp"
        )


def _stage_offset(cfg: Config) -> None:
    """parallel.stage_offset (per stage, or per chunk: v lists) leaves every stage, or chunk, at least one layer and
    places all of them; without per-chunk offsets v divides each stage's layers."""
    model, parallel = cfg.model, cfg.parallel
    pp, v = parallel.pipeline_stage, parallel.pipeline_interleave
    per_chunk = isinstance(parallel.stage_offset, list) and any(isinstance(o, list) for o in parallel.stage_offset)
    rows = parallel.stage_offset if per_chunk else [parallel.stage_offset]
    if per_chunk and len(rows) != v:
        raise ConfigError(
            f"parallel.stage_offset={parallel.stage_offset}: a list of lists is per chunk and needs "
            f"{v} lists (parallel.pipeline_interleave) of {pp} integers"
        )
    for row in rows:
        if isinstance(row, list) and (
            len(row) != pp or not all(isinstance(o, int) and not isinstance(o, bool) for o in row)
        ):
            raise ConfigError(
                f"parallel.stage_offset={parallel.stage_offset}: needs {pp} integers "
                f"(one per parallel.pipeline_stage){' in each list' if per_chunk else ''}"
            )
    if pp > model.num_layers:
        raise ConfigError(f"parallel.pipeline_stage={pp} > model.num_layers={model.num_layers}; use fewer stages")
    if not per_chunk:
        counts = stage_layer_counts(model.num_layers, pp, parallel.stage_offset)
        if sum(counts) != model.num_layers or min(counts) < 1:
            raise ConfigError(
                f"parallel.stage_offset={parallel.stage_offset} gives layers per stage {counts} "
                f"(sum {sum(counts)}) for model.num_layers={model.num_layers} over "
                f"parallel.pipeline_stage={pp}; offsets must add "
                f"{model.num_layers - (model.num_layers // pp) * pp} layers in all and leave every stage "
                "at least one"
            )
        if any(n % v for n in counts):
            raise ConfigError(
                f"parallel.pipeline_interleave={v} does not divide the layers per stage {counts} "
                f"(model.num_layers={model.num_layers}, parallel.stage_offset="
                f"{parallel.stage_offset}); pick a v that divides them, or give parallel.stage_offset "
                "per chunk (v lists)"
            )
    chunks = chunk_layer_counts_of(cfg)
    if per_chunk and (sum(map(sum, chunks)) != model.num_layers or min(map(min, chunks)) < 1):
        raise ConfigError(
            f"parallel.stage_offset={parallel.stage_offset} gives layers per chunk {chunks} "
            f"(sum {sum(map(sum, chunks))}) for model.num_layers={model.num_layers} over "
            f"parallel.pipeline_stage={pp} x parallel.pipeline_interleave={v}; offsets must add "
            f"{model.num_layers - (model.num_layers // (pp * v)) * pp * v} layers in all and leave every "
            "chunk at least one"
        )


def _recompute_layers(cfg: Config) -> None:
    """recompute.layers: a count, null (all), or one count per stage of at most the layers the stage holds."""
    recompute, pp = cfg.recompute, cfg.parallel.pipeline_stage
    if isinstance(recompute.layers, list):
        if len(recompute.layers) != pp or not all(isinstance(n, int) and 0 <= n for n in recompute.layers):
            raise ConfigError(
                f"recompute.layers={recompute.layers}: a list needs {pp} non-negative integers, "
                "one per parallel.pipeline_stage"
            )
        counts = stage_totals(chunk_layer_counts_of(cfg))
        for stage, (n, have) in enumerate(zip(recompute.layers, counts)):
            if n > have:
                raise ConfigError(
                    f"recompute.layers={recompute.layers}: stage {stage} recomputes {n} layers "
                    f"but holds {have}; lower it"
                )
    elif isinstance(recompute.layers, int) and recompute.layers < 0:
        raise ConfigError(f"recompute.layers={recompute.layers}: must be >= 0 or null (all layers)")


def _global_batch(cfg: Config) -> None:
    """train.global_batch_size, when given, is the product of the batch keys."""
    parallel, train = cfg.parallel, cfg.train
    derived = cfg.samples_per_step
    if train.global_batch_size is not None and train.global_batch_size != derived:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} != train.micro_batch_size={train.micro_batch_size} x "
            f"parallel.data_parallel={parallel.data_parallel} x parallel.micro_batch_num={parallel.micro_batch_num} x "
            f"parallel.gradient_accumulation_steps={parallel.gradient_accumulation_steps} = {derived}; "
            "change one of them or drop global_batch_size"
        )


def _offload(cfg: Config) -> None:
    """offload.layers: how many per stage, beside the recomputed layers, and where MindSpore offloads at all."""
    offload, pp = cfg.offload, cfg.parallel.pipeline_stage
    if isinstance(offload.layers, list):
        if len(offload.layers) != pp or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in offload.layers
        ):
            raise ConfigError(
                f"offload.layers={offload.layers}: a list needs {pp} non-negative integers, one per "
                "parallel.pipeline_stage"
            )
        held = stage_totals(chunk_layer_counts_of(cfg))
        for stage, (n, r, have) in enumerate(zip(offload.layers, recompute_layer_counts(cfg), held)):
            if n + r > have:
                raise ConfigError(
                    f"offload.layers={offload.layers}: stage {stage} holds {have} layers and recomputes "
                    f"{r} (recompute.layers), so it can offload at most {have - r}, not {n} (a layer is "
                    "recomputed or offloaded, never both); lower one of them"
                )
    elif offload.layers < 0:
        raise ConfigError(f"offload.layers={offload.layers}: must be >= 0 (0 = none) or a list of one count per stage")
    if offload.backward_prefetch < 1:
        raise ConfigError(
            f"offload.backward_prefetch={offload.backward_prefetch}: must be >= 1 (operators ahead of "
            "the backward op that reads an offloaded activation)"
        )
    if not any(offload_layer_counts(cfg)):
        return
    if not Layout.of(cfg).offloaded:  # (offload_layer_counts asks for some, recompute left none)
        raise ConfigError(
            f"offload.layers={offload.layers} with recompute.mode={cfg.recompute.mode} and "
            f"recompute.layers={cfg.recompute.layers}: every layer is recomputed, none is left to "
            "offload; recompute fewer layers or set offload.layers=0"
        )
    if cfg.hardware.device_target == "CPU":
        raise ConfigError(
            f"offload.layers={offload.layers} on CPU: MindSpore 2.9 compiles the offload marks there "
            "but moves nothing to host memory (no MoveTo in the graph; tests/models/test_offload.py); "
            "set offload.layers=0, or use an Ascend hardware profile"
        )
    hw = cfg.hardware
    if not hw.host_link_gbps or not hw.host_memory_gib:
        raise ConfigError(
            f"offload.layers={offload.layers} with hardware {hw.name!r}, which gives no host link or "
            "host memory (hardware.host_link_gbps, hardware.host_memory_gib): the planner cannot count "
            "the offload; set both in the profile or set offload.layers=0"
        )
    if cfg.run.mode != "graph" or not cfg.run.reuse_layer_graph:
        raise ConfigError(
            f"offload.layers={offload.layers} needs run.mode=graph and run.reuse_layer_graph=true "
            "(MindSpore offloads activations only inside a lazy_inline graph, in graph mode); set them, "
            "or offload.layers=0"
        )
    if cfg.context.get("memory_optimize_level") == "O1":
        raise ConfigError(
            f"offload.layers={offload.layers} with context.memory_optimize_level=O1: MindSpore 2.9's SOMAS lays "
            "the host copies in device memory, so offload frees none (docs/dryrun.md, Device memory); drop "
            "memory_optimize_level (O0, the default) or set offload.layers=0"
        )


def _speed_up_needs(cfg: Config) -> dict[str, tuple[bool, str]]:
    """Each parallel_speed_up_json option of communication: -> (whether the layout has what it overlaps, what
    it needs)."""
    p, layout = cfg.parallel, Layout.of(cfg)
    tensor = (layout.tp > 1, "parallel.model_parallel > 1 (tensor-parallel collectives)")
    return {
        "grad_matmul_communication_overlap": tensor,
        # MindSpore 2.9 marks the recomputed layers' collectives (recompute_subgraph_id) only in reused graphs:
        # an inlined loss network compiles with none (measured, docs/communication.md)
        "recomputation_communication_overlap": (
            layout.tp > 1 and layout.recompute == "full" and bool(layout.recomputed) and layout.graph_reuse != "none",
            "recompute.mode=full (recomputed layers), parallel.model_parallel > 1 and run.reuse_layer_graph=true",
        ),
        "grad_computation_allreduce_overlap": (
            layout.dp > 1 and not layout.optimizer_shard,
            "parallel.data_parallel > 1 without parallel.optimizer_shard (a gradient all-reduce)",
        ),
        "computation_allgather_overlap": (
            layout.optimizer_shard,
            "parallel.optimizer_shard=true with parallel.data_parallel > 1 (the shard's weight all-gathers)",
        ),
        "pp_1f1b_overlap": (
            layout.pp > 1 and p.pipeline_scheduler == "1f1b",
            "parallel.pipeline_stage > 1 with parallel.pipeline_scheduler=1f1b",
        ),
        "enable_allreduce_slice_to_reducescatter": tensor,
        "enable_communication_fusion": (True, ""),
        "computation_communication_fusion_level": tensor,
    }


def _communication(cfg: Config) -> None:
    """communication: what each option overlaps or fuses must exist in the layout (docs/communication.md)."""
    comm, p = cfg.communication, cfg.parallel
    n = comm.micro_batch_interleave
    if n < 1:
        raise ConfigError(f"communication.micro_batch_interleave={n}: must be >= 1 (1 = off)")
    if comm.computation_communication_fusion_level < 0:
        raise ConfigError(
            f"communication.computation_communication_fusion_level={comm.computation_communication_fusion_level}: "
            "must be >= 0 (0 = off)"
        )
    asked = [f"communication.{key}" for key in comm.speed_up]
    asked += [f"communication.{kind}_fusion" for kind in comm.comm_fusion]
    asked += [f"communication.micro_batch_interleave={n}"] if n != 1 else []
    if not asked:
        return
    if cfg.hardware.device_target != "Ascend":
        raise ConfigError(
            f"{', '.join(asked)} with hardware {cfg.hardware.name!r} ({cfg.hardware.device_target}): MindSpore "
            "applies these in semi-auto parallel on Ascend only; remove them, or use an Ascend hardware profile"
        )
    if not Layout.of(cfg).sharded:
        raise ConfigError(
            f"{', '.join(asked)} with a layout that is not sharded (one device, or data parallel only: "
            f"{p.replica_product('parallel.')}): MindSpore applies these to semi-auto-parallel graphs only; remove "
            "them, or shard the model"
        )
    _copies(cfg)
    for kind in ("allgather", "reducescatter"):
        if kind in comm.comm_fusion and not Layout.of(cfg).optimizer_shard:
            raise ConfigError(
                f"communication.{kind}_fusion=true without the optimizer shard, whose {kind}s it fuses; set "
                "parallel.optimizer_shard=true (with data_parallel > 1), or turn it off"
            )
    needs = _speed_up_needs(cfg)
    for key in comm.speed_up:
        fits, need = needs[key]
        if not fits:
            raise ConfigError(
                f"communication.{key} needs {need}, which this layout ({p.replica_product('parallel.')}, "
                f"parallel.data_parallel={p.data_parallel}) lacks: there is nothing for it to overlap; turn it off"
            )


def _copies(cfg: Config) -> None:
    """communication.micro_batch_interleave on a sharded Ascend layout: collectives to hide, rows to split, and an
    inlined loss network, where MindSpore interleaves the copies."""
    n = cfg.communication.micro_batch_interleave
    if n == 1:
        return
    if cfg.parallel.model_parallel == 1:
        raise ConfigError(
            f"communication.micro_batch_interleave={n} with parallel.model_parallel=1: the copies overlap "
            "tensor-parallel collectives, and there are none; set micro_batch_interleave=1, or model_parallel > 1"
        )
    if cfg.run.reuse_layer_graph:
        raise ConfigError(
            f"communication.micro_batch_interleave={n} with run.reuse_layer_graph=true: MindSpore 2.9 interleaves "
            "the copies only in an inlined loss network (through reused graphs the compiled graph carries none of "
            "its micro_interleaved_index labels, so nothing orders one copy's collectives against the other's "
            "compute; docs/communication.md); set run.reuse_layer_graph=false, or micro_batch_interleave=1"
        )
    steps = cfg.parallel.gradient_accumulation_steps
    if cfg.parallel.pipeline_stage == 1 and steps > 1:
        raise ConfigError(
            f"communication.micro_batch_interleave={n} with parallel.gradient_accumulation_steps={steps} and no "
            "pipeline stages: MindSpore 2.9's micro-interleave pass fails on the accumulation's micro-batch loop "
            "(\"Cannot find micro info for node ... MicroBatches\", measured under the dry run); set "
            "parallel.gradient_accumulation_steps=1 (a larger micro batch), parallel.pipeline_stage > 1, or "
            "micro_batch_interleave=1"
        )
    if cfg.train.micro_batch_size % n:
        raise ConfigError(
            f"communication.micro_batch_interleave={n} does not divide train.micro_batch_size="
            f"{cfg.train.micro_batch_size} (each copy takes micro_batch_size/{n} rows); set micro_batch_size to "
            f"a multiple of {n}, or micro_batch_interleave=1"
        )


def _backend(cfg: Config) -> None:
    if cfg.model.attention == "flash" and not cfg.hardware.flash_attention:
        raise ConfigError(
            f"model.attention=flash but hardware {cfg.hardware.name!r} has no FlashAttentionScore "
            "(Atlas A2 only); use model.attention=auto or composite"
        )
    if cfg.hardware.device_target == "CPU" and cfg.model.compute_dtype == "bfloat16":
        raise ConfigError(
            "model.compute_dtype=bfloat16 is not supported by MindSpore's CPU MatMul; use float32 or float16 on CPU"
        )
    bf16 = [
        f"model.{key}=bfloat16" for key in ("compute_dtype", "param_dtype") if getattr(cfg.model, key) == "bfloat16"
    ]
    if bf16 and cfg.hardware.soc_version == "ascend910":
        raise ConfigError(
            f"{' and '.join(bf16)} with hardware {cfg.hardware.name!r} (hardware.soc_version=ascend910): "
            "the Ascend 910A has no bf16 matmul; use float16 (train.loss_scale=auto makes the loss "
            "scale dynamic) or a 910B profile (hardware=ascend910b)"
        )


def _kernel_dtypes(cfg: Config) -> None:
    """The Ascend-only kernels a config can force, in a dtype they do not take (docs/models.md,
    "Ascend-only kernels"). The fused RmsNorm is not here: every norm feeds it fp32, which it takes."""
    model = cfg.model
    if (
        model.attention == "flash"
        and cfg.hardware.flash_attention
        and model.compute_dtype not in FLASH_ATTENTION_DTYPES
    ):
        raise ConfigError(
            f"model.attention=flash with model.compute_dtype={model.compute_dtype}: FlashAttentionScore "
            f"takes {' or '.join(FLASH_ATTENTION_DTYPES)} only (docs/models.md); set "
            "model.compute_dtype=bfloat16, or model.attention=auto (composite attention under float32)"
        )


def _accumulation_on_one_device(cfg: Config) -> None:
    """One Ascend/GPU device with gradient accumulation: nothing orders the micro batches (semi-auto
    parallel, which does, needs several devices), so the step holds them all at once, as one batch of
    g x the rows would (docs/launch.md, "Gradient accumulation with several workers")."""
    g, mbs = cfg.parallel.gradient_accumulation_steps, cfg.train.micro_batch_size
    if g > 1 and cfg.devices == 1 and cfg.hardware.device_target != "CPU":
        raise ConfigError(
            f"parallel.gradient_accumulation_steps={g} on one {cfg.hardware.device_target} device: "
            f"its {g} micro batches would be live at once (only semi-auto parallel, on 2+ devices, "
            f"orders them); set train.micro_batch_size={mbs * g} and gradient_accumulation_steps=1 "
            "(the same memory and numbers, one graph), or use 2+ devices"
        )


def _finetune(cfg: Config) -> None:
    finetune, lora = cfg.finetune, cfg.finetune.lora
    if lora.rank < 0:
        raise ConfigError(f"finetune.lora.rank={lora.rank}: must be >= 0 (0 = no LoRA)")
    if lora.alpha <= 0:
        raise ConfigError(f"finetune.lora.alpha={lora.alpha}: must be > 0")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"finetune.lora.dropout={lora.dropout}: must be in [0, 1)")
    allowed = cfg.model.spec.lora_targets
    wrong = [t for t in lora.target_modules if t not in allowed]
    if wrong and cfg.model.spec.moe and lora.rank:
        raise ConfigError(
            f"finetune.lora.target_modules={lora.target_modules}: the experts of {cfg.model.arch} are "
            "batched [E, F, h] weights, not the Linear layers LoRA adapts (per-expert adapters are not "
            f"built); target attention only, a subset of {list(allowed)}"
        )
    if lora.rank and (wrong or not lora.target_modules):  # unchecked when off: MLA has no wv for the default
        raise ConfigError(
            f"finetune.lora.target_modules={lora.target_modules}: use a non-empty subset of "
            f"{list(allowed)} for model.arch={cfg.model.arch}"
        )
    if lora.rank and not cfg.checkpoint.load_path:
        raise ConfigError(
            f"finetune.lora.rank={lora.rank} needs checkpoint.load_path (the frozen base weights, "
            "loaded again on resume); set it or set finetune.lora.rank=0"
        )
    if finetune.hf_dims and not cfg.checkpoint.load_path:
        raise ConfigError(
            "finetune.hf_dims=true needs checkpoint.load_path (a Hugging Face folder); set it or "
            "set finetune.hf_dims=false"
        )
    if finetune.template is not None and finetune.template not in TEMPLATE_NAMES:
        raise ConfigError(f"finetune.template={finetune.template!r}: use one of {sorted(TEMPLATE_NAMES)} or null")


def validate_packed(cfg: Config, layout: Layout) -> None:
    """Packed SFT data (segment_ids), checked once the data is known to be packed (the trainer, the evaluator,
    tools/dryrun.py --packed): what flash attention's TND layout needs (models/attention.py, FlashAttention)."""
    if layout.attention != "flash":
        return
    if layout.cp > 1:
        raise ConfigError(
            f"packed SFT data (segment_ids) with parallel.context_parallel={layout.cp}: flash "
            "attention's TND layout is built here for whole sequences only (MindSpore 2.9 splits "
            "TND tokens along a sequence only under a Layout strategy); set context_parallel=1, or "
            "preprocess without --pack"
        )
    sequences = cfg.train.micro_batch_size * (layout.packed_examples + 1)
    if sequences > FLASH_TND_MAX_SEQUENCES:
        mbs = cfg.train.micro_batch_size
        raise ConfigError(
            f"packed SFT data with flash attention: train.micro_batch_size={mbs} x "
            f"(data.max_packed_examples={layout.packed_examples} + 1) = {sequences} sequences per "
            f"FlashAttentionScore call, over the {FLASH_TND_MAX_SEQUENCES} MindSpore 2.9 documents for "
            "its TND layout; lower micro_batch_size (raise micro_batch_num) or max_packed_examples"
        )


def validate(cfg: Config) -> None:
    """Every rule that can be checked before compiling. Raises ConfigError (one line)."""
    _positive(cfg)
    _finetune(cfg)
    _model_shapes(cfg.model)
    _latent_attention(cfg.model)
    _multi_token_prediction(cfg)
    _experts(cfg)
    _tensor_parallel(cfg)
    _nd_tensor_parallel(cfg)
    _gradient_accumulation(cfg)
    _pipeline_schedule(cfg)
    _stage_offset(cfg)
    _recompute_layers(cfg)
    _global_batch(cfg)
    _context_parallel(cfg)  # after the rules Layout.of relies on: it derives the attention kernel
    _offload(cfg)
    _communication(cfg)
    _blends(cfg)
    _evaluation(cfg)
    _kernel_dtypes(cfg)
    _accumulation_on_one_device(cfg)
    _backend(cfg)
