"""GPT and LLaMA on CPU in graph mode: names, parameter counts, loss, training, recompute, dtypes."""

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import models
from models.cpu_kernels import SPLIT_CAUSAL_MIN, EqualShapes, RowSumSoftmax
from models import transformer
from models.transformer import ShardedCrossEntropy, layer_graph_keys
from mindscale.train.checkpoints.folder import CheckpointError, save_checkpoint
from mindscale.config import Layout, load_config
from tests.modes import cpu_mode


graph_mode = cpu_mode("graph")

VOCAB, SEQ, BATCH = 128, 16, 2


def tiny(arch: str, *overrides: str):
    """A 2-layer model config small enough to compile in about a second."""
    return load_config(
        f"configs/tiny/{arch}_tiny.yaml",
        [
            "model.hidden_size=64",
            "model.ffn_hidden_size=96",
            f"model.vocab_size={VOCAB}",
            f"model.seq_length={SEQ}",
            "parallel.data_parallel=1",
            *overrides,
        ],
    )


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    mask = (rng.random((BATCH, SEQ)) > 0.3).astype(np.float32)
    return ids[:, :-1], ids[:, 1:], mask


def fed(seed: int = 0):
    """batch()'s rows as a training step takes them: tokens [B, S + 1] and the mask of the labels."""
    ids, labels, mask = batch(seed)
    return np.concatenate([ids, labels[:, -1:]], axis=1), mask


def built(cfg, seed: int = 7):
    ms.set_seed(seed)
    return models.build_model(cfg)


# ---------------------------------------------------------------------------------------------
# Names and counts


def test_llama_parameter_names_are_the_contract():
    names = [p.name for p in built(tiny("llama")).get_parameters()]
    per_layer = [
        "attention_norm.weight",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "ffn_norm.weight",
        "feed_forward.w1.weight",
        "feed_forward.w3.weight",
        "feed_forward.w2.weight",
    ]
    expected = (
        ["tok_embeddings.weight"]
        + [f"layers.{i}.{n}" for i in range(2) for n in per_layer]
        + ["norm.weight", "output.weight"]
    )
    assert sorted(names) == sorted(expected)
    assert sorted(n for n, _ in built(tiny("llama")).parameters_and_names()) == sorted(expected)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_parameter_names_biases_positions_and_tying(tied):
    names = {p.name for p in built(tiny("gpt", f"model.tie_embeddings={tied}")).get_parameters()}
    assert {
        "tok_embeddings.weight",
        "pos_embeddings.weight",
        "norm.weight",
        "norm.bias",
        "layers.1.attention.wq.bias",
        "layers.1.attention_norm.bias",
        "layers.1.feed_forward.w2.bias",
    } <= names
    assert ("output.weight" in names) is not tied
    assert not any("w3" in n for n in names)


PUBLISHED = {  # parameter counts as published with the released checkpoints
    "llama2/llama2_7b": 6_738_415_616,
    "llama2/llama2_13b": 13_015_864_320,
    "llama2/llama2_70b": 68_976_648_192,
    "llama3/llama3_8b": 8_030_261_248,
    "llama3/llama3_70b": 70_553_706_496,
    "llama3/llama3_405b": 405_853_388_800,
}


def llama_count_by_hand(m) -> int:
    d = m.hidden_size // m.num_heads
    attention = 2 * m.hidden_size * m.num_heads * d + 2 * m.hidden_size * m.kv_heads * d
    layer = attention + 3 * m.hidden_size * m.ffn_hidden_size + 2 * m.hidden_size
    return 2 * m.vocab_size * m.hidden_size + m.num_layers * layer + m.hidden_size


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_llama_parameter_counts_are_exact(name):
    cfg = load_config(f"configs/{name}.yaml")
    assert models.count_parameters(cfg) == PUBLISHED[name] == llama_count_by_hand(cfg.model)


def test_gpt3_small_count_matches_the_formula():
    cfg = load_config("configs/gpt3/gpt3_125m.yaml")
    m = cfg.model
    h, f = m.hidden_size, m.ffn_hidden_size
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    expected = (m.vocab_size + m.seq_length) * h + m.num_layers * layer + 2 * h
    assert models.count_parameters(cfg) == expected
    assert round(expected / 1e6) == 125  # GPT-3 Small, Brown et al. 2020, Table 2.1


# ---------------------------------------------------------------------------------------------
# Forward and loss


@pytest.fixture(scope="module")
def llama():
    cfg = tiny("llama")
    model = built(cfg)
    return cfg, model, models.build_train_network(cfg, model)


def numpy_masked_ce(logits, labels, mask):
    z = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ce = -logp[np.arange(len(z)), labels.reshape(-1)]
    return (ce * mask.reshape(-1)).sum() / max(mask.sum(), 1.0)


def test_loss_is_masked_mean_cross_entropy_of_the_logits(llama):
    _, model, network = llama
    ids, labels, mask = batch()
    logits = model(Tensor(ids)).asnumpy()
    assert logits.shape == (BATCH, SEQ, VOCAB) and logits.dtype == np.float32
    loss = float(network.loss(Tensor(ids), Tensor(labels), Tensor(mask)).asnumpy())
    assert loss == pytest.approx(numpy_masked_ce(logits, labels, mask), rel=1e-5, abs=1e-5)
    # the network a step differentiates takes the tokens as stored and shifts them itself
    tokens, _ = fed()
    assert float(network(Tensor(tokens), Tensor(mask)).asnumpy()) == pytest.approx(loss, rel=1e-6)
    # no mask (pretraining data): every label counts
    every = float(network(Tensor(tokens)).asnumpy())
    assert every == pytest.approx(numpy_masked_ce(logits, labels, np.ones_like(mask)), rel=1e-5, abs=1e-5)
    # Masked positions do not count, whatever their label; an empty mask gives 0, not NaN.
    scrambled = np.where(mask > 0, labels, (labels + 1) % VOCAB).astype(np.int32)
    assert float(network.loss(Tensor(ids), Tensor(scrambled), Tensor(mask)).asnumpy()) == pytest.approx(loss, rel=1e-6)
    assert float(network.loss(Tensor(ids), Tensor(labels), Tensor(np.zeros_like(mask))).asnumpy()) == 0.0


def test_causal_attention_does_not_look_ahead(llama):
    _, model, _ = llama
    ids, _, _ = batch()
    changed = ids.copy()
    changed[:, SEQ // 2 :] = (changed[:, SEQ // 2 :] + 5) % VOCAB
    a, b = model(Tensor(ids)).asnumpy(), model(Tensor(changed)).asnumpy()
    np.testing.assert_allclose(a[:, : SEQ // 2], b[:, : SEQ // 2], atol=1e-6)
    assert np.abs(a[:, SEQ // 2 :] - b[:, SEQ // 2 :]).max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_loss_falls_on_a_repeated_batch(arch):
    ms.set_seed(0)  # the init must not depend on which other test modules ran first
    cfg = tiny(arch)
    network = models.build_train_network(cfg, built(cfg))
    step = nn.TrainOneStepCell(network, nn.AdamWeightDecay(network.trainable_params(), learning_rate=1e-2))
    tokens, mask = (Tensor(x) for x in fed())
    losses = [float(step(tokens, mask).asnumpy()) for _ in range(20)]
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.3)  # near-uniform at init
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------------------------------------
# Recompute


class Grads(nn.Cell):
    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network
        self.weights = network.trainable_params()
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, *inputs):
        return self.network(*inputs), self.grad(self.network, self.weights)(*inputs)


def recompute_marked(model) -> list[int]:
    """Layers build_model marked: full (MindSpore's recompute scope on the block) or selective (the
    MLP activation's primitive)."""

    def full(cell):
        return (cell._scope or "").startswith("recompute_")

    return [i for i, layer in enumerate(model.layers) if full(layer) or layer.feed_forward.act.attrs.get("recompute")]


def loss_and_grads(cfg, weights, plain_softmax=False, sharded_loss=False):
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    if plain_softmax:
        for layer in model.layers:
            layer.attention.core.softmax = ops.Softmax(axis=-1)
    if sharded_loss:
        model.loss = ShardedCrossEntropy(cfg.model.vocab_size)
    recomputed = recompute_marked(model)
    loss, grads = Grads(models.build_train_network(cfg, model))(*(Tensor(x) for x in fed()))
    return recomputed, float(loss.asnumpy()), [g.asnumpy() for g in grads]


def test_selective_and_full_recompute_leave_loss_and_gradients_unchanged(llama):
    _, model, _ = llama
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    runs = {
        mode: loss_and_grads(tiny("llama", f"recompute.mode={mode}", *extra), weights)
        for mode, extra in [("none", []), ("selective", []), ("full", ["recompute.layers=1"])]
    }
    assert [runs[m][0] for m in ("none", "selective", "full")] == [[], [0, 1], [0]]
    _, base_loss, base_grads = runs["none"]
    for mode in ("selective", "full"):
        _, loss, grads = runs[mode]
        assert loss == pytest.approx(base_loss, rel=1e-6)
        for g, b in zip(grads, base_grads):
            np.testing.assert_allclose(g, b, rtol=1e-5, atol=1e-7)


def test_offload_on_cpu_compiles_moves_nothing_and_leaves_loss_and_gradients_unchanged(llama, tmp_path, monkeypatch):
    """What MindSpore 2.9 does with Cell.offload on CPU (why validate.py refuses offload.layers there): the marks
    reach every primitive of the offloaded layer, the step compiles and runs, its loss and gradients are those of
    the unmarked model, and the compiled graph has no MoveTo: nothing goes to host memory. (On CPU the layers
    are inlined before autodiff, lazy_inline's "front" policy; the offload pass works on a reused layer's
    forward/backward pair, which the dry run of tests/dryrun/test_offload.py shows.)"""
    _, model, _ = llama
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    runs = []
    for layers in (0, 1):
        cfg = tiny("llama", "hardware=ascend910b", f"offload.layers={layers}")  # a profile that may offload
        built_model = models.build_model(cfg)
        marked = [i for i, layer in enumerate(built_model.layers) if layer.attention.wq.matmul.attrs.get("offload")]
        models.load_weights_into(built_model, weights)
        monkeypatch.setenv("MS_DEV_DUMP_IR_PASSES", "validate")  # keep only the compiled graph's validate IR
        ms.set_context(save_graphs=True, save_graphs_path=str(tmp_path / str(layers)))
        try:
            loss, grads = Grads(models.build_train_network(cfg, built_model))(*(Tensor(x) for x in fed()))
        finally:
            ms.set_context(save_graphs=False)
        ir = "".join(f.read_text() for f in (tmp_path / str(layers)).rglob("*validate*.ir"))
        runs.append(
            (
                marked,
                ir.count("offload: Bool(1)") > 0,
                "MoveTo" in ir,
                float(loss.asnumpy()),
                [g.asnumpy() for g in grads],
            )
        )
    (plain_marked, plain_attr, _, base_loss, base_grads), (marked, attr, moved, loss, grads) = runs
    assert (plain_marked, plain_attr, marked, attr, moved) == ([], False, [0], True, False)
    assert loss == base_loss
    for g, b in zip(grads, base_grads):
        np.testing.assert_array_equal(g, b)


def test_reused_layer_graph_computes_what_per_layer_graphs_compute(llama):
    """One block graph shared by layers with the same key (here two keys: layer 0 recomputed, layer 1
    not) computes exactly what a graph per layer computes."""
    _, model, _ = llama
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    runs = [
        loss_and_grads(
            tiny("llama", "recompute.mode=selective", "recompute.layers=1", f"run.reuse_layer_graph={reuse}"), weights
        )
        for reuse in ("true", "false")
    ]
    (_, reused_loss, reused_grads), (_, loss, grads) = runs
    assert reused_loss == loss
    for r, g in zip(reused_grads, grads):
        np.testing.assert_array_equal(r, g)


def test_layer_graph_keys_separate_stages_and_recompute_modes():
    cfg = tiny(
        "llama",
        "model.num_layers=6",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "recompute.mode=full",
        "recompute.layers=[2,1]",
    )
    assert (
        layer_graph_keys(Layout.of(cfg), cfg.model)
        == ["stage 0, recompute full"] * 2
        + ["stage 0, recompute none", "stage 1, recompute full"]
        + ["stage 1, recompute none"] * 2
    )
    assert Layout.of(tiny("llama", "run.reuse_layer_graph=false")).graph_reuse == "none"
    # DeepSeek-V3's dense first layers are other cells than its expert layers: never one graph
    deepseek = load_config("configs/tiny/deepseek_v3_tiny.yaml", ["model.num_layers=3", "parallel.data_parallel=1"])
    assert layer_graph_keys(Layout.of(deepseek), deepseek.model) == [
        "stage 0, recompute none, dense",
        "stage 0, recompute none",
        "stage 0, recompute none",
    ]


@pytest.mark.parametrize("packed", [False, True])
def test_split_causal_scores_compute_what_the_full_scores_compute(packed):
    """From SPLIT_CAUSAL_MIN tokens the CPU core skips the masked quarter of the scores."""
    cfg = tiny("llama", f"model.seq_length={SPLIT_CAUSAL_MIN}", "model.num_kv_heads=2")
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (2, SPLIT_CAUSAL_MIN + 1)).astype(np.int32)
    inputs = [Tensor(ids), Tensor(np.ones((2, SPLIT_CAUSAL_MIN), np.float32))]
    if packed:
        inputs.append(Tensor(np.repeat(np.arange(4, dtype=np.int32), SPLIT_CAUSAL_MIN // 4)[None].repeat(2, 0)))
    runs = []
    for split in (True, False):
        model = built(cfg)
        for layer in model.layers:
            layer.attention.core.split_causal = split
        runs.append(Grads(models.build_train_network(cfg, model))(*inputs))
    (split_loss, split_grads), (loss, grads) = runs
    assert float(split_loss.asnumpy()) == pytest.approx(float(loss.asnumpy()), rel=1e-6)
    for a, b in zip(split_grads, grads):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def llama_reference(llama):
    """The llama fixture's weights, loss and gradients, compiled once for the variants compared with them."""
    cfg, model, _ = llama
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    _, loss, grads = loss_and_grads(cfg, weights)
    return weights, loss, grads


def test_cpu_softmax_backward_matches_the_softmax_primitive(llama, llama_reference):
    cfg, model, _ = llama
    assert isinstance(model.layers[0].attention.core.softmax, RowSumSoftmax)  # CPU, stand-alone
    weights, loss, grads = llama_reference
    _, plain_loss, plain_grads = loss_and_grads(cfg, weights, plain_softmax=True)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for g, p in zip(grads, plain_grads):
        np.testing.assert_allclose(g, p, rtol=1e-4, atol=1e-7)


def test_cpu_equal_shape_arithmetic_matches_the_broadcasting_primitives(llama, llama_reference, monkeypatch):
    """EqualShapes (every Add/Sub/Mul of a CPU stand-alone model) computes the primitives' numbers."""
    cfg, model, _ = llama
    assert isinstance(model.layers[0].attention_norm.mul_weight, EqualShapes)
    assert isinstance(model.layers[0].attention.rotary.mul_cos, EqualShapes)
    weights, loss, grads = llama_reference
    monkeypatch.setattr(transformer, "expand_broadcasts", lambda network: None)
    assert not isinstance(models.build_model(cfg).layers[0].attention_norm.mul_weight, EqualShapes)
    _, plain_loss, plain_grads = loss_and_grads(cfg, weights)
    assert plain_loss == pytest.approx(loss, rel=1e-6)
    for g, p in zip(grads, plain_grads):
        np.testing.assert_allclose(g, p, rtol=1e-5, atol=1e-8)


def test_sharded_loss_matches_the_fused_loss(llama, llama_reference):
    """The loss sharded layouts compile (elementary ops, global token sums) computes the fused loss's numbers."""
    cfg = llama[0]
    weights, loss, grads = llama_reference
    _, vp_loss, vp_grads = loss_and_grads(cfg, weights, sharded_loss=True)
    assert vp_loss == pytest.approx(loss, rel=1e-5)
    for g, v in zip(grads, vp_grads):
        np.testing.assert_allclose(v, g, rtol=1e-4, atol=1e-6)


def test_selective_recompute_marks_the_attention_core_and_activations():
    cfg = tiny("gpt", "recompute.mode=selective", "recompute.layers=1")
    model = built(cfg)
    core, mlp = model.layers[0].attention.core, model.layers[0].feed_forward
    assert all(getattr(core, n).attrs.get("recompute") for n in type(core).SELECTIVE_RECOMPUTE)
    assert mlp.act.attrs.get("recompute") and not mlp.w1.matmul.attrs.get("recompute")
    assert not model.layers[1].attention.core.softmax.attrs.get("recompute")


def test_full_recompute_covers_the_lora_adapters():
    """Marks come after LoRA wraps the Linears, so a fully recomputed block recomputes its adapters."""
    model = built(
        tiny(
            "llama",
            "finetune.lora.rank=2",
            "checkpoint.load_path=base.safetensors",
            "recompute.mode=full",
            "recompute.layers=1",
        )
    )
    wq = model.layers[0].attention.wq
    assert type(wq).__name__ == "LoraLinear" and wq._scope.startswith("recompute_")
    assert not (model.layers[1].attention.wq._scope or "").startswith("recompute_")


def test_recompute_layers_per_stage_list_takes_the_first_layers_of_each_stage():
    cfg = tiny(
        "llama",
        "model.num_layers=8",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.stage_offset=[1,-1]",
        "recompute.mode=full",
        "recompute.layers=[2,1]",
    )
    assert Layout.of(cfg).recomputed == (0, 1, 5)


# ---------------------------------------------------------------------------------------------
# Mixed precision


def test_fp16_compute_keeps_fp32_parameters_norms_softmax_and_logits(llama):
    _, model32, _ = llama
    cfg = tiny("llama", "model.compute_dtype=float16")
    model16 = models.build_model(cfg)
    models.load_weights_into(model16, {p.name: p.asnumpy() for p in model32.get_parameters()})
    assert {p.dtype for p in model16.get_parameters()} == {ms.float32}
    assert model16.layers[0].attention.core.cast_scores and model16.norm.compute_dtype == ms.float16
    ids, _, _ = batch()
    logits16, logits32 = model16(Tensor(ids)).asnumpy(), model32(Tensor(ids)).asnumpy()
    assert logits16.dtype == np.float32
    np.testing.assert_allclose(logits16, logits32, atol=2e-2)


def test_param_dtype_is_honoured():
    model = built(tiny("gpt", "model.param_dtype=float16", "model.compute_dtype=float16"))
    assert {p.dtype for p in model.get_parameters()} == {ms.float16}


# ---------------------------------------------------------------------------------------------
# Loading weights


def test_load_weights_into_refuses_mismatches_in_one_line_and_loads_nothing(llama):
    cfg, model, _ = llama
    weights = {p.name: np.zeros(p.shape, np.float32) for p in model.get_parameters()}
    weights["layers.0.attention.wq.weight"] = np.zeros((3, 3), np.float32)
    weights["extra.weight"] = np.zeros(2, np.float32)
    del weights["norm.weight"]
    fresh = built(cfg, seed=3)
    before = fresh.tok_embeddings.weight.asnumpy().copy()
    with pytest.raises(models.WeightsMismatch) as info:
        models.load_weights_into(fresh, weights)
    message = str(info.value)
    assert "\n" not in message
    assert "missing 1: norm.weight" in message and "unexpected 1: extra.weight" in message
    assert "layers.0.attention.wq.weight (3, 3) vs model (64, 64)" in message
    np.testing.assert_array_equal(fresh.tok_embeddings.weight.asnumpy(), before)


def test_load_pretrained_reads_a_mindscale_checkpoint_and_refuses_a_missing_one(llama, tmp_path):
    cfg, model, _ = llama
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    folder = save_checkpoint(tmp_path, 5, weights)
    loaded = models.load_pretrained(folder, cfg)
    assert set(loaded) == set(weights)
    np.testing.assert_array_equal(loaded["output.weight"], weights["output.weight"])
    with pytest.raises(CheckpointError):
        models.load_pretrained(tmp_path / "nope", cfg)
