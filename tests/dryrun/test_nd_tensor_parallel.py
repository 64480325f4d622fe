"""2D and 3D tensor parallel (parallel.tp_x x tp_y (x tp_z), MindSpore's high-dimension tensor parallel) compiled by
MindSpore's dry run: a small LLaMA at t = 2 x 2 and at t = 2 x 2 x 2 over two pipeline stages, both stages of each
compiled once for the module.

What the validate IR must show: the projections' weights split over both degrees; instead of 1D's all-reduces of
[tokens, h], all-gathers and reduce-scatters over the x ranks (neighbours) and over the y ranks (tp_x apart), and
all-reduces of the norms' [tokens, 1] only; and their bytes equal to the planner's formula
(mindscale/perf/planner/communication.py: a pair h -> e -> h sends 2T[e(x-1) + h(y-1)]/xy forward). A dry run
proves compiler acceptance, not speed.
"""

import numpy as np
import pytest

from mindscale.config import ConfigError, Layout, load_config
from mindscale.launch.compiled_ir import collectives_of, parse_ir, read_validate_ir
from mindscale.perf.planner.communication import communication, nd_tp_bytes_by_group, nd_tp_bytes_per_layer
from models.weights import take_slice
from test_dryrun import SMALL, TINY_LLAMA, dryrun

SETS = [
    *SMALL,
    "model.num_layers=2",
    "model.num_kv_heads=4",
    "parallel.data_parallel=1",
    "parallel.model_parallel=4",
    "parallel.tp_x=2",
    "parallel.tp_y=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=2",
]
X_GROUP, Y_GROUP, TP_GROUP = [0, 1], [0, 2], [0, 1, 2, 3]  # stage 0's: the mesh is (rows, y, x), x innermost


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    ir_dir = tmp_path_factory.mktemp("nd_tp")
    reports = dryrun(TINY_LLAMA, *SETS, ir_dir=ir_dir)
    return [(r, collectives_of(parse_ir(read_validate_ir(ir_dir / f"rank{r['rank']}"), r["rank"]))[0]) for r in reports]


def ring_bytes(c: dict) -> float:
    """Bytes one rank sends for a collective of the IR (its bytes: an all-gather's output, else its input)."""
    share = (c["group_size"] - 1) / c["group_size"]
    return c["bytes"] * share * (2 if c["kind"] == "AllReduce" else 1)


def test_projections_split_over_x_and_y(stages):
    """Every projection's weight [out, in] is split over both degrees, the norms' over both: 1/t of each on a rank,
    none replicated over tp (1D keeps the norms whole)."""
    for report, _ in stages:
        layer = f"layers.{report['stage']}"
        shapes = report["local_shapes"]
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo"):
            assert shapes[f"{layer}.{name}.weight"] == [32, 32]  # [64, 64] / (2, 2)
        assert shapes[f"{layer}.feed_forward.w1.weight"] == shapes[f"{layer}.feed_forward.w3.weight"] == [64, 32]
        assert shapes[f"{layer}.feed_forward.w2.weight"] == [32, 64]
        assert shapes[f"{layer}.attention_norm.weight"] == [16]
        assert report["planned"]["shape_mismatches"] == {}
        # what a restore from full weights slices by the compiled layouts: the compiled local shapes
        for name, (dev_matrix, tensor_map, shape, group) in report["layouts"].items():
            layout = (dev_matrix, tensor_map, None, 1, True, group, shape)
            assert list(take_slice(np.zeros(shape, np.float32), layout, report["rank"]).shape) == shapes[name], name


def test_a_norm_weight_split_over_x_and_y_restores_block_x_major():
    """MindSpore lists the layout of a norm weight [64] split ("x", "y") over the mesh (y, x) as one tensor-map
    entry per axis, [0, 1] (read from this module's compile, the same on ranks 0-3): rank (y, x) holds block
    x * tp_y + y of 16, as the residual stream it scales; the four blocks tile the weight."""
    layout = ([2, 2], [0, 1], None, 1, True, "", [64])
    full = np.arange(64, dtype=np.float32)
    blocks = {rank: take_slice(full, layout, rank) for rank in range(4)}  # rank = y * tp_x + x
    assert {rank: int(b[0]) // 16 for rank, b in blocks.items()} == {0: 0, 1: 2, 2: 1, 3: 3}
    assert np.array_equal(np.sort(np.concatenate(list(blocks.values()))), full)


def test_all_reduces_become_gathers_and_scatters_with_the_formulas_bytes(stages):
    """First stage (one layer, two micro batches): the tensor-parallel collectives are all-gathers and reduce-scatters
    over 2 ranks along x and along y, and all-reduces of [tokens, 1] fp32 (the norms); no all-reduce of [tokens, h].
    Each group's bytes follow from the projections: over y, the attention's and the MLP's input [T, h/x] gathered
    (wq/wk/wv share one, w1/w3 one) and wo's and w2's partial sums [T, h/x] scattered, each mirrored backward; over
    x, the column-parallel outputs [T, e/y] scattered (e = q, kv, kv, f, f) and the row-parallel inputs [T, e/y]
    gathered (e = q, f), mirrored backward. What a rank sends equals the planner's formula."""
    report, collectives = stages[0]
    cfg = load_config(TINY_LLAMA, SETS)
    m, x, y = cfg.parallel.micro_batch_num, 2, 2
    tokens, h, f = cfg.train.micro_batch_size * cfg.model.seq_length, 64, cfg.model.ffn_hidden_size
    q = kv = 64  # 4 heads (and kv heads) of 16
    operator = {(c["kind"], tuple(c["ranks"])): c for c in collectives if c["purpose"] == "operator"}
    assert set(operator) == {
        (kind, tuple(group)) for kind in ("AllGather", "ReduceScatter") for group in (X_GROUP, Y_GROUP)
    } | {("AllReduce", tuple(TP_GROUP))}
    fp32 = 4
    over_y = 4 * tokens * h // x * fp32  # two forward, two backward, per micro batch
    over_x = tokens * ((q + 2 * kv + 2 * f) + (q + f)) // y * fp32
    for kind in ("AllGather", "ReduceScatter"):
        assert operator[(kind, tuple(Y_GROUP))]["count"] == 4 * m
        assert operator[(kind, tuple(Y_GROUP))]["bytes"] == m * over_y
        assert operator[(kind, tuple(X_GROUP))]["count"] == 7 * m
        assert operator[(kind, tuple(X_GROUP))]["bytes"] == m * over_x
    norms = operator[("AllReduce", tuple(TP_GROUP))]
    assert norms["count"] == 4 * m and norms["bytes"] == 4 * m * tokens * fp32  # [tokens, 1] fp32 each
    sent = sum(ring_bytes(c) for c in operator.values()) / m
    assert sent == pytest.approx(nd_tp_bytes_per_layer(cfg))
    assert communication(cfg, 0)["tp"] == pytest.approx(m * sent)
    sends = sum(c["bytes"] for c in collectives if c["kind"] == "Send")  # the stream [T, h/t] per micro batch
    assert sends == m * tokens * h // 4 * fp32 == communication(cfg, 0)["pp_send_recv"]


def test_last_stage_gathers_the_stream_for_the_head(stages):
    """Last stage: its layer compiles the same collectives as the first stage's, and the final norm's width-split
    output [T, h] is all-gathered for the data-parallel head (over y, then x: MindSpore's redistribution), its
    gradient reduce-scattered back; the planner counts both."""
    (_, first), (report, last) = stages
    assert report["stage"] == 1
    cfg = load_config(TINY_LLAMA, SETS)
    m, x, y, tokens, fp32 = cfg.parallel.micro_batch_num, 2, 2, 4 * 64, 4

    def by_group(collectives, kind, size):
        return sum(c["bytes"] for c in collectives if c["kind"] == kind and c["ranks"][1] - c["ranks"][0] == size)

    head = {1: tokens * 64 * fp32, 2: tokens * 64 // x * fp32}  # over x the whole [T, h], over y [T, h/x]
    for kind in ("AllGather", "ReduceScatter"):
        for step in (1, 2):  # x neighbours, y ranks tp_x apart
            assert by_group(last, kind, step) == by_group(first, kind, step) + m * head[step]
    assert {c["purpose"] for c in last if c["kind"] == "AllGather"} == {"operator", "redistribution"}
    reduces = [c for c in last if c["kind"] == "AllReduce" and c["purpose"] == "operator"]
    assert all(c["bytes"] / c["count"] <= tokens * fp32 for c in reduces)  # norms and loss: none of [T, h]
    head_sent = m * (head[2] * (y - 1) / y + head[1] * (x - 1) / x) * 2
    assert communication(cfg, 1)["tp"] - communication(cfg, 0)["tp"] == pytest.approx(head_sent)


# 3D: t = 2 x 2 x 2 (8 heads, so that the attention core splits them over t), two stages
TP3D = [
    "model.num_heads=8",
    "model.num_kv_heads=8",
    "parallel.model_parallel=8",
    "parallel.tp_x=2",
    "parallel.tp_y=2",
    "parallel.tp_z=2",
]
# stage 0's layer fully recomputed with its communication, stage 1's kept: both roles of the planner in one compile
RECOMPUTE_STAGE_0 = ["recompute.mode=full", "recompute.comm=true", "recompute.layers=[1, 0]"]
SETS_3D = [*[s for s in SETS if "tp_" not in s and "model_parallel" not in s], *TP3D, *RECOMPUTE_STAGE_0]
X3, Z3, Y3 = (0, 1), (0, 2), (0, 4)  # offsets of a rank's x, z and y partners: the mesh is (rows, y, z, x)


@pytest.fixture(scope="module")
def stages_3d(tmp_path_factory):
    ir_dir = tmp_path_factory.mktemp("tp3d")
    reports = dryrun(TINY_LLAMA, *SETS_3D, ir_dir=ir_dir)
    return [(r, collectives_of(parse_ir(read_validate_ir(ir_dir / f"rank{r['rank']}"), r["rank"]))[0]) for r in reports]


def tp_collectives(report: dict, collectives: list[dict]) -> list[dict]:
    """The tensor-parallel collectives of a rank (operators and redistributions; under 3D MindSpore names some of a
    MatMul's own reduce-scatters redistributions), with their ranks as offsets from the rank's."""
    skip = ("grad_reduce", "grad_norm", "optimizer_shard", "pipeline")
    return [
        {**c, "offsets": tuple(r - report["rank"] for r in c["ranks"])} for c in collectives if c["purpose"] not in skip
    ]


def test_3d_weights_split_over_x_y_and_z(stages_3d):
    """Every projection's weight [out, in] has its output features split over y and its input features over x and z
    (MindSpore's 3D layout), 1/t of it on a rank; the norms' weights over x only, like the stream's width."""
    for report, _ in stages_3d:
        layer = f"layers.{report['stage']}"
        shapes = report["local_shapes"]
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo"):
            assert shapes[f"{layer}.{name}.weight"] == [32, 16]  # [64, 64] / (y, x z)
        assert shapes[f"{layer}.feed_forward.w1.weight"] == shapes[f"{layer}.feed_forward.w3.weight"] == [64, 16]
        assert shapes[f"{layer}.feed_forward.w2.weight"] == [32, 32]  # [64, 128] / (x, y z)
        assert shapes[f"{layer}.attention_norm.weight"] == [32]
        assert report["planned"]["shape_mismatches"] == {}
        # what a restore from full weights slices by the compiled layouts (models/weights.py take_slice, with the
        # slice shape MindSpore's layout carries): the projections' input features are split over two mesh axes,
        # listed flat (wq: [2, 0, 1], y then x and z)
        multi = set()
        for name, (dev_matrix, tensor_map, shape, group) in report["layouts"].items():
            layout = (dev_matrix, tensor_map, shapes[name], 1, True, group, shape)
            if len(tensor_map) > len(shape) > 1:
                multi.add(name.rsplit(".", 2)[-2])
            assert list(take_slice(np.zeros(shape, np.float32), layout, report["rank"]).shape) == shapes[name], name
        assert multi == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}


def test_3d_kept_layer_and_head_send_the_formulas_bytes(stages_3d):
    """Last stage (one kept layer and the head, two micro batches): no all-reduce of activations but the norms'
    [T/zy, 1] over x; over y the inputs' gathers and wo's and w2's scatters ([T/z, h/x]); over z the seven weights'
    gathers ([e/y, h/x]), their gradients reduce-scattered back; over x the projections' scatters and gathers
    ([T/z, e/y]); over x and z the redistributions of q, k, v and the core's output to and from the head split; and
    the final norm's output [T/zy, h/x] all-gathered for the head over x, then y, then z (its gradient
    reduce-scattered back). What a rank sends equals the planner's formula, group by group."""
    report, collectives = stages_3d[1]
    assert report["stage"] == 1
    tp = tp_collectives(report, collectives)
    cfg = load_config(TINY_LLAMA, SETS_3D)
    m, x, y, z, fp32 = cfg.parallel.micro_batch_num, 2, 2, 2, 4
    tokens, h, f, q = 4 * 64, 64, cfg.model.ffn_hidden_size, 64
    assert {c["offsets"] for c in tp if c["kind"] != "AllReduce"} == {X3, Z3, Y3}
    reduces = [c for c in tp if c["kind"] == "AllReduce"]
    norms = [c for c in reduces if c["offsets"] == X3]  # two in the layer and the final norm, forward and backward
    assert len(norms) == 1 and norms[0]["count"] == 6 * m and norms[0]["bytes"] == 6 * m * tokens // (z * y) * fp32
    assert all(c["bytes"] / c["count"] <= tokens * fp32 for c in reduces)  # norms and loss: none of activations
    weights = [c for c in tp if c["offsets"] == Z3 and c["kind"] == "AllGather" and c["purpose"] == "operator"]
    assert weights[0]["count"] == 7 * m and weights[0]["bytes"] == m * h // x * (4 * q + 3 * f) // y * fp32
    sent = {
        g: sum(ring_bytes(c) for c in tp if c["offsets"] == g and c["kind"] != "AllReduce") / m for g in (X3, Z3, Y3)
    }
    head = {X3: tokens // 4 * h * fp32 / 2, Y3: tokens // 2 * h * fp32 / 2, Z3: tokens * h * fp32 / 2}  # each way
    planned = nd_tp_bytes_by_group(cfg)
    norms_x = 2 * 2 * 2 * (x - 1) / x * tokens / (z * y) * fp32  # the layer's norms both ways, in planned["x"]
    assert sent[Y3] == pytest.approx(planned["y"] + 2 * head[Y3])
    assert sent[X3] + sent[Z3] == pytest.approx(
        planned["x"] - norms_x + planned["z"] + planned["heads"] + 2 * (head[X3] + head[Z3])
    )
    assert communication(cfg, 1)["tp"] == pytest.approx(m * (sum(planned.values()) + 2 * sum(head.values())))


def test_3d_recomputed_layer_repeats_its_collectives(stages_3d):
    """First stage (its layer fully recomputed with recompute.comm): the recompute repeats every forward collective
    but w2's scatter over y (as under 2D), the weights' gathers over z and the attention redistributions too. What a
    rank sends equals the planner's bytes for a recomputed layer, and the pipeline sends the stream [T, h] / t."""
    report, collectives = stages_3d[0]
    cfg = load_config(TINY_LLAMA, SETS_3D)
    assert Layout.of(cfg).recomputed == (0,)
    tp = tp_collectives(report, collectives)
    m, fp32, tokens, h = cfg.parallel.micro_batch_num, 4, 4 * 64, 64
    weights = [c for c in tp if c["offsets"] == Z3 and c["kind"] == "AllGather" and c["purpose"] == "operator"]
    assert weights[0]["count"] == 2 * 7 * m  # forward and recomputed forward
    sent = {g: sum(ring_bytes(c) for c in tp if c["offsets"] == g) / m for g in (X3, Z3, Y3)}
    planned = nd_tp_bytes_by_group(cfg, "recomputed")
    assert sent[Y3] == pytest.approx(planned["y"]) == pytest.approx(1.375 * nd_tp_bytes_by_group(cfg)["y"])
    assert sent[X3] + sent[Z3] == pytest.approx(planned["x"] + planned["z"] + planned["heads"])
    assert communication(cfg, 0)["tp"] == pytest.approx(m * sum(sent.values()))
    sends = sum(c["bytes"] for c in collectives if c["kind"] == "Send")
    assert sends == m * tokens * h // 8 * fp32 == communication(cfg, 0)["pp_send_recv"]


# One stage, context parallel 2 (flash attention, bf16) and every layer fully recomputed with its communication
RECOMPUTED = [
    *SMALL,
    "model.num_layers=2",
    "model.num_kv_heads=4",
    "model.compute_dtype=bfloat16",
    "parallel.data_parallel=1",
    "parallel.model_parallel=4",
    "parallel.tp_x=2",
    "parallel.tp_y=2",
    "parallel.context_parallel=2",
    "train.micro_batch_size=1",
    "recompute.mode=full",
    "recompute.comm=true",
]


def test_context_parallel_and_recomputed_communication(tmp_path):
    """Under context parallel each rank's projections see its S/c tokens, and a fully recomputed layer with
    recompute.comm repeats in the backward all its forward collectives over x and three of its four over y (the
    input gathers and wo's scatter): the planner's bytes per group, plus the head's gather and scatter."""
    [report] = dryrun(TINY_LLAMA, *RECOMPUTED, ranks="0", ir_dir=tmp_path)
    collectives = collectives_of(parse_ir(read_validate_ir(tmp_path / "rank0"), 0))[0]
    cfg = load_config(TINY_LLAMA, RECOMPUTED)
    assert Layout.of(cfg).recomputed == (0, 1) and Layout.of(cfg).attention == "flash"
    layers, x, y, bf16 = 2, 2, 2, 2
    stream = 64 // 2 * 64 * bf16  # [S/c, h] of one row
    head = {"x": 2 * stream * (x - 1) / x, "y": 2 * stream / x * (y - 1) / y}
    planned = nd_tp_bytes_by_group(cfg, "recomputed")
    assert planned["x"] == pytest.approx(1.5 * nd_tp_bytes_by_group(cfg)["x"])
    for group, ranks in (("x", X_GROUP), ("y", Y_GROUP)):
        sent = sum(ring_bytes(c) for c in collectives if c["ranks"] == ranks)
        assert sent == pytest.approx(layers * planned[group] + head[group])
    assert report["planned"]["shape_mismatches"] == {}


@pytest.mark.parametrize(
    "sets, message",
    [
        (["parallel.tp_x=2", "parallel.tp_y=4"], "is not the tensor degree parallel.model_parallel=4"),
        (["parallel.tp_x=4", "parallel.tp_y=1"], "needs tp_x and tp_y >= 2"),
        (["parallel.tp_x=2", "parallel.tp_y=2", "parallel.sequence_parallel=true"], "nothing left to split"),
        (["parallel.tp_x=2", "parallel.tp_y=2", "hardware=cpu"], "on CPU"),
        (
            ["parallel.tp_x=2", "parallel.tp_y=2", "finetune.lora.rank=8", "checkpoint.load_path=base"],
            "strategies are 1D",
        ),
        # 3D
        (["parallel.tp_x=2", "parallel.tp_y=2", "parallel.tp_z=2"], "= 8 is not the tensor degree"),
        ([*TP3D, "parallel.tp_x=1", "parallel.tp_y=4"], "tp_y >= 2"),
        (["parallel.tp_z=4"], "3D tensor parallel needs tp_x and tp_y >= 2"),
        (["parallel.tp_x=2", "parallel.tp_y=2", "parallel.tp_z=0"], "parallel.tp_z=0: must be >= 1"),
        ([*TP3D, "parallel.sequence_parallel=true"], "3D tensor parallel already splits"),
        ([*TP3D, "hardware=cpu"], "on CPU: 3D tensor parallel"),
        ([*TP3D, "model.arch=gpt"], "3D tensor parallel is built for llama, qwen2, qwen3 only"),
        ([*TP3D, "finetune.lora.rank=8", "checkpoint.load_path=base"], "strategies are 1D"),
        ([*TP3D, "model.seq_length=6", "train.micro_batch_size=1"], "6 tokens per micro batch"),
    ],
)
def test_refused_in_one_line(sets, message):
    base = [s for s in SETS if "tp_" not in s]
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(TINY_LLAMA, [*base, *sets])  # validates
    assert "\n" not in str(refused.value)
    assert "must be >= 1" in message or "leave tp_x, tp_y and tp_z at 1" in str(refused.value)


def test_1d_and_cpu_layouts_unchanged():
    """Default degrees (1, 1) and a CPU run compile no 2D strategy: nd_tp is off."""
    assert not Layout.of(load_config(TINY_LLAMA)).nd_tp
    assert not Layout.of(load_config(TINY_LLAMA, [s for s in SETS if "tp_" not in s])).nd_tp
