"""Config system: inheritance, overrides, typing, every validation rule, round trip, CLI exit codes."""

import dataclasses
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindscale.config import (
    REPO_ROOT,
    Config,
    ConfigError,
    Layout,
    config_from_tree,
    load_config,
    parse_yaml,
    recompute_layer_counts,
    stage_layer_counts,
    validate_packed,
)

TINY = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_tiny_config_resolves_with_hardware_profile():
    cfg = load_config(TINY)
    assert cfg.model.arch == "llama" and cfg.hardware.name == "cpu"
    assert cfg.hardware.device_target == "CPU" and cfg.hardware.peak_tflops is None
    assert cfg.devices == cfg.parallel.data_parallel
    assert cfg.samples_per_step == cfg.train.micro_batch_size * cfg.parallel.data_parallel


def test_base_inheritance_deep_merges_lists_replace(tmp_path):
    write(
        tmp_path / "root.yaml",
        """
        model: {arch: llama, hidden_size: 64, num_heads: 4, num_layers: 2, ffn_hidden_size: 128,
                vocab_size: 256, seq_length: 32}
        train: {steps: 5, lr: 0.01}
        context: {jit_config: {jit_level: O0}, flags: [a, b]}
    """,
    )
    write(
        tmp_path / "mid.yaml",
        """
        base: root.yaml
        train: {steps: 7}
        context: {flags: [c]}
    """,
    )
    (tmp_path / "sub").mkdir()
    write(
        tmp_path / "sub" / "leaf.yaml",
        """
        base: [../mid.yaml]
        model: {num_layers: 3}
    """,
    )
    cfg = load_config(tmp_path / "sub" / "leaf.yaml")
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 64  # nested merge keeps siblings
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01
    assert cfg.context == {"jit_config": {"jit_level": "O0"}, "flags": ["c"]}  # lists are replaced


def test_multiple_bases_later_wins(tmp_path):
    write(tmp_path / "a.yaml", "train: {steps: 1, lr: 0.1}\n")
    write(tmp_path / "b.yaml", "train: {steps: 2}\n")
    write(tmp_path / "c.yaml", "base: [a.yaml, b.yaml]\nmodel: {hidden_size: 64, num_heads: 4}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.train.steps, cfg.train.lr) == (2, 0.1)


def test_base_cycle_is_detected(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle a.yaml -> b.yaml -> a.yaml"):
        load_config(tmp_path / "a.yaml")


def test_overrides_are_yaml_typed_and_nested():
    cfg = load_config(
        TINY,
        [
            "train.lr=1e-3",
            "parallel.stage_offset=0",
            "model.tie_embeddings=true",
            "recompute.mode=selective",
            "recompute.layers=[1]",
            "context.jit_config.jit_level=O1",
            "checkpoint.load_path=null",
        ],
    )
    assert cfg.train.lr == 1e-3 and cfg.model.tie_embeddings is True
    assert cfg.recompute.layers == [1] and cfg.context["jit_config"]["jit_level"] == "O1"
    assert cfg.checkpoint.load_path is None


def test_override_of_hardware_profile_and_its_fields():
    cfg = load_config(TINY, ["hardware=ascend910b", "hardware.peak_tflops=280"])
    assert cfg.hardware.name == "ascend910b" and cfg.hardware.peak_tflops == 280.0
    assert cfg.hardware.memory_gib == 64.0


def test_round_trip_through_yaml():
    cfg = load_config(TINY, ["recompute.mode=full", "parallel.stage_offset=0"])
    again = config_from_tree(parse_yaml(cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stesp=3"], "unknown key train.stesp; did you mean 'steps'?"),
        (["modle.arch=gpt"], "unknown key modle; did you mean 'model'?"),
        (
            ["model.arch=bert"],
            "model.arch: 'bert' is not one of ['deepseek_v3', 'gpt', 'llama', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe']",
        ),
        (["train.steps=ten"], "train.steps: expected an integer, got 'ten'"),
        (["train.lr=fast"], "train.lr: expected a number"),
        (["model.tie_embeddings=3"], "model.tie_embeddings: expected true/false"),
        (["train.steps=0"], "train.steps=0: must be >= 1"),
        (["train.lr=-1"], "train.lr=-1.0: must be >= 0"),
        (["train.max_skipped_steps=-1"], "train.max_skipped_steps=-1: must be >= 0"),
        (["train.loss_spike_factor=1"], "train.loss_spike_factor=1.0: must be > 1"),
        (
            ["parallel.pipeline_stage=2", "parallel.micro_batch_num=2", "train.loss_spike_factor=3"],
            "train.loss_spike_factor=3.0 needs the loss on every rank before the update",
        ),
        (["train.min_lr=1"], "train.min_lr=1.0 > train.lr="),
        (["train.adam_beta2=1.0"], "train.adam_beta2=1.0: must be in [0, 1)"),
        (["train.loss_scale=huge"], "train.loss_scale='huge'"),
        (["hardware=tpu"], "hardware: 'tpu' is not a profile"),
        (["model.hidden_size=130"], "model.hidden_size=130 is not divisible by model.num_heads=4"),
        (["model.num_kv_heads=3"], "model.num_heads=4 is not divisible by model.num_kv_heads=3"),
        (
            ["parallel.model_parallel=3", "model.num_heads=6", "model.hidden_size=192", "model.num_kv_heads=6"],
            "model.ffn_hidden_size=352 is not divisible by parallel.model_parallel=3",
        ),
        (
            ["parallel.model_parallel=4", "model.num_kv_heads=2"],
            "model.num_kv_heads=2 is not divisible by parallel.model_parallel=4",
        ),
        (
            ["parallel.model_parallel=2", "parallel.vocab_emb_dp=false", "model.vocab_size=2049"],
            "model.vocab_size=2049 is not divisible by parallel.model_parallel=2",
        ),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.model_parallel > 1"),
        (["parallel.micro_batch_num=4"], "parallel.micro_batch_num=4 needs parallel.pipeline_stage > 1"),
        (
            [
                "parallel.optimizer_shard=true",
                "parallel.gradient_accumulation_steps=2",
                "parallel.gradient_accumulation_shard=true",
            ],
            "parallel.gradient_accumulation_shard=true needs parallel.pipeline_stage > 1",
        ),
        (
            [
                "parallel.data_parallel=2",
                "parallel.optimizer_shard=true",
                "parallel.pipeline_stage=2",
                "parallel.micro_batch_num=2",
                "parallel.gradient_accumulation_shard=true",
                "model.tie_embeddings=true",
            ],
            "parallel.gradient_accumulation_shard=true with model.tie_embeddings=true",
        ),
        (
            ["parallel.pipeline_stage=2", "parallel.micro_batch_num=1"],
            "parallel.micro_batch_num=1 < parallel.pipeline_stage=2",
        ),
        (["parallel.pipeline_stage=3", "parallel.micro_batch_num=3"], "parallel.pipeline_stage=3 > model.num_layers=2"),
        (
            ["model.num_layers=5", "parallel.pipeline_stage=2", "parallel.micro_batch_num=2"],
            "offsets must add 1 layers",
        ),
        (
            [
                "model.num_layers=5",
                "parallel.pipeline_stage=2",
                "parallel.micro_batch_num=2",
                "parallel.stage_offset=[1, 1]",
            ],
            "gives layers per stage [3, 3]",
        ),
        (["parallel.stage_offset=[0, 0]"], "parallel.stage_offset=[0, 0]: needs 1 integers"),
        (["recompute.mode=full", "recompute.layers=[1, 1]"], "recompute.layers=[1, 1]: a list needs 1"),
        (["recompute.mode=full", "recompute.layers=[3]"], "stage 0 recomputes 3 layers but holds 2"),
        (
            ["model.arch=mixtral", "model.moe.num_experts=4", "model.moe.top_k=5"],
            "model.moe.top_k=5 with model.moe.num_experts=4: need 1 <= top_k <= num_experts",
        ),
        (
            ["model.arch=mixtral", "model.moe.num_experts=4", "model.moe.num_groups=2"],
            "group-limited routing and the scaling are built for the sigmoid router only",
        ),
        (
            [
                "model.arch=deepseek_v3",
                "model.num_kv_heads=null",
                "model.moe.num_experts=8",
                "model.moe.router=sigmoid",
                "model.moe.num_groups=3",
            ],
            "need num_groups dividing the experts",
        ),
        (
            [
                "model.arch=deepseek_v3",
                "model.num_kv_heads=null",
                "model.moe.num_experts=8",
                "model.moe.router=sigmoid",
                "model.moe.dense_layers=2",
            ],
            "model.moe.dense_layers=2 with model.num_layers=2: need 0 <= dense_layers < num_layers",
        ),
        (
            [
                "model.arch=deepseek_v3",
                "model.num_kv_heads=null",
                "model.moe.num_experts=8",
                "model.moe.router=sigmoid",
                "model.rope_scaling=llama3",
            ],
            "RoPE scaling of multi-head latent attention (DeepSeek-V3's YaRN) is not built",
        ),
        (
            [
                "model.arch=deepseek_v3",
                "model.num_kv_heads=null",
                "model.moe.num_experts=8",
                "model.moe.router=sigmoid",
                "model.mla.v_head_dim=300",
            ],
            "model.mla.v_head_dim=300 exceeds qk_nope_head_dim + qk_rope_head_dim=192",
        ),
        (["model.arch=mixtral"], "model.arch=mixtral is a mixture of experts but model.moe.num_experts=0"),
        (["model.moe.num_experts=4"], "model.moe.num_experts=4 with model.arch=llama, a dense family"),
        (
            [
                "model.arch=mixtral",
                "model.moe.num_experts=6",
                "parallel.expert_parallel=4",
                "parallel.data_parallel=4",
                "hardware=ascend910b",
            ],
            "model.moe.num_experts=6 is not divisible by parallel.expert_parallel=4",
        ),
        (
            ["model.arch=mixtral", "model.moe.num_experts=4", "parallel.expert_parallel=4", "hardware=ascend910b"],
            "parallel.data_parallel=2 is not divisible by parallel.expert_parallel=4",
        ),
        (
            ["model.arch=mixtral", "model.moe.num_experts=4", "parallel.expert_parallel=2"],
            "parallel.expert_parallel=2 on CPU",
        ),
        (["parallel.expert_parallel=2"], "parallel.expert_parallel=2 needs a mixture-of-experts model"),
        (["model.moe.aux_loss_coeff=0.1"], "model.moe.aux_loss_coeff=0.1 with model.arch=llama, a dense family"),
        (["model.moe.bias_update_rate=0.001"], "model.moe.bias_update_rate=0.001 with model.arch=llama, a dense"),
        (
            ["model.arch=mixtral", "model.moe.num_experts=4", "model.moe.capacity_factor=0"],
            "model.moe.capacity_factor=0.0: must be > 0, or null (dropless)",
        ),
        (
            [
                "model.arch=mixtral",
                "model.moe.num_experts=4",
                "parallel.model_parallel=2",
                "model.moe.ffn_hidden_size=33",
            ],
            "model.moe.ffn_hidden_size=33 is not divisible by parallel.model_parallel=2",
        ),
        (
            [
                "model.arch=mixtral",
                "model.moe.num_experts=4",
                "finetune.lora.rank=4",
                "finetune.lora.target_modules=[w1]",
                "checkpoint.load_path=x",
            ],
            "the experts of mixtral are batched [E, F, h] weights",
        ),
        (
            ["train.global_batch_size=7"],
            "train.global_batch_size=7 != train.micro_batch_size=4 x parallel.data_parallel=2",
        ),
        (["model.attention=flash"], "model.attention=flash but hardware 'cpu' has no FlashAttentionScore"),
        (
            ["hardware=ascend910b", "model.attention=flash"],
            "model.attention=flash with model.compute_dtype=float32: FlashAttentionScore takes float16 or bfloat16",
        ),
        (["model.compute_dtype=bfloat16"], "bfloat16 is not supported by MindSpore's CPU MatMul"),
        (
            ["hardware=ascend910a", "model.compute_dtype=bfloat16"],
            "model.compute_dtype=bfloat16 with hardware 'ascend910a' (hardware.soc_version=ascend910): the Ascend 910A has "
            "no bf16 matmul; use float16",
        ),
        (
            ["hardware=ascend910a", "model.param_dtype=bfloat16"],
            "model.param_dtype=bfloat16 with hardware 'ascend910a'",
        ),
        (["profile.enable=true", "profile.start_step=5", "profile.stop_step=5"], "need 0 <= start_step < stop_step"),
        (["train.steps"], "expected dotted.key=value"),
        (
            ["hardware=ascend910b", "hardware.max_device_memory_gib=80"],
            "hardware.max_device_memory_gib=80.0: must be in (0, memory_gib=64.0]",
        ),
        (["hardware=ascend910b", "hardware.memory_reserve_gib=64"], "hardware.memory_reserve_gib=64.0: must be in [0"),
        (
            ["hardware=ascend910b", "parallel.data_parallel=1", "parallel.gradient_accumulation_steps=4"],
            "parallel.gradient_accumulation_steps=4 on one Ascend device: its 4 micro batches would be live at once",
        ),
        (
            ["context.max_device_memory=58GB"],
            "context.max_device_memory='58GB': the pool's ceiling is hardware.max_device_memory_gib",
        ),
        (["train.eval_interval=10"], "train.eval_interval=10 needs data.valid_path"),
        (["train.eval_steps=0"], "train.eval_steps=0: must be >= 1"),
        (["data.max_packed_examples=0"], "data.max_packed_examples=0: must be >= 1"),
        # context parallel: the sequence split's needs (tiny llama: 4 heads, 2 kv heads, seq 128, dp 2)
        (["parallel.context_parallel=0"], "parallel.context_parallel=0: must be >= 1"),
        (
            ["parallel.context_parallel_algo=ulysses_cp"],
            "parallel.context_parallel_algo=ulysses_cp needs parallel.context_parallel > 1",
        ),
        (
            [
                "hardware=ascend910b",
                "model.compute_dtype=bfloat16",
                "train.micro_batch_size=1",
                "parallel.context_parallel=3",
            ],
            "model.seq_length=128 is not divisible by parallel.context_parallel=3",
        ),
        (
            [
                "hardware=ascend910b",
                "model.compute_dtype=bfloat16",
                "train.micro_batch_size=1",
                "parallel.model_parallel=2",
                "model.num_kv_heads=2",
                "parallel.sequence_parallel=true",
                "parallel.context_parallel=4",
                "model.seq_length=36",
            ],
            "model.seq_length=36 is not divisible by parallel.context_parallel=4 x parallel.model_parallel=2 "
            "(sequence_parallel)",
        ),
        (["parallel.context_parallel=2"], "parallel.context_parallel=2 on CPU: it compiles under semi-auto parallel"),
        (
            ["hardware=ascend910b", "train.micro_batch_size=1", "parallel.context_parallel=2"],
            "parallel.context_parallel=2 needs flash attention",
        ),
        (
            ["hardware=ascend910b", "model.compute_dtype=bfloat16", "parallel.context_parallel=2"],
            "parallel.context_parallel=2 with train.micro_batch_size=4: tokens flow as [B*S, h]",
        ),
        (
            [
                "hardware=ascend910b",
                "model.compute_dtype=bfloat16",
                "train.micro_batch_size=1",
                "parallel.context_parallel=2",
                "parallel.model_parallel=2",
                "parallel.context_parallel_algo=ulysses_cp",
            ],
            "model.num_kv_heads=2 is not divisible by parallel.model_parallel=2 x parallel.context_parallel=2 (ulysses_cp",
        ),
        # context_parallel_load_balance: MindSpore's head-tail split needs colossalai_cp, an even c and 2c | S
        (
            ["parallel.context_parallel_load_balance=true"],
            "parallel.context_parallel_load_balance=true without context parallel (parallel.context_parallel=1)",
        ),
        (
            [
                "hardware=ascend910b",
                "model.compute_dtype=bfloat16",
                "train.micro_batch_size=1",
                "parallel.context_parallel=2",
                "parallel.context_parallel_algo=ulysses_cp",
                "parallel.context_parallel_load_balance=true",
            ],
            "parallel.context_parallel_load_balance=true with context_parallel_algo=ulysses_cp",
        ),
        (
            [
                "hardware=ascend910b",
                "model.compute_dtype=bfloat16",
                "train.micro_batch_size=1",
                "model.seq_length=96",
                "parallel.context_parallel=3",
                "parallel.context_parallel_load_balance=true",
            ],
            "parallel.context_parallel_load_balance=true with an odd parallel.context_parallel=3",
        ),
        (
            [
                "hardware=ascend910b",
                "model.compute_dtype=bfloat16",
                "train.micro_batch_size=1",
                "model.seq_length=36",
                "parallel.context_parallel=4",
                "parallel.context_parallel_load_balance=true",
            ],
            "parallel.context_parallel_load_balance=true with model.seq_length=36 not divisible by 2 x "
            "parallel.context_parallel=8",
        ),
        (  # tp2 x cp4: cp ranks 0, 2, 4, 6, and 0 pairs with 6 across the server's halves
            [
                "hardware=ascend910b",
                "model.compute_dtype=bfloat16",
                "train.micro_batch_size=1",
                "parallel.data_parallel=1",
                "parallel.model_parallel=2",
                "parallel.context_parallel=4",
                "parallel.context_parallel_load_balance=true",
            ],
            "parallel.context_parallel_load_balance=true pairs ranks 0 and 6 (cp index 0 with 3), a group MindSpore "
            "2.9 cannot create on Ascend",
        ),
        (
            [
                "train.eval_interval=10",
                "data.valid_path=/v",
                "hardware=ascend910b",
                "parallel.model_parallel=2",
                "parallel.gradient_accumulation_steps=2",
                "model.num_kv_heads=2",
            ],
            "parallel.gradient_accumulation_steps=2 in a sharded layout: MindSpore 2.9 compiles no forward-only graph",
        ),
        # activation offload (tiny llama: 2 layers, one stage)
        (
            ["offload.layers=1"],
            "offload.layers=1 on CPU: MindSpore 2.9 compiles the offload marks there but moves nothing",
        ),
        (["hardware=ascend910b", "offload.layers=-1"], "offload.layers=-1: must be >= 0"),
        (["hardware=ascend910b", "offload.layers=[1, 1]"], "offload.layers=[1, 1]: a list needs 1 non-negative"),
        (
            ["hardware=ascend910b", "recompute.mode=full", "recompute.layers=[1]", "offload.layers=[2]"],
            "offload.layers=[2]: stage 0 holds 2 layers and recomputes 1 (recompute.layers), so it can offload at most 1",
        ),
        (
            ["hardware=ascend910b", "recompute.mode=full", "offload.layers=1"],
            "every layer is recomputed, none is left to offload",
        ),
        (
            ["hardware=ascend910b", "offload.layers=1", "offload.backward_prefetch=0"],
            "offload.backward_prefetch=0: must be >= 1",
        ),
        (
            ["hardware=ascend910b", "offload.layers=1", "hardware.host_link_gbps=null"],
            "offload.layers=1 with hardware 'ascend910b', which gives no host link or host memory",
        ),
        (
            ["hardware=ascend910b", "offload.layers=1", "run.reuse_layer_graph=false"],
            "offload.layers=1 needs run.mode=graph and run.reuse_layer_graph=true",
        ),
        (
            ["hardware=ascend910b", "offload.layers=1", "run.mode=pynative"],
            "offload.layers=1 needs run.mode=graph and run.reuse_layer_graph=true",
        ),
        (
            ["hardware=ascend910b", "offload.layers=1", "context.memory_optimize_level=O1"],
            "offload.layers=1 with context.memory_optimize_level=O1: MindSpore 2.9's SOMAS lays the host copies",
        ),
        # context parallel's rule derives the Layout: the per-stage lists must be checked before it
        (
            [
                "hardware=ascend910b",
                "parallel.context_parallel=2",
                "parallel.pipeline_stage=2",
                "parallel.micro_batch_num=2",
                "recompute.layers=[1, 2, 3]",
            ],
            "recompute.layers=[1, 2, 3]: a list needs 2 non-negative integers, one per parallel.pipeline_stage",
        ),
    ],
)
def test_validation_rule_messages(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_packed_data_is_checked_against_what_flash_attentions_tnd_layout_takes():
    """Only once the data is packed (validate_packed: trainer, evaluator, tools/dryrun.py --packed): a config
    with micro batches too large for TND is fine for unpacked data, and composite attention takes any."""
    flash = ["hardware=ascend910b", "model.compute_dtype=bfloat16"]
    for sets in (
        [*flash, "train.micro_batch_size=8"],
        [*flash, "train.micro_batch_size=2", "data.max_packed_examples=511"],  # 1024: the most it takes
        [*flash, "train.micro_batch_size=16", "model.attention=composite"],
        ["train.micro_batch_size=16"],
    ):
        cfg = load_config(TINY, sets)
        validate_packed(cfg, Layout.of(cfg, "Ascend"))
    for sets, message in [
        (
            [*flash, "train.micro_batch_size=16"],
            "train.micro_batch_size=16 x (data.max_packed_examples=127 + 1) = 2048 sequences",
        ),
        ([*flash, "train.micro_batch_size=2", "data.max_packed_examples=512"], "= 1026 sequences"),
        (
            [*flash, "train.micro_batch_size=1", "parallel.context_parallel=2"],
            "packed SFT data (segment_ids) with parallel.context_parallel=2",
        ),
    ]:
        cfg = load_config(TINY, sets)
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_packed(cfg, Layout.of(cfg, "Ascend"))


def test_stage_and_recompute_layer_counts():
    assert stage_layer_counts(80, 8, 0) == [10] * 8
    assert stage_layer_counts(30, 4, [1, 1, 0, 0]) == [8, 8, 7, 7]
    cfg = load_config(
        TINY,
        [
            "model.num_layers=8",
            "parallel.pipeline_stage=2",
            "parallel.micro_batch_num=2",
            "parallel.data_parallel=1",
            "recompute.mode=selective",
            "recompute.layers=[3, 1]",
        ],
    )
    assert recompute_layer_counts(cfg) == [3, 1]
    assert recompute_layer_counts(load_config(TINY, ["recompute.mode=full", "recompute.layers=1"])) == [1]
    assert recompute_layer_counts(load_config(TINY)) == [0]


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    write(tmp_path / "bad.yaml", "model: {arch: [llama\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "tools/config.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.integration
def test_cli_exit_codes_and_one_line_errors():
    ok = run_cli("--config", str(TINY), "--set", "train.steps=3")
    assert ok.returncode == 0 and "steps: 3" in ok.stdout
    bad = run_cli(
        "--config",
        str(TINY),
        "--set",
        "parallel.model_parallel=3",
        "--set",
        "model.num_heads=32",
        "--set",
        "model.hidden_size=256",
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1
    assert "model.num_heads=32" in bad.stderr and "parallel.model_parallel=3" in bad.stderr
    unknown = run_cli("--config", str(TINY), "--set", "train.lr_shedule=cosine")
    assert unknown.returncode == 2 and "did you mean 'lr_schedule'?" in unknown.stderr


def test_reference_doc_lists_every_key():
    from mindscale.config import reference_markdown

    text = reference_markdown()
    for section in ("run", "model", "parallel", "recompute", "train", "data", "checkpoint", "profile", "finetune"):
        for key, value in vars(getattr(Config(), section)).items():
            keys = [f"{key}.{sub}" for sub in vars(value)] if dataclasses.is_dataclass(value) else [key]
            assert all(f"`{section}.{k}`" in text for k in keys)


def test_template_names_are_the_templates_the_data_pipeline_has():
    """The config validates data.template against TEMPLATE_NAMES without importing the templates."""
    from mindscale.config import TEMPLATE_NAMES
    from mindscale.train.data.templates import TEMPLATE_CHOICES

    assert set(TEMPLATE_NAMES) == set(TEMPLATE_CHOICES)
