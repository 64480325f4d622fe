"""Multi-token prediction under pipeline stages, compiled by MindSpore's dry run (tools/dryrun.py):
configs/tiny/deepseek_v3_tiny.yaml with one module (model.mtp_depth 1), 2 stages of one layer, dp 2 with expert
parallel 2, tensor and sequence parallel 2, the optimizer shard, packed inputs (segment_ids and a loss mask, which
the module shifts), the first and the last stage compiled once.

What the compile must show: the module's parameters on the last stage only, and there a copy of the token
embedding its lookup reads (as for a tied head), each slice as the planner cuts it, and the bytes equal to the
planner's."""

from mindscale.config import REPO_ROOT, Layout, load_config
from tests.dryrun.test_dryrun import dryrun

DEEPSEEK_V3_TINY = REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml"
STAGES = [
    "hardware=ascend910b",
    "model.num_layers=2",
    "model.seq_length=64",
    "model.vocab_size=256",
    "model.mtp_depth=1",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=2",
    "parallel.expert_parallel=2",
    "parallel.optimizer_shard=true",
    "parallel.sequence_parallel=true",
]


def test_the_modules_and_an_embedding_copy_compile_on_the_last_stage_as_planned():
    layout = Layout.of(load_config(DEEPSEEK_V3_TINY, STAGES), "Ascend")
    assert (layout.dp, layout.tp, layout.ep, layout.pp) == (2, 2, 2, 2)
    first, last = dryrun(DEEPSEEK_V3_TINY, *STAGES, packed=True)
    assert (first["stage"], last["stage"]) == (0, 1)
    for report in (first, last):
        assert report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}
    assert not any(name.startswith("mtp.") for name in first["local_shapes"])
    held = [name for name in last["local_shapes"] if name.startswith("mtp.0.")]
    assert {"mtp.0.enorm.weight", "mtp.0.eh_proj.weight", "mtp.0.block.feed_forward.experts.w1"} <= set(held)
    assert "tok_embeddings.weight" in first["local_shapes"] and "tok_embeddings.weight" in last["local_shapes"]
    # the projection [h, 2h] whole on every tensor-parallel rank, its stored slice cut by the optimizer shard
    assert last["layouts"]["mtp.0.eh_proj.weight"][2] == [128, 256]
