"""Every shipped scale config resolves, validates, fits its hardware per the planner, has the published
parameter count, names its hardware and card count, and points to the reasoning for its layout in docs/layouts.md
from a short header."""

import itertools
import re
import subprocess
import sys

import pytest

from mindscale.perf.planner.text import shipped_configs
from mindscale.perf import flops, planner
from mindscale.config import REPO_ROOT, Layout, load_config

# File names are an interface. Published parameter counts: LLaMA, Qwen2.5, Qwen3, Mixtral and Qwen3-MoE exact
# (released checkpoints: their safetensors index's total_size / 2 bytes); GPT to the label's significant figures (GPT-3 Table 2.1; Narayanan et al. 2021: 1008.0B).
EXPECTED = {
    "gpt3/gpt3_125m.yaml": (125e6, 3),
    "gpt3/gpt3_1.3b.yaml": (1.3e9, 2),
    "gpt3/gpt3_13b.yaml": (13e9, 2),
    "gpt3/gpt3_175b.yaml": (175e9, 3),
    "gpt3/gpt_1t.yaml": (1008.0e9, 5),
    "llama2/llama2_7b.yaml": 6_738_415_616,
    "llama2/llama2_13b.yaml": 13_015_864_320,
    "llama2/llama2_70b.yaml": 68_976_648_192,
    "llama3/llama3_8b.yaml": 8_030_261_248,
    "llama3/llama3_70b.yaml": 70_553_706_496,
    "llama3/llama3_405b.yaml": 405_853_388_800,
    "llama3_1/llama3_1_8b.yaml": 8_030_261_248,
    "llama3_1/llama3_1_70b.yaml": 70_553_706_496,
    "llama3_1/llama3_1_405b.yaml": 405_853_388_800,
    "llama3_1/llama3_1_8b_128k.yaml": 8_030_261_248,
    "llama3_1/llama3_1_70b_128k.yaml": 70_553_706_496,
    "llama3_2/llama3_2_1b.yaml": 1_235_814_400,
    "llama3_2/llama3_2_3b.yaml": 3_212_749_824,
    "qwen2/qwen2_5_7b.yaml": 7_615_616_512,
    "qwen2/qwen2_5_14b.yaml": 14_770_033_664,
    "qwen2/qwen2_5_32b.yaml": 32_763_876_352,
    "qwen2/qwen2_5_72b.yaml": 72_706_203_648,
    "qwen3/qwen3_8b.yaml": 8_190_735_360,
    "qwen3/qwen3_14b.yaml": 14_768_307_200,
    "qwen3/qwen3_32b.yaml": 32_762_123_264,
    # mixtures of experts: every expert stored (transformers' MixtralForCausalLM / Qwen3MoeForCausalLM built on the
    # meta device from the released config.json values count the same; 88 s, so not rerun here)
    "mixtral/mixtral_8x7b.yaml": 46_702_792_704,
    "qwen3_moe/qwen3_30b_a3b.yaml": 30_532_122_624,
    "qwen3_moe/qwen3_235b_a22b.yaml": 235_093_634_560,
    # trained weights: transformers' DeepseekV3ForCausalLM(DeepseekV3Config()) on the meta device, 57 s, counts the
    # same (its 14,848 router correction biases are buffers there, and not trained here), plus the MTP module's
    # 11,610,067,968 (by hand below; the released checkpoint's layer 61 also stores its own copies of the embedding
    # and head, which the module shares here)
    "deepseek_v3/deepseek_v3_671b.yaml": 682_636_472_320,
}
EIGHT_CARDS = (
    "gpt3/gpt3_1.3b.yaml",
    "llama2/llama2_7b.yaml",
    "llama3/llama3_8b.yaml",
    "llama3_1/llama3_1_8b.yaml",
    "llama3_2/llama3_2_1b.yaml",
    "llama3_2/llama3_2_3b.yaml",
    "qwen2/qwen2_5_7b.yaml",
    "qwen3/qwen3_8b.yaml",
)


def rel(path):
    return str(path.relative_to(REPO_ROOT / "configs"))


# Config headers: what the file is and one or two sentences of why; the reasoning lives in docs/layouts.md and the
# history in git. A commit hash is a word of 7-40 hex digits with both a letter and a digit (not a number, not a word).
HEADER_LINES = 8
DATE = re.compile(r"\b\d{4}-\d\d-\d\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", re.I)
LAYOUTS = REPO_ROOT / "docs" / "layouts.md"
LAYOUT_LINK = re.compile(r"docs/layouts\.md#([\w-]+)")
ALL_YAML = sorted((REPO_ROOT / "configs").rglob("*.yaml"))


def header(path):
    """The comment lines a config file starts with."""
    return list(itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines()))


def github_anchor(heading):
    """The id GitHub gives a Markdown heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def layout_anchors():
    anchors, fenced = [], False
    for line in LAYOUTS.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            anchors.append(github_anchor(line.lstrip("#")))
    assert len(anchors) == len(set(anchors)), "docs/layouts.md: two headings give the same anchor"
    return set(anchors)


def test_the_shipped_set_is_exactly_the_interface():
    assert sorted(rel(p) for p in shipped_configs()) == sorted(EXPECTED)


@pytest.fixture(scope="module")
def configs():
    return {name: load_config(REPO_ROOT / "configs" / name) for name in EXPECTED}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameter_count_is_the_published_one(configs, name):
    count = flops.param_count(configs[name].model)
    expected = EXPECTED[name]
    if isinstance(expected, tuple):
        value, digits = expected
        assert float(f"{count:.{digits}g}") == value
    else:
        assert count == expected


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fits_its_hardware_with_the_stated_margin(configs, name):
    cfg = configs[name]
    result = planner.plan(cfg)
    assert result["fits"], f"{name}: {result['memory_gib']['total']:.1f} GiB > budget {result['memory_budget_gib']:.1f}"
    assert result["memory_gib"]["total"] <= cfg.hardware.memory_gib
    assert result["predicted"]["mfu"] > 0.15


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_names_hardware_and_cards_and_explains_itself(configs, name):
    cfg = configs[name]
    assert cfg.hardware.name == "ascend910b"
    lines = header(REPO_ROOT / "configs" / name)
    assert len(lines) >= 4 and f"{cfg.devices} x Ascend 910B" in lines[0]
    assert cfg.run.name == name.split("/")[1].removesuffix(".yaml")
    assert cfg.train.global_batch_size is not None and cfg.train.warmup_steps > 0


def test_card_counts_span_8_to_4096_and_beyond(configs):
    for name in EIGHT_CARDS:
        assert configs[name].devices == 8
    assert configs["gpt3/gpt_1t.yaml"].devices >= 4096
    big = [c for c in configs.values() if c.parallel.pipeline_stage > 1]
    assert all(
        c.parallel.sequence_parallel and c.parallel.optimizer_shard for c in big if c.parallel.model_parallel > 1
    )


def test_published_batch_and_learning_rates(configs):
    """GPT-3 Table 2.1 tokens per batch and LR; LLaMA-2 4M tokens, 3e-4 / 1.5e-4; Llama 3 405B 8e-5, 16M."""
    tokens = {n: c.samples_per_step * c.model.seq_length for n, c in configs.items()}
    assert tokens["gpt3/gpt3_125m.yaml"] == 2**19 and configs["gpt3/gpt3_125m.yaml"].train.lr == 6e-4
    assert tokens["gpt3/gpt3_1.3b.yaml"] == 2**20 and configs["gpt3/gpt3_1.3b.yaml"].train.lr == 2e-4
    assert tokens["gpt3/gpt3_13b.yaml"] == 2**21 and configs["gpt3/gpt3_13b.yaml"].train.lr == 1e-4
    assert tokens["gpt3/gpt3_175b.yaml"] == 1536 * 2048 and configs["gpt3/gpt3_175b.yaml"].train.lr == 6e-5
    for name in ("llama2/llama2_7b.yaml", "llama2/llama2_13b.yaml", "llama2/llama2_70b.yaml"):
        assert tokens[name] == 2**22
    assert configs["llama2/llama2_70b.yaml"].train.lr == 1.5e-4
    assert tokens["llama3/llama3_405b.yaml"] == 2**24 and configs["llama3/llama3_405b.yaml"].train.lr == 8e-5


def test_uneven_layers_use_stage_offsets_and_offload_counts_per_stage(configs):
    cfg = configs["llama3/llama3_405b.yaml"]
    layout = Layout.of(cfg)
    counts = layout.layers_per_stage  # stage_offset per chunk (interleaved pipeline)
    assert sum(counts) == 126 and counts[0] == counts[-1] == 15 and cfg.parallel.pipeline_interleave > 1
    assert [layout.offloaded_in(k) for k in range(8)] == [cfg.offload.layers] * 8  # an int: every stage
    assert not set(layout.offloaded) & set(layout.recomputed)
    long = configs["llama3_1/llama3_1_70b_128k.yaml"]  # a list: per stage
    assert [Layout.of(long).offloaded_in(k) for k in range(2)] == long.offload.layers == [9, 7]


@pytest.mark.integration
def test_validates_through_the_config_cli():
    path = REPO_ROOT / "configs" / "llama3" / "llama3_405b.yaml"
    proc = subprocess.run(
        [sys.executable, "tools/config.py", "--config", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "hidden_size: 16384" in proc.stdout


def test_deepseek_v3_count_is_the_released_modules_by_hand(configs):
    """The 671B by the released config.json's shapes, module by module as transformers builds them, and the
    multi-token-prediction module the config adds (models/mtp.py)."""
    h, vocab, heads, layers, dense = 7168, 129280, 128, 61, 3
    attention = (
        h * 1536
        + 1536
        + 1536 * heads * (128 + 64)  # q_a_proj, q_a_layernorm, q_b_proj
        + h * (512 + 64)
        + 512
        + 512 * heads * (128 + 128)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
        + heads * 128 * h
        + 2 * h
    )  # o_proj, the two layer norms
    mlp, experts = 3 * h * 18432, 256 * h + 256 * 3 * h * 2048 + 3 * h * 2048  # gate, routed, one shared
    total = layers * attention + dense * mlp + (layers - dense) * experts + 2 * vocab * h + h
    assert total == 671_026_404_352
    mtp = attention + experts + 2 * h * h + 3 * h  # a block with experts, eh_proj [h, 2h], enorm, hnorm, its norm
    assert total + mtp == flops.param_count(configs["deepseek_v3/deepseek_v3_671b.yaml"].model)


def test_config_headers_are_short_and_comments_stay_inline():
    too_long = {rel(p): len(header(p)) for p in ALL_YAML if len(header(p)) > HEADER_LINES}
    assert not too_long, f"headers over {HEADER_LINES} lines (move the reasoning to docs/layouts.md): {too_long}"
    body_blocks = [
        rel(p)
        for p in ALL_YAML
        if any(line.lstrip().startswith("#") for line in p.read_text().splitlines()[len(header(p)) :])
    ]
    assert not body_blocks, f"comment lines inside the YAML body (keep a short comment after the value): {body_blocks}"


def test_configs_hold_no_dates_or_commit_hashes():
    found = {rel(p): DATE.findall(p.read_text()) + COMMIT.findall(p.read_text()) for p in ALL_YAML}
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, f"dates or commit hashes (git history holds them): {found}"


def test_every_ascend_config_cites_its_section_of_docs_layouts():
    anchors = layout_anchors() if LAYOUTS.exists() else set()
    missing = {rel(p): sorted(set(LAYOUT_LINK.findall(p.read_text())) - anchors) for p in ALL_YAML}
    missing = {name: links for name, links in missing.items() if links}
    assert not missing, f"cited anchors that are no heading of docs/layouts.md: {missing}"
    configs = [p for p in ALL_YAML if p.parent.name != "hardware" and p.name != "base.yaml"]
    uncited = [
        rel(p)
        for p in configs
        if load_config(p).hardware.name != "cpu" and not LAYOUT_LINK.search("\n".join(header(p)))
    ]
    assert not uncited, f"Ascend configs whose header cites no docs/layouts.md#section: {uncited}"
