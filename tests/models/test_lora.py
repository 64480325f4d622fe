"""LoRA: config rules, frozen base, merge = base + adapters, adapters' sharding strategies."""

import numpy as np
import pytest
from mindspore import Tensor

import models
from models.lora import LoraLinear, merge, split_adapters, without_lora
from mindscale.config import REPO_ROOT, ConfigError, Layout, load_config
from tests.modes import cpu_mode

pynative_mode = cpu_mode("pynative")
TINY = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")
SMALL = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=128",
    "model.seq_length=16",
    "parallel.data_parallel=1",
    "checkpoint.load_path=/base",
    "finetune.lora.rank=4",
    "finetune.lora.alpha=8",
    "finetune.lora.target_modules=[wq,wv,wo,w2]",
]


def config(*overrides):
    return load_config(TINY, [*SMALL, *overrides])


@pytest.mark.parametrize(
    "override, message",
    [
        ("finetune.lora.rank=-1", "rank"),
        ("finetune.lora.alpha=0", "alpha"),
        ("finetune.lora.dropout=1.0", "dropout"),
        ("finetune.lora.target_modules=[wq,c_attn]", "target_modules"),
        ("finetune.lora.target_modules=[]", "target_modules"),
        ("checkpoint.load_path=null", "load_path"),
        ("finetune.template=chatml", "template"),
    ],
)
def test_bad_lora_config_is_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        config(override)
    assert "\n" not in str(info.value)


def test_gpt_has_no_w3():
    with pytest.raises(ConfigError, match="w3"):
        load_config(
            str(REPO_ROOT / "configs" / "tiny" / "gpt_tiny.yaml"),
            ["checkpoint.load_path=/base", "finetune.lora.rank=2", "finetune.lora.target_modules=[w3]"],
        )


@pytest.fixture(scope="module")
def lora_model():
    cfg = config()
    model = models.build_model(cfg)
    rng = np.random.default_rng(0)
    for p in model.get_parameters():  # non-zero B so the adapters change the output
        if p.name.endswith("lora_b"):
            p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    return cfg, model


def test_only_adapters_train_and_names_are_kept(lora_model):
    cfg, model = lora_model
    network = models.build_train_network(cfg, model)
    trainable = sorted(p.name for p in network.trainable_params())
    wrapped = [
        f"layers.{i}.{w}" for i in range(2) for w in ("attention.wq", "attention.wv", "attention.wo", "feed_forward.w2")
    ]
    assert trainable == sorted(f"{w}.{ab}" for w in wrapped for ab in ("lora_a", "lora_b"))
    plain = {p.name for p in models.build_model(without_lora(cfg)).get_parameters()}
    assert {p.name for p in model.get_parameters() if not p.requires_grad} == plain  # base names unchanged


def test_merged_model_equals_base_plus_adapters(lora_model):
    cfg, model = lora_model
    ids = Tensor(np.random.default_rng(1).integers(0, 128, (2, 16)).astype(np.int32))
    with_adapters = model(ids).asnumpy()
    base, adapters = split_adapters({p.name: p.asnumpy() for p in model.get_parameters()})
    merged_model = models.build_model(without_lora(cfg))
    models.load_weights_into(merged_model, merge(base, adapters, cfg.finetune.lora))
    np.testing.assert_allclose(merged_model(ids).asnumpy(), with_adapters, atol=1e-5)
    plain = models.build_model(without_lora(cfg))
    models.load_weights_into(plain, base)
    assert np.abs(plain(ids).asnumpy() - with_adapters).max() > 1e-3  # the adapters do matter


def test_merge_formula():
    rng = np.random.default_rng(2)
    w, a, b = rng.normal(size=(6, 5)), rng.normal(size=(2, 5)), rng.normal(size=(6, 2))
    merged = merge({"x.weight": w}, {"x.lora_a": a, "x.lora_b": b}, config().finetune.lora)
    np.testing.assert_allclose(merged["x.weight"], w + 8 / 2 * b @ a)


def test_adapters_follow_the_wrapped_layers_split():
    """The strategies a sharded layout records (tests/dryrun/test_dryrun.py compiles LoRA under model parallel)."""
    dp, mp = 2, 4
    cfg = config(f"parallel.data_parallel={dp}", f"parallel.model_parallel={mp}")
    layout = Layout.of(cfg)
    model = models.build_model(cfg, layout)
    models.apply_sharding_plan(model, cfg, layout)
    layer = model.layers[1]
    wq, wo = layer.attention.wq, layer.attention.wo
    assert isinstance(wq, LoraLinear) and isinstance(wo, LoraLinear)
    s = lambda prim: prim.attrs.get("in_strategy")  # noqa: E731
    # colwise: base splits output rows; A reads the whole input, B splits its output rows the same way
    assert s(wq.base.matmul) == ((dp, 1), (mp, 1))
    assert s(wq.matmul_a) == ((dp, 1), (1, 1)) and s(wq.matmul_b) == ((dp, 1), (mp, 1))
    assert s(wq.lora_add) == ((dp, mp), (dp, mp))
    # rowwise: base splits input columns; A splits the same columns (partial sums), B is whole
    assert s(wo.base.matmul) == ((dp, mp), (1, mp))
    assert s(wo.matmul_a) == ((dp, mp), (1, mp)) and s(wo.matmul_b) == ((dp, 1), (1, 1))


def test_deepseek_v3_adapters_on_latent_attention_merge_and_follow_its_plan():
    """LoRA on MLA's projections (the replicated down-projections too): only the adapters train, the merged model
    equals base plus adapters, and under tp the adapters take their wrapped Linear's split."""
    targets = "finetune.lora.target_modules=[wq,wq_b,wkv_a,wkv_b,wo]"
    cfg = load_config(
        REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml",
        [
            "model.hidden_size=64",
            "model.vocab_size=128",
            "model.seq_length=16",
            "parallel.data_parallel=1",
            "checkpoint.load_path=/base",
            "finetune.lora.rank=4",
            targets,
        ],
    )
    model = models.build_model(cfg)
    rng = np.random.default_rng(0)
    for p in model.get_parameters():
        if p.name.endswith("lora_b"):
            p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    assert {p.name.rsplit(".", 2)[1] for p in model.trainable_params()} == {"wq", "wq_b", "wkv_a", "wkv_b", "wo"}
    ids = Tensor(rng.integers(0, 128, (2, 16)).astype(np.int32))
    base, adapters = split_adapters({p.name: p.asnumpy() for p in model.get_parameters()})
    merged = models.build_model(without_lora(cfg))
    models.load_weights_into(merged, merge(base, adapters, cfg.finetune.lora))
    np.testing.assert_allclose(merged(ids).asnumpy(), model(ids).asnumpy(), atol=1e-5)
    sharded = load_config(
        REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml",
        [
            "model.hidden_size=64",
            "model.num_heads=8",
            "parallel.data_parallel=2",
            "parallel.model_parallel=2",
            "checkpoint.load_path=/base",
            "finetune.lora.rank=4",
            targets,
        ],
    )
    layout = Layout.of(sharded)
    model = models.build_model(sharded, layout)
    models.apply_sharding_plan(model, sharded, layout)
    attention = model.layers[1].attention
    assert attention.wq.matmul_b.attrs["in_strategy"] == ((2, 1), (1, 1))  # replicated: B whole
    assert attention.wkv_b.matmul_b.attrs["in_strategy"] == ((2, 1), (2, 1))  # colwise: B split as the heads
