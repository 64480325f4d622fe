"""mindscale/config/layout.py: every decision derived from a config's layout, computed in one place."""

import re

import pytest

from mindscale.config import REPO_ROOT, Layout, load_config

TINY = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"


def layout(*overrides, device=None, world=None):
    return Layout.of(
        load_config(
            TINY,
            [
                "model.num_heads=4",
                "model.num_kv_heads=2",
                "model.num_layers=4",
                "train.global_batch_size=null",
                *overrides,
            ],
        ),
        device,
        world,
    )


def test_ranks_read_by_data_parallel_index_the_same_rows_across_model_parallel_and_stages():
    lay = layout(
        "hardware=ascend910b",
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
    )
    assert [lay.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [lay.stage_of_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(lay.stage_ranks(1)) == [4, 5, 6, 7] and lay.logging_rank == 4 and layout().logging_rank == 0
    assert lay.devices == 8
    assert lay.rows_per_step == 4 * 2 and lay.accumulates_in_graph


def test_expert_groups_are_the_inner_ep_axis_of_each_stage():
    """Grouped dispatch's AlltoAll groups (models/moe.py GroupedExperts: rows over a (dp/ep, ep) device matrix):
    consecutive data-parallel shares, ep at a time, never across stages."""
    cfg = load_config(
        REPO_ROOT / "configs" / "tiny" / "mixtral_tiny.yaml",
        [
            "hardware=ascend910b",
            "model.num_layers=2",
            "model.moe.capacity_factor=null",
            "model.moe.dispatch=grouped",
            "train.global_batch_size=null",
            "parallel.data_parallel=4",
            "parallel.expert_parallel=2",
            "parallel.pipeline_stage=2",
            "parallel.micro_batch_num=2",
        ],
    )
    lay = Layout.of(cfg)
    assert [lay.expert_ranks(r) for r in (0, 1, 2, 3, 5, 6)] == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [6, 7]]


def test_stage_of_cells_and_parameters():
    lay = layout(
        "hardware=ascend910b",
        "parallel.data_parallel=2",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.stage_offset=[1,-1]",
    )
    assert lay.stages_of_layers == (0, 0, 0, 1)
    assert lay.stage_of("tok_embeddings") == lay.stage_of("tok_embeddings.weight") == lay.stage_of("") == 0
    assert lay.stage_of("layers.3.attention.wq.weight") == 1 and lay.stage_of("layers.2") == 0
    assert lay.stage_of("output.weight") == lay.stage_of("norm") == lay.stage_of("loss") == 1


@pytest.mark.parametrize(
    "overrides,device,world,sharded,mode",
    [
        (["parallel.data_parallel=2"], "CPU", 2, False, True),  # data parallel on CPU
        (["parallel.data_parallel=2", "parallel.model_parallel=2"], "Ascend", 4, True, False),
        (["parallel.data_parallel=2", "parallel.optimizer_shard=true"], "Ascend", 2, True, False),
        (["parallel.data_parallel=2", "parallel.model_parallel=2"], "CPU", 1, False, False),  # generate: one process
        (["parallel.data_parallel=2"], "Ascend", 2, False, True),
        # accumulation with several workers: semi-auto on an accelerator (its passes order the micro batches)
        (["parallel.data_parallel=2", "parallel.gradient_accumulation_steps=4"], "Ascend", 2, True, False),
        (["parallel.data_parallel=2", "parallel.gradient_accumulation_steps=4"], "CPU", 2, False, True),
    ],
)
def test_sharded_means_semi_auto_parallel_with_several_workers(overrides, device, world, sharded, mode):
    lay = layout(*overrides, device=device, world=world)
    assert lay.sharded == sharded and lay.data_parallel_mode == mode
    assert lay.cpu_kernels == (device == "CPU" and not sharded)


def test_attention_and_norm_kernels_follow_the_device_and_the_profile():
    for dtype in ("bfloat16", "float16"):
        assert layout("hardware=ascend910b", f"model.compute_dtype={dtype}", device="Ascend").attention == "flash"
    assert layout("hardware=ascend910b", device="Ascend").fused_norm
    assert layout("hardware=ascend910b", device="CPU").attention == "composite"  # auto off Ascend
    assert layout("hardware=ascend910a", device="Ascend").attention == "composite"  # 910A has no FlashAttentionScore
    assert layout("hardware=ascend910b", "model.attention=composite", device="Ascend").attention == "composite"


def test_auto_attention_is_composite_where_flash_attention_score_refuses_the_dtype():
    """FlashAttentionScore takes float16 and bfloat16 only (docs/models.md): under fp32 compute, llama_tiny
    at dp2 x tp2 on 910B gets the composite core; the RmsNorm kernel (fed fp32 by every norm) stays."""
    lay = layout("hardware=ascend910b", "parallel.data_parallel=2", "parallel.model_parallel=2", device="Ascend")
    assert lay.attention == "composite" and lay.fused_norm


def test_graph_reuse_is_per_layer_or_per_micro_batch():
    assert layout().graph_reuse == "layer"
    assert layout("run.reuse_layer_graph=false").graph_reuse == "none"
    micro = [
        "hardware=ascend910b",
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        "parallel.gradient_accumulation_steps=4",
    ]
    assert layout(*micro).graph_reuse == "model"  # MindSpore allows lazy_inline only on the outermost cell
    assert layout(*micro[:-1]).graph_reuse == "layer"


def test_recomputed_layers_are_the_first_of_each_stage():
    lay = layout(
        "hardware=ascend910b",
        "model.num_layers=8",
        "parallel.data_parallel=1",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.stage_offset=[1,-1]",
        "recompute.mode=full",
        "recompute.layers=[2,1]",
    )
    assert lay.layers_per_stage == (5, 3) and lay.recomputed == (0, 1, 5)


def test_interleave_places_chunks_round_robin_and_recomputes_the_first_layers_a_stage_holds():
    """v=2 over 2 stages: chunk k of the p x v chunks goes to stage k mod p (Megatron's, MindFormers' order)."""
    lay = layout(
        "hardware=ascend910b",
        "model.num_layers=8",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.pipeline_interleave=2",
        "recompute.mode=full",
        "recompute.layers=3",
    )
    assert lay.stages_of_layers == (0, 0, 1, 1, 0, 0, 1, 1)
    assert lay.chunks_of_layers == (0, 0, 0, 0, 1, 1, 1, 1)
    assert lay.layers_of_stage(1) == [2, 3, 6, 7] and lay.layers_per_stage == (4, 4)
    assert lay.recomputed == (0, 1, 2, 3, 4, 6)


def test_offloaded_layers_are_the_first_each_stage_does_not_recompute():
    """A layer is recomputed or offloaded, never both (MindSpore ignores offload on a recomputed op): each stage
    offloads the first n layers after its recomputed ones, chunk 0 first, and an int is capped by what is left."""
    lay = layout(
        "hardware=ascend910b",
        "model.num_layers=8",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.pipeline_interleave=2",
        "recompute.mode=full",
        "recompute.layers=[1,0]",
        "offload.layers=[2,3]",
        "offload.backward_prefetch=3",
    )
    assert lay.recomputed == (0,) and lay.offloaded == (1, 2, 3, 4, 6)
    assert [lay.offloaded_in(k) for k in (0, 1)] == [2, 3] and lay.offload_prefetch == 3
    capped = layout(
        "hardware=ascend910b",
        "model.num_layers=8",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "recompute.mode=full",
        "recompute.layers=3",
        "offload.layers=5",
    )
    assert capped.recomputed == (0, 1, 2, 4, 5, 6) and capped.offloaded == (3, 7)
    assert layout("hardware=ascend910b").offloaded == ()


def test_stage_offset_per_chunk_with_interleave():
    lay = layout(
        "hardware=ascend910b",
        "model.num_layers=10",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.pipeline_interleave=2",
        "parallel.stage_offset=[[1,0],[0,1]]",
    )
    assert lay.stages_of_layers == (0, 0, 0, 1, 1, 0, 0, 1, 1, 1) and lay.layers_per_stage == (5, 5)
    assert lay.chunks_of_layers == (0,) * 5 + (1,) * 5


@pytest.mark.parametrize(
    "overrides,names",
    [
        (["parallel.pipeline_interleave=2"], "parallel.pipeline_interleave=2 needs parallel.pipeline_stage > 1"),
        (["parallel.pipeline_scheduler=gpipe"], "parallel.pipeline_scheduler=gpipe needs parallel.pipeline_interleave"),
        (
            ["parallel.pipeline_stage=2", "parallel.micro_batch_num=2", "parallel.pipeline_interleave=3"],
            "parallel.pipeline_interleave=3 does not divide the layers per stage [2, 2]",
        ),
        (
            [
                "parallel.pipeline_stage=2",
                "parallel.micro_batch_num=2",
                "parallel.pipeline_interleave=2",
                "parallel.stage_offset=[[1,0]]",
            ],
            "needs 2 lists (parallel.pipeline_interleave)",
        ),
        (
            [
                "parallel.pipeline_stage=2",
                "parallel.micro_batch_num=2",
                "parallel.pipeline_interleave=2",
                "parallel.stage_offset=[[1,0],[0,0]]",
            ],
            "gives layers per chunk [[2, 1], [1, 1]] (sum 5)",
        ),
        (["parallel.pipeline_interleave=0"], "parallel.pipeline_interleave=0: must be >= 1"),
        (
            [
                "parallel.pipeline_stage=2",
                "parallel.micro_batch_num=2",
                "parallel.pipeline_interleave=2",
                "run.reuse_layer_graph=false",
            ],
            "parallel.pipeline_interleave=2 needs run.reuse_layer_graph=true",
        ),
        (
            [
                "parallel.pipeline_stage=2",
                "parallel.micro_batch_num=2",
                "parallel.pipeline_interleave=2",
                "parallel.pipeline_scheduler=zero_bubble_v",
            ],
            "parallel.pipeline_scheduler=zero_bubble_v needs its chunks placed in a V",
        ),
    ],
)
def test_interleave_refusals_name_the_keys(overrides, names):
    from mindscale.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(names)):
        layout("hardware=ascend910b", *overrides)
