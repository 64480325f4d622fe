"""The interleaved pipeline (parallel.pipeline_interleave v > 1) compiled by MindSpore's dry run.

Each stage holds v model chunks, placed round-robin (Layout): with 8 layers over pp2 x v2, stage 0 holds
layers 0-1 and 4-5, stage 1 layers 2-3 and 6-7. What the compiled graph must show, per stage: exactly
those layers' weights (the embedding on the first stage, the final norm and head on the last), the
pipeline_config the runtime set, and one forward border per micro batch for each chunk MindSpore derived
(the first stage's first chunk is fed by the embedding, the last stage's last feeds the head). And every
scheduler MindScale accepts compiles; and at level 1 the execution order holds as many chunk forwards in
flight as the planner counts. A dry run proves compiler acceptance and MindSpore's plan only: not the
schedule's speed or numerics.
"""

import re

import pytest

from mindscale.config import Layout, load_config
from mindscale.launch.dryrun_memory import plan_files
from mindscale.perf import planner
from test_dryrun import SMALL, TINY_GPT, TINY_LLAMA, dryrun

INTERLEAVED = [
    "model.num_layers=8",
    "parallel.pipeline_stage=2",
    "parallel.pipeline_interleave=2",
    "parallel.micro_batch_num=4",
]
TWINS = {
    "gpt_dp2_pp2_v2": (TINY_GPT, [*SMALL, *INTERLEAVED, "parallel.data_parallel=2"]),
    "llama_tp2_pp2_v2": (TINY_LLAMA, [*SMALL, *INTERLEAVED, "parallel.model_parallel=2", "model.num_kv_heads=2"]),
}
# The schedulers MindSpore 2.9 compiles for a round-robin interleaved layout (zero_bubble_v needs a V,
# mindscale/config/validate.py refuses it); 1f1b is the twins' above
SCHEDULERS = ["gpipe", "seqpipe", "seqvpp", "seqsmartvpp"]
CHEAP = [
    *SMALL,
    "parallel.data_parallel=1",
    "parallel.pipeline_stage=2",
    "parallel.pipeline_interleave=2",
    "parallel.micro_batch_num=2",
]


def held_layers(report) -> list[int]:
    return sorted({int(name.split(".")[1]) for name in report["local_shapes"] if name.startswith("layers.")})


@pytest.mark.parametrize("name", TWINS)
def test_each_stage_holds_its_chunks_layers_and_borders(name):
    config, sets = TWINS[name]
    cfg = load_config(config, sets)
    layout = Layout.of(cfg, "Ascend")
    reports = dryrun(config, *sets)
    assert [r["stage"] for r in reports] == [0, 1]
    assert [layout.layers_of_stage(s) for s in (0, 1)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    m = cfg.parallel.micro_batch_num
    for report in reports:
        stage = report["stage"]
        assert held_layers(report) == layout.layers_of_stage(stage)
        assert report["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}
        held = set(report["local_shapes"])
        assert ("tok_embeddings.weight" in held) == (stage == 0 or cfg.model.tie_embeddings)
        assert ("norm.weight" in held) == (stage == 1)
        assert ("output.weight" in held) == (stage == 1 and not cfg.model.tie_embeddings)
        # MindSpore numbered two chunks per stage: a forward Send ends, a Receive begins, each chunk per micro
        # batch, but for the first stage's first chunk (fed by the embedding) and the last stage's last
        sends = {str(c): m for c in range(2) if (stage, c) != (1, 1)}
        receives = {str(c): m for c in range(2) if (stage, c) != (0, 0)}
        assert report["pipeline_chunks"] == {"Send": sends, "Receive": receives}
        assert report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_each_accepted_scheduler_compiles_both_stages(scheduler):
    sets = [*CHEAP, f"parallel.pipeline_scheduler={scheduler}"]
    reports = dryrun(TINY_LLAMA, *sets)
    assert [r["stage"] for r in reports] == [0, 1]
    for report in reports:
        assert report["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": scheduler}
        assert held_layers(report) == [[0, 2], [1, 3]][report["stage"]]


# p 2, v 2 and m 5: m mod p = 1 micro batch fills no round, and MindSpore's scheduler runs it in the first
_FIRST_ROUND = [*CHEAP[:-1], "parallel.micro_batch_num=5"]
_KEPT_NORM = re.compile(
    r"^%\d+T\t#(\d+)S\t#\d+S\t&\d+\t\w+\t\w+\t(\d+)\t(\d+)\tDefault/\S*/attention_norm-\S*Norm-op\d+$", re.M
)


def chunk_forwards_in_flight(plan: str) -> int:
    """The most chunk forwards a stage holds at once in MindSpore's plan (execution steps): each chunk forward's
    first norm output (the largest of the op's outputs) is kept for its backward, so it lives from that forward
    to its backward."""
    outputs = [(int(size), int(start), int(end)) for size, start, end in _KEPT_NORM.findall(plan)]
    largest = max(size for size, _, _ in outputs)
    events = sorted(e for size, start, end in outputs if size == largest for e in ((start, 1), (end + 1, -1)))
    held = most = 0
    for _, change in events:
        held += change
        most = max(most, held)
    return most


def test_compiled_order_holds_the_planned_chunk_forwards(tmp_path):
    cfg = load_config(TINY_GPT, _FIRST_ROUND)
    layout = Layout.of(cfg, "Ascend")
    reports = dryrun(TINY_GPT, *_FIRST_ROUND, ir_dir=tmp_path, memory=True)
    for report in reports:
        (plan,) = plan_files([tmp_path / f"rank{report['rank']}"], report["rank"])
        planned = planner.in_flight_forwards(layout.pp, layout.interleave, layout.micro_steps, report["stage"])
        assert chunk_forwards_in_flight(plan.read_text()) == planned == [6, 4][report["stage"]]
