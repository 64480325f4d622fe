"""Sharding plans as data: the strategies a sharded layout records on each primitive, pipeline stages,
comm fusion and the flash/fused-norm path, read on CPU without compiling.

Every `.shard()` call is recorded on its primitive (`attrs["in_strategy"]`); that is what is tested
here. Whether MindSpore's parallel compiler accepts these strategies is tested by compiling them
under its dry run (tests/dryrun/test_dryrun.py). The flash-attention path is never executed (Atlas A2 only).
"""

import math
import re
from operator import attrgetter

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

import models
from models.attention import CompositeAttention, FlashAttention
from models.layers import FusedRMSNorm
from models.archs import ARCHS
from models.sharding import planned_strategies
from models.transformer import ShardedCrossEntropy, layer_graph_keys
from mindscale.config import Layout, load_config
from tests.modes import cpu_mode


graph_mode = cpu_mode("graph")


def config(arch: str, *overrides: str):
    """8 heads / 4 kv heads so model_parallel 2 and 4 both divide them; 4 layers for pipelines."""
    return load_config(
        f"configs/tiny/{arch}_tiny.yaml",
        [
            "model.hidden_size=64",
            "model.num_layers=4",
            "model.num_heads=8",
            "model.ffn_hidden_size=128",
            "model.vocab_size=128",
            "model.seq_length=32",
            "parallel.data_parallel=1",
            *([] if arch == "gpt" else ["model.num_kv_heads=4"]),
            *overrides,
        ],
    )


def strategy(primitive):
    return primitive.attrs.get("in_strategy")


def planned(cfg):
    """The model a sharded run of `cfg` builds, with its plan applied: (model, planned rows)."""
    layout = Layout.of(cfg)
    model = models.build_model(cfg, layout)
    return model, models.apply_sharding_plan(model, cfg, layout)


@pytest.mark.parametrize("dp,mp,sp", [(2, 4, False), (2, 4, True), (4, 2, False), (4, 2, True)])
def test_llama_strategies_follow_the_plan(dp, mp, sp):
    cfg = config(
        "llama",
        f"parallel.data_parallel={dp}",
        f"parallel.model_parallel={mp}",
        f"parallel.sequence_parallel={sp}",
        "parallel.vocab_emb_dp=false",
    )
    model, rows = planned(cfg)
    layer = model.layers[2]
    tokens = dp * mp if sp else dp
    # colwise: weights split by output rows; rowwise: by input columns, reduce-scattered under SP
    for w in ("wq", "wk", "wv"):
        assert strategy(getattr(layer.attention, w).matmul) == ((dp, 1), (mp, 1))
    assert strategy(layer.feed_forward.w1.matmul) == strategy(layer.feed_forward.w3.matmul) == ((dp, 1), (mp, 1))
    for rowwise in (layer.attention.wo.matmul, layer.feed_forward.w2.matmul):
        assert strategy(rowwise) == ((dp, mp), (1, mp))
        assert rowwise.attrs.get("out_strategy") == (((dp * mp, 1),) if sp else None)
    # heads split over model_parallel in rotary and the attention core
    assert strategy(layer.attention.rotary.mul_cos) == ((dp, 1, mp, 1), (1, 1, 1))
    assert strategy(layer.attention.core.bmm_qk) == ((dp, mp, 1, 1), (dp, mp, 1, 1))
    assert strategy(layer.attention.core.softmax) == ((dp, mp, 1, 1, 1),)
    assert strategy(layer.feed_forward.gate_mul) == ((dp, mp), (dp, mp))
    # sequence style: norms and residual adds split tokens over dp x mp only with sequence parallel
    assert strategy(layer.attention_norm.square) == ((tokens, 1),)
    assert strategy(layer.ffn_norm.mul_weight) == ((tokens, 1), (1,))
    assert strategy(layer.attention_residual) == ((tokens, 1), (tokens, 1))
    # vocab: embedding and output head split over the vocabulary
    assert strategy(model.tok_embeddings.gather) == ((mp, 1), (dp, 1))
    assert strategy(model.output.matmul) == ((dp, 1), (mp, 1))
    # the loss reduces over the split vocabulary instead of gathering [tokens, V] logits, and its token
    # sums over data parallel (every rank holds the global batch's loss)
    assert isinstance(model.loss, ShardedCrossEntropy)
    assert strategy(model.loss.tokens.row_max) == strategy(model.loss.tokens.sum_exp) == ((dp, mp),)
    assert strategy(model.loss.tokens.one_hot) == ((dp, mp), (), ())
    assert strategy(model.loss.tokens.log) == ((dp, 1),)
    assert strategy(model.loss.sum_loss) == strategy(model.loss.sum_mask) == ((dp, 1),)
    # every planned row is what the primitive recorded, and no matmul/softmax/gather was left out
    cells = dict(model.cells_and_names())
    for path, _style, attr, in_strategy, _out in rows:
        assert strategy(attrgetter(attr)(cells[path])) == in_strategy, (path, attr)
    for path, cell in cells.items():
        for attr, value in vars(cell).items():
            if isinstance(value, (ops.MatMul, ops.BatchMatMul, ops.Softmax, ops.Gather)):
                assert strategy(value) is not None, f"{path}.{attr} has no strategy"


def test_vocab_emb_dp_keeps_embedding_and_head_data_parallel():
    cfg = config("gpt", "parallel.data_parallel=2", "parallel.model_parallel=4", "parallel.vocab_emb_dp=true")
    model, _ = planned(cfg)
    assert strategy(model.tok_embeddings.gather) == ((1, 1), (2, 1))
    assert strategy(model.output.matmul) == ((2, 1), (1, 1))
    assert strategy(model.pos_embeddings.gather) == ((1, 1), (1,))
    assert strategy(model.layers[0].attention.wq.bias_add) == ((2, 4), (4,))
    assert strategy(model.layers[0].feed_forward.act) == ((2, 4),)
    assert strategy(model.layers[0].attention_norm.norm) == ((2, 1), (1,), (1,))
    # the loss still splits the vocabulary over model_parallel: the head's logits are sliced locally
    assert isinstance(model.loss, ShardedCrossEntropy) and strategy(model.loss.tokens.exp) == ((2, 4),)
    # under sequence parallel each tp rank computes the logits of its own tokens, and the loss reduces over them
    model, _ = planned(
        config(
            "gpt",
            "parallel.data_parallel=2",
            "parallel.model_parallel=4",
            "parallel.vocab_emb_dp=true",
            "parallel.sequence_parallel=true",
        )
    )
    assert strategy(model.output.matmul) == ((8, 1), (1, 1))
    assert strategy(model.loss.tokens.exp) == ((8, 1),) and strategy(model.loss.sum_loss) == ((8, 1),)


def test_pipeline_stages_follow_stage_offset_and_comm_fusion_is_per_layer():
    cfg = config(
        "llama",
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.stage_offset=[1,-1]",
    )
    model, _ = planned(cfg)
    assert [layer.pipeline_stage for layer in model.layers] == [0, 0, 0, 1]
    assert model.tok_embeddings.pipeline_stage == 0
    assert model.norm.pipeline_stage == model.output.pipeline_stage == 1
    fusion = {p.name: p.comm_fusion for p in model.get_parameters()}
    assert fusion["tok_embeddings.weight"] == 1
    assert fusion["layers.0.attention.wq.weight"] == fusion["layers.0.ffn_norm.weight"] == 2
    assert fusion["layers.3.feed_forward.w2.weight"] == 5
    assert fusion["output.weight"] == fusion["norm.weight"] == 6


def test_interleaved_stages_go_round_robin_chunk_by_chunk_and_the_plan_prints_each_chunk():
    """pp2 x v2 over 8 layers: chunk k of the 4 on stage k mod 2 (Layout), set as each layer's pipeline_stage;
    MindSpore numbers the chunks itself from the data flow (a stage fed by a later one starts its next chunk)."""
    cfg = config(
        "llama",
        "model.num_layers=8",
        "parallel.data_parallel=2",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=4",
        "parallel.pipeline_interleave=2",
    )
    model, _ = planned(cfg)
    assert [layer.pipeline_stage for layer in model.layers] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert model.tok_embeddings.pipeline_stage == 0 and model.output.pipeline_stage == 1
    lines = models.describe_plan(cfg).splitlines()
    assert "pipeline_stage=2 pipeline_interleave=2 sequence_parallel" in lines[0]
    assert "stage 0: layers 0-1, 4-5 (4 in 2 chunks)" in lines and "stage 1: layers 2-3, 6-7 (4 in 2 chunks)" in lines


def comm_marks(layer) -> dict:
    """recompute_comm_op of each matmul of a decoder layer, where set (the attribute MindSpore's parallel pass reads
    to recompute the collectives it inserts around the op)."""
    linears = {name: getattr(layer.attention, name) for name in ("wq", "wk", "wv", "wo")}
    linears.update(
        {name: getattr(layer.feed_forward, name) for name in ("w1", "w2", "w3") if hasattr(layer.feed_forward, name)}
    )
    return {
        name: op.attrs["recompute_comm_op"]
        for name, linear in linears.items()
        if "recompute_comm_op" in (op := linear.matmul).attrs
    }


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_recompute_comm_regathers_the_column_parallel_inputs_under_sequence_parallel(arch):
    """recompute.comm: each layer that is not fully recomputed regathers, marking the matmuls reading its
    sequence-parallel input (QKV and the MLP's first; tests/dryrun/test_kept_activations.py compiles what that does), a fully recomputed
    one carries mp_comm_recompute on all of its ops; nothing without sequence parallel, and without recompute.comm
    only the recomputed layer's mp_comm_recompute=False."""
    sets = ["parallel.data_parallel=2", "parallel.model_parallel=2", "recompute.mode=full", "recompute.layers=1"]
    column = {"wq", "wk", "wv", "w1"} | ({"w3"} if arch == "llama" else set())
    every = column | {"wo", "w2"}
    cfg = config(arch, *sets, "parallel.sequence_parallel=true", "recompute.comm=true")
    on, _ = planned(cfg)
    assert comm_marks(on.layers[0]) == dict.fromkeys(every, True)
    assert all(comm_marks(layer) == dict.fromkeys(column, True) for layer in on.layers[1:])
    assert layer_graph_keys(Layout.of(cfg), cfg.model)[1:] == ["stage 0, recompute none, regathered"] * 3
    no_sp, _ = planned(config(arch, *sets, "parallel.sequence_parallel=false", "recompute.comm=true"))
    off, _ = planned(config(arch, *sets, "parallel.sequence_parallel=true", "recompute.comm=false"))
    for model in (no_sp, off):
        assert all(comm_marks(layer) == {} for layer in model.layers[1:])
    assert comm_marks(off.layers[0]) == dict.fromkeys(every, False)


def test_plan_is_not_applied_outside_sharded_layouts_and_numbers_do_not_change():
    cfg = config("llama", "model.num_layers=1")
    ms.set_seed(1)
    plain = models.build_model(cfg)
    assert models.apply_sharding_plan(plain, cfg, Layout.of(cfg)) == []
    assert strategy(plain.layers[0].attention.wq.matmul) is None
    # A model whose strategies were recorded computes the same numbers stand-alone.
    sharded_cfg = config("llama", "model.num_layers=1", "parallel.data_parallel=2", "parallel.model_parallel=2")
    sharded, rows = planned(sharded_cfg)
    assert rows
    models.load_weights_into(sharded, {p.name: p.asnumpy() for p in plain.get_parameters()})
    ids = Tensor(np.arange(64, dtype=np.int32).reshape(2, 32) % 128)
    np.testing.assert_array_equal(sharded(ids).asnumpy(), plain(ids).asnumpy())


def test_flash_attention_and_fused_rmsnorm_are_built_for_atlas_a2():
    cfg = config(
        "llama",
        "hardware=ascend910b",
        "model.attention=flash",
        "model.compute_dtype=bfloat16",
        "parallel.data_parallel=2",
        "parallel.model_parallel=4",
    )
    model, _ = planned(cfg)
    core = model.layers[0].attention.core
    assert isinstance(core, FlashAttention) and isinstance(model.layers[0].attention_norm, FusedRMSNorm)
    flash = core.flash
    assert flash.attrs["head_num"] == 8
    assert flash.attrs["scale_value"] == pytest.approx(1 / math.sqrt(64 // 8))
    assert flash.attrs["input_layout"] == FlashAttentionScore(head_num=1, input_layout="BSH").attrs["input_layout"]
    assert flash.attrs["input_layout"] != FlashAttentionScore(head_num=1, input_layout="BNSD").attrs["input_layout"]
    assert flash.attrs["sparse_mode"] == 2  # leftUpCausal with the compressed 2048 x 2048 mask
    mask = core.causal_mask.asnumpy()
    assert mask.shape == (2048, 2048) and mask.dtype == np.uint8
    np.testing.assert_array_equal(mask, np.triu(np.ones((2048, 2048), np.uint8), 1))  # 1 = masked (future)
    assert strategy(flash) == ((2, 1, 4), (2, 1, 4), (2, 1, 4), (1, 1))
    packed = core.flash_packed  # packed data: TND, causal per sequence, each rank its tokens' ends
    assert packed.attrs["input_layout"] == FlashAttentionScore(head_num=1, input_layout="TND").attrs["input_layout"]
    assert (packed.attrs["sparse_mode"], packed.attrs["next_tokens"]) == (3, 0)
    assert strategy(packed) == ((2, 4, 1), (2, 4, 1), (2, 4, 1), (1, 1), (2,), (2,))
    assert core.slot_numbers.shape[-1] == cfg.data.max_packed_examples + 1 and core.row_blocks == 2
    assert model.layers[0].attention_norm.norm.attrs["epsilon"] == pytest.approx(cfg.model.norm_eps)
    assert strategy(model.layers[0].attention_norm.norm) == ((2, 1), (1,))


def test_auto_attention_is_composite_off_ascend():
    cfg = config("llama", "hardware=ascend910b", "model.attention=auto")
    model = models.build_model(cfg)
    assert isinstance(model.layers[0].attention.core, CompositeAttention)
    assert not isinstance(model.norm, FusedRMSNorm)


def test_describe_plan_prints_a_table_with_stages():
    cfg = config(
        "llama",
        "parallel.data_parallel=2",
        "parallel.model_parallel=4",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=4",
        "parallel.sequence_parallel=true",
        "parallel.vocab_emb_dp=false",
    )
    text = models.describe_plan(cfg)
    lines = text.splitlines()
    assert lines[0].startswith("sharding plan: llama, data_parallel=2 model_parallel=4 pipeline_stage=2")
    assert lines[1].split() == ["cell", "style", "op", "in_strategy", "out_strategy", "stage"]
    assert ["layers.*.attention.wq", "colwise", "matmul", "((2,1),(4,1))", "-", "0-1"] in [row.split() for row in lines]
    assert ["layers.*.attention.wo", "rowwise", "matmul", "((2,4),(1,4))", "((8,1),)", "0-1"] in [
        row.split() for row in lines
    ]
    assert ["output", "vocab", "matmul", "((2,1),(4,1))", "-", "1"] in [row.split() for row in lines]
    assert "stage 0: layers 0-1 (2)" in lines and "stage 1: layers 2-3 (2)" in lines
    # every entry of the plan table matches at least one cell of the model
    layout = Layout.of(cfg)
    rows = planned_strategies(models.build_model(cfg, layout), cfg, layout)
    matched = {re.sub(r"^layers\.\d+", "layers.*", row[0]) for row in rows}
    assert matched == set(ARCHS["llama"].plan)


def test_deepseek_v3_plan_splits_heads_keeps_the_latents_whole_and_routes_by_tokens():
    """MLA: the down-projections, their norms and the shared rotary key one per token (tokens split, weights whole);
    the up-projections, the per-head ops and the core split by heads; wo rowwise. The sigmoid router splits tokens,
    its bias whole. The dense first layer plans as LLaMA's MLP, the next as experts with a column/row shared one."""
    dp, mp = 4, 2
    cfg = load_config(
        "configs/tiny/deepseek_v3_tiny.yaml",
        [
            "model.hidden_size=64",
            "model.num_heads=8",
            "model.vocab_size=128",
            "model.seq_length=32",
            f"parallel.data_parallel={dp}",
            f"parallel.model_parallel={mp}",
            "parallel.vocab_emb_dp=false",
        ],
    )
    model, rows = planned(cfg)
    dense, sparse = model.layers
    att = sparse.attention
    for name in ("wq", "wkv_a"):
        assert strategy(getattr(att, name).matmul) == ((dp, 1), (1, 1))
    assert strategy(att.q_a_norm.mul) == strategy(att.kv_a_norm.mul) == ((dp, 1), (dp, 1))
    for name in ("wq_b", "wkv_b"):
        assert strategy(getattr(att, name).matmul) == ((dp, 1), (mp, 1))
    assert strategy(att.wo.matmul) == ((dp, mp), (1, mp))
    assert strategy(att.q_rotary.mul_cos) == ((dp, 1, mp, 1), (1, 1, 1))
    assert strategy(att.k_rotary.mul_cos) == ((dp, 1, 1, 1), (1, 1, 1))
    assert strategy(att.every_head) == ((dp, 1, 1, 1), (1, 1, mp, 1))
    assert strategy(att.pad_v) == ((dp, 1, mp, 1), ()) and strategy(att.values) == ((dp, 1, mp, 1),)
    assert strategy(att.core.bmm_qk) == ((dp, mp, 1, 1), (dp, mp, 1, 1))
    assert strategy(sparse.feed_forward.routing.add_bias) == ((dp, 1), (1,))
    assert strategy(sparse.feed_forward.routing.group_best) == ((dp, 1, 1),)
    assert strategy(sparse.feed_forward.shared_expert.w2.matmul) == ((dp, mp), (1, mp))
    assert strategy(dense.feed_forward.w1.matmul) == ((dp, 1), (mp, 1))
    splits = models.sharding.parameter_splits(model, cfg, Layout.of(cfg))
    assert splits["layers.1.attention.wkv_b.weight"][0] == (mp, 1) and splits["layers.1.attention.wq.weight"][0] == (
        1,
        1,
    )
    assert splits["layers.1.feed_forward.routing.router_bias"][0] == (1,)
