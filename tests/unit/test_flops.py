"""mindscale/perf/flops.py against published numbers: parameter counts, the Megatron FLOPs formulas, and
the MFU/HFU figures of Korthikanti et al. 2022 and PaLM (Chowdhery et al. 2022)."""

import math

import pytest

from mindscale.perf import flops, mfu, planner
from mindscale.config import REPO_ROOT, Layout, ModelConfig, load_config


def llama(vocab, h, layers, heads, ffn, kv=None, seq=4096):
    return ModelConfig(
        arch="llama",
        vocab_size=vocab,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        seq_length=seq,
    )


def gpt(h, layers, heads, vocab=51200, seq=2048):
    return ModelConfig(
        arch="gpt",
        vocab_size=vocab,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        ffn_hidden_size=4 * h,
        seq_length=seq,
        tie_embeddings=True,
    )


# Released checkpoints' parameter counts (Hugging Face model cards / safetensors index totals).
LLAMA = {
    "llama2_7b": (llama(32000, 4096, 32, 32, 11008), 6_738_415_616),
    "llama2_13b": (llama(32000, 5120, 40, 40, 13824), 13_015_864_320),
    "llama2_70b": (llama(32000, 8192, 80, 64, 28672, kv=8), 68_976_648_192),
    "llama3_8b": (llama(128256, 4096, 32, 32, 14336, kv=8, seq=8192), 8_030_261_248),
    "llama3_70b": (llama(128256, 8192, 80, 64, 28672, kv=8, seq=8192), 70_553_706_496),
    "llama3_405b": (llama(128256, 16384, 126, 128, 53248, kv=8, seq=8192), 405_853_388_800),
}


@pytest.mark.parametrize("name", sorted(LLAMA))
def test_llama_parameter_counts_are_exact(name):
    model, published = LLAMA[name]
    assert flops.param_count(model) == published


def test_llama2_7b_count_by_hand():
    """Per layer 4h² attention + 3·h·f SwiGLU + 2h norms; untied embedding and output; final norm."""
    h, f, v, layers = 4096, 11008, 32000, 32
    assert flops.param_count(LLAMA["llama2_7b"][0]) == layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h


def _sig(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


@pytest.mark.parametrize(
    "h,layers,heads,label,digits",
    [(768, 12, 12, 125e6, 3), (2048, 24, 16, 1.3e9, 2), (5120, 40, 40, 13e9, 2), (12288, 96, 96, 175e9, 3)],
)
def test_gpt3_table_2_1_sizes_to_the_papers_rounding(h, layers, heads, label, digits):
    """GPT-3 Table 2.1 (vocab 50,257, context 2048; 13B at the consistent width 40 x 128 = 5120)."""
    assert _sig(flops.param_count(gpt(h, layers, heads, vocab=50257)), digits) == label


@pytest.mark.parametrize(
    "h,layers,heads,billions",
    [
        (6144, 40, 48, 18.4),
        (8192, 48, 64, 39.1),
        (10240, 60, 80, 76.1),
        (12288, 80, 96, 145.6),
        (16384, 96, 128, 310.1),
        (20480, 105, 128, 529.6),
        (25600, 128, 160, 1008.0),
    ],
)
def test_narayanan_2021_table_1_parameter_counts(h, layers, heads, billions):
    """Narayanan et al. 2021 Table 1 (vocab 51,200, seq 2048), to its 0.1B rounding."""
    assert round(flops.param_count(gpt(h, layers, heads)) / 1e9, 1) == billions


def test_matmul_params_exclude_embedding_lookup_and_positions_but_count_tied_output_once():
    m = gpt(768, 12, 12, vocab=50257)
    assert flops.matmul_param_count(m) == 12 * 12 * 768**2 + 50257 * 768
    untied = llama(32000, 4096, 32, 32, 11008)
    assert flops.param_count(untied) - flops.matmul_param_count(untied) == 32000 * 4096 + 65 * 4096


# The Megatron papers' GPTs (h, L, heads): 22B, GPT-3 175B, 530B, 1T (Korthikanti et al. 2022 Table 3).
MEGATRON = {"22B": (6144, 48, 64), "175B": (12288, 96, 96), "530B": (20480, 105, 128), "1T": (25600, 128, 160)}


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_generalised_flops_equal_the_papers_formulas_for_mha_gpt(name):
    h, layers, heads = MEGATRON[name]
    m, batch, seq, vocab = gpt(h, layers, heads), 512, 2048, 51200
    tokens = batch * seq
    cases = [
        ("none", flops.megatron_model_flops_per_iteration),
        ("selective", flops.korthikanti_selective_flops_per_iteration),
        ("full", flops.narayanan_full_flops_per_iteration),
    ]
    for mode, paper in cases:
        ours = flops.hardware_flops_per_token(m, mode, 0 if mode == "none" else layers) * tokens
        assert ours == pytest.approx(paper(batch, layers, seq, h, vocab), rel=1e-12), mode
    assert flops.model_flops_per_token(m) * tokens == pytest.approx(
        flops.megatron_model_flops_per_iteration(batch, layers, seq, h, vocab), rel=1e-12
    )


def test_gqa_and_swiglu_generalise_through_the_matmul_count():
    m = LLAMA["llama2_70b"][0]
    n = flops.matmul_param_count(m)
    attention = 12 * 80 * 64 * 128 * 4096
    assert flops.model_flops_per_token(m) == 6 * n + attention
    # full recompute: one more forward of every layer (2·N_layers + 4·H·Q·T each), output layer not redone
    layer_n = n - 32000 * 8192
    full = flops.hardware_flops_per_token(m, "full", 80)
    assert full == pytest.approx(8 * layer_n + 6 * 32000 * 8192 + attention * 16 / 12)
    assert flops.hardware_flops_per_token(m, "selective", 80) == pytest.approx(6 * n + 2 * attention)


def test_partial_recompute_scales_with_recomputed_layers():
    m = LLAMA["llama2_7b"][0]
    extra_all = flops.recompute_flops_per_token(m, "full", 32)
    assert flops.recompute_flops_per_token(m, "full", 8) == pytest.approx(extra_all / 4)
    assert flops.recompute_flops_per_token(m, "none", 0) == 0
    assert flops.hardware_flops_per_token(m, "full", 0) == flops.model_flops_per_token(m)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_int_recompute_layers_count_per_pipeline_stage(mode):
    """recompute.layers: 1 over 4 stages of 2 layers recomputes the first layer of every stage: the
    Layout says 4 layers, and HFU counts 4 (not 1). Tiny LLaMA: h 128, 4 heads of 32, 2 kv heads, SwiGLU
    352, vocab 2048, seq 128, 8 layers."""
    cfg = load_config(
        REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml",
        [
            "hardware=ascend910b",
            "model.num_layers=8",
            "parallel.data_parallel=1",
            "parallel.pipeline_stage=4",
            "parallel.micro_batch_num=4",
            f"recompute.mode={mode}",
            "recompute.layers=1",
            "train.global_batch_size=null",
        ],
    )
    layout = Layout.of(cfg)
    assert layout.layers_per_stage == (2, 2, 2, 2) and layout.recomputed == (0, 2, 4, 6)
    layer_n = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 352  # q, o; k, v; gate, up, down
    core = 12 * 128 * 128  # 12·H·Q·T of one layer
    model = 6 * (8 * layer_n + 128 * 2048) + 8 * core
    extra = 4 * (core if mode == "selective" else 2 * layer_n + core / 3)
    by_hand = model + extra
    assert flops.hardware_flops_per_token(cfg.model, layout.recompute, len(layout.recomputed)) == pytest.approx(by_hand)
    # tools/mfu.py and the planner count the same layers
    assert mfu.flop_counts(cfg)["hflops_per_token"] == pytest.approx(by_hand)
    assert mfu.flop_counts(cfg)["recomputed_layers"] == 4
    assert planner.plan(cfg)["hflops_per_token"] == pytest.approx(by_hand)


# Korthikanti et al. 2022, Table 5 (selective recompute + sequence parallel, A100 peak 312 TFLOP/s):
# GPUs, global batch, iteration time in s, MFU %, HFU %.
KORTHIKANTI_TABLE = {
    "22B": (8, 4, 1.10, 41.5, 43.7),
    "175B": (64, 64, 13.75, 51.4, 52.8),
    "530B": (280, 280, 37.83, 56.0, 57.0),
    "1T": (512, 512, 71.49, 56.3, 57.0),
}


def published_mfu_bracket(name, recompute):
    """MFU/HFU in % at the table's time +- half its last digit (the rounding of the published time)."""
    h, layers, heads = MEGATRON[name]
    gpus, batch, seconds, _, _ = KORTHIKANTI_TABLE[name]
    m = gpt(h, layers, heads)
    tokens_per_step = batch * 2048
    values = []
    for t in (seconds - 0.005, seconds + 0.005):
        if recompute is None:
            values.append(100 * flops.mfu(tokens_per_step / t, gpus, 312.0, m))
        else:
            values.append(100 * flops.hfu(tokens_per_step / t, gpus, 312.0, m, recompute, layers))
    return min(values), max(values)


@pytest.mark.parametrize("name", sorted(KORTHIKANTI_TABLE))
def test_korthikanti_table_mfu_and_hfu(name):
    *_, mfu, hfu = KORTHIKANTI_TABLE[name]
    lo, hi = published_mfu_bracket(name, None)
    assert lo - 0.05 <= mfu <= hi + 0.05
    lo, hi = published_mfu_bracket(name, "selective")
    assert lo - 0.05 <= hfu <= hi + 0.05


def test_palm_540b_mfu():
    """PaLM Table 3 / App. B: 540B on 6144 TPU v4 (275 TFLOP/s bf16), 238.3K tokens/s -> MFU 46.2%.
    PaLM's width (48 heads of 256 in d_model 18432, multi-query, SwiGLU 4·d, shared embedding) is not
    a ModelConfig (head dim = hidden / heads there), so N comes from its dims directly."""
    d, layers, heads, head_dim, ffn, vocab = 18432, 118, 48, 256, 4 * 18432, 256000
    per_layer = 2 * d * heads * head_dim + 2 * d * head_dim + 3 * d * ffn  # q, o; one k/v head; SwiGLU
    n = layers * per_layer + vocab * d
    assert round(n / 1e9, 2) == 540.35
    per_token = flops.palm_flops_per_token(n, layers, heads, head_dim, 2048)
    assert round(100 * flops.utilization(238.3e3, per_token, 6144, 275.0), 1) == 46.2


def test_utilization_rejects_meaningless_input():
    m = LLAMA["llama2_7b"][0]
    with pytest.raises(ValueError):
        flops.utilization(1.0, 1.0, 0, 312.0)
    with pytest.raises(ValueError, match="'sometimes' is not one of"):
        flops.hardware_flops_per_token(m, "sometimes", 32)
    with pytest.raises(ValueError, match="33 recomputed layers"):
        flops.hardware_flops_per_token(m, "full", 33)
    with pytest.raises(ValueError, match="0 when the mode is none"):
        flops.hardware_flops_per_token(m, "none", 8)


def test_mfu_matches_hand_arithmetic():
    m = LLAMA["llama2_7b"][0]
    by_hand = 3000.0 * (6 * flops.matmul_param_count(m) + 12 * 32 * 32 * 128 * 4096) / (8 * 313e12)
    assert math.isclose(flops.mfu(3000.0, 8, 313.0, m), by_hand, rel_tol=1e-12)
