"""Expert parallel compiled by MindSpore's dry run (tools/dryrun.py): a scaled Mixtral twin (4 layers, 8
experts, widths of 64) with parallel.expert_parallel 2 and 4 next to tensor parallel, sequence parallel,
2 pipeline stages and the optimizer shard, first and last stage.

What the compiled graph must show (a dry run proves what the compiler accepted, not kernels or speed):
the tokens reach their experts by AlltoAll over each expert-parallel group; every rank holds its experts'
slices [E/ep, F/tp, h] exactly as the planner sizes them, name by name, with the same bytes; the planner's
AlltoAll bytes are the compiled ones; and an expert's gradients are reduced only over the dp/ep ranks that
hold the same experts (Megatron's expert-data-parallel group), the other weights over all dp ranks.
"""

import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.launch.dryrun_ranks import ring_send_bytes
from mindscale.perf import planner
from tests.dryrun.test_dryrun import dryrun

MIXTRAL_TINY = REPO_ROOT / "configs" / "tiny" / "mixtral_tiny.yaml"
WIDTHS = [  # tests/dryrun/test_grouped_experts.py's too
    "hardware=ascend910b",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
    "model.seq_length=64",
    "model.moe.num_experts=8",
]
TWIN = [
    *WIDTHS,
    "model.num_layers=4",
    "model.moe.capacity_factor=1.5",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "parallel.data_parallel=4",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=2",
    "parallel.sequence_parallel=true",
    "parallel.optimizer_shard=true",
]
EXPERTS = ("w1", "w3", "w2")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ep: f"ep{ep}")
def compiled(request):
    overrides = [*TWIN, f"parallel.expert_parallel={request.param}"]
    cfg = load_config(MIXTRAL_TINY, overrides)
    return cfg, dryrun(MIXTRAL_TINY, *overrides)


def test_first_and_last_stage_compile_with_the_planners_slices(compiled):
    cfg, reports = compiled
    layout = Layout.of(cfg)
    assert [r["stage"] for r in reports] == [0, 1]
    e, f, h = cfg.model.moe.num_experts, cfg.model.ffn_hidden_size, cfg.model.hidden_size
    for report in reports:
        assert report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}
        planned = planner.stored_shapes(cfg, report["stage"])
        slices = {p.name: p.local for p in planner.parameter_slices(cfg)}
        # the model-parallel slice [E/ep, F/tp, h], stored cut over the dp/ep ranks holding it (optimizer shard)
        replicas = layout.dp // layout.ep
        for i in layout.layers_of_stage(report["stage"]):
            names = {w: f"layers.{i}.feed_forward.experts.{w}" for w in EXPERTS}
            shapes = {w: tuple(report["local_shapes"][name]) for w, name in names.items()}
            assert shapes == {w: planned[name] for w, name in names.items()}
            assert {w: slices[name] for w, name in names.items()} == {
                "w1": (e // layout.ep, f // layout.tp, h),
                "w3": (e // layout.ep, f // layout.tp, h),
                "w2": (e // layout.ep, h, f // layout.tp),
            }
            assert all(shapes[w][0] == slices[names[w]][0] // replicas for w in EXPERTS)


def test_tokens_reach_their_experts_by_alltoall_of_the_planners_bytes(compiled):
    cfg, reports = compiled
    layout = Layout.of(cfg)
    for report in reports:
        # not the last stage's AlltoAlls within its tensor-parallel group (sequence-parallel redistribution)
        tp_group = list(range(report["rank"], report["rank"] + layout.tp))
        alltoall = [
            row
            for row in report["collectives"]
            if row["kind"] == "AlltoAll" and row["group_size"] == layout.ep and row["ranks"] != tp_group
        ]
        layers = len(layout.layers_of_stage(report["stage"]))
        # dispatch and combine, forward and backward, per layer and micro batch (the last stage adds a few of
        # 8 bytes in the same group: the loss's token sums)
        assert sum(row["count"] for row in alltoall) >= 4 * layers * layout.micro_steps
        sent = sum(ring_send_bytes(row) for row in alltoall)
        assert sent == pytest.approx(planner.communication(cfg, report["stage"])["ep"], rel=1e-3)


def test_expert_gradients_reduce_over_the_ranks_holding_the_same_experts(compiled):
    """dp 4 x tp 2 per stage: attention weights (split over tp) reduce over the 4 dp ranks; experts (split
    over ep and tp) only over dp/ep: at ep 4 nowhere, at ep 2 in pairs, reduce-scattered by the optimizer
    shard over those pairs (their adam_m is half their model-parallel slice)."""
    cfg, reports = compiled
    layout = Layout.of(cfg)
    report = reports[0]
    groups = {
        row["group_size"] for row in report["collectives"] if row["purpose"] in ("grad_reduce", "optimizer_shard")
    }
    name = "layers.0.feed_forward.experts.w1"
    local = next(p.local for p in planner.parameter_slices(cfg) if p.name == name)
    replicas = layout.dp // layout.ep
    assert report["local_shapes"][f"adam_m.{name}"][0] == local[0] // replicas
    assert (replicas in groups) == (replicas > 1) and layout.dp in groups
