"""Dropless experts on GroupedMatmul (model.moe.dispatch: grouped) compiled by MindSpore's dry run: a tiny Mixtral
(2 layers, 8 experts, widths of 64) at dp 4 with expert parallel 2 and the optimizer shard, rank 0.

What the compiled graph must show (a dry run proves what the compiler accepted, not the kernels, which are
Ascend's, nor the dynamic shapes' traffic): each rank holds its experts' slice [E/ep, F, h] as the planner
sizes it, with the same bytes; per layer one AlltoAll of the per-expert counts and five AlltoAllV (the rows,
their expert ids and the results, forward; the rows' gradients both ways, backward); and the expert weights'
gradients are reduced over the dp/ep ranks holding the same experts only (here by the optimizer shard's
ReduceScatter over ranks 0 and 2). docs/evidence/dryrun.md, "Dropless by GroupedMatmul", has the probes."""

from mindscale.config import Layout, load_config
from mindscale.perf import planner
from tests.dryrun.test_dryrun import dryrun
from tests.dryrun.test_experts import MIXTRAL_TINY, WIDTHS

GROUPED = [
    *WIDTHS,
    "model.num_layers=2",
    "model.moe.capacity_factor=null",
    "model.moe.dispatch=grouped",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "parallel.data_parallel=4",
    "parallel.expert_parallel=2",
    "parallel.optimizer_shard=true",
]


def test_the_grouped_dispatch_compiles_with_its_collectives_and_the_planners_slices():
    cfg = load_config(MIXTRAL_TINY, GROUPED)
    layout = Layout.of(cfg, "Ascend")
    (report,) = dryrun(MIXTRAL_TINY, *GROUPED, ranks="0")
    assert report["planned"]["shape_mismatches"] == {}
    assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}
    e, f, h, layers = cfg.model.moe.num_experts, cfg.model.ffn_hidden_size, cfg.model.hidden_size, 2
    slices = {p.name: p.local for p in planner.parameter_slices(cfg)}
    assert list(slices["layers.0.feed_forward.experts.w1"]) == [e // layout.ep, f, h]
    counts = {}
    for row in report["collectives"]:
        counts[row["kind"]] = counts.get(row["kind"], 0) + row["count"]
    assert (counts["AlltoAll"], counts["AlltoAllV"]) == (layers, 5 * layers)
    # the experts' gradients: over the dp/ep ranks holding the same experts (w1, w3, w2 of each layer)
    holders = list(range(0, layout.dp, layout.ep))
    expert_reduce = [row for row in report["collectives"] if row["kind"] == "ReduceScatter" and row["ranks"] == holders]
    assert sum(row["count"] for row in expert_reduce) == 3 * layers
