"""A config's scaled twin (mindscale.config.twin, tools/dryrun.py --twin) keeps what its full-size compile has:
every key but the few it scales, every width (so every parameter's shape, strategy and optimizer shard), every
parallel decision of its Layout, and on each pipeline stage the layers it recomputes and offloads (of each kind
where the model has dense first layers) and a kept one where the full stage keeps layers apart from offloaded
ones. tests/dryrun/test_dryrun.py compiles every shipped config's twin and checks what the compiled step moves."""

import dataclasses

import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.config.twin import layer_role, twin_overrides
from models.archs import ARCHS

SHIPPED = sorted(
    p
    for d in (*(d for spec in ARCHS.values() for d in spec.config_dirs), "finetune")
    for p in (REPO_ROOT / "configs" / d).glob("*.yaml")
    if p.name != "base.yaml" and load_config(p).hardware.device_target == "Ascend"
)
# the keys a twin may set: layers, sequence, micro batches and chunks, and what follows from the layers per stage
SCALED = {
    "model.num_layers",
    "model.seq_length",
    "model.moe.dense_layers",
    "train.global_batch_size",
    "parallel.micro_batch_num",
    "parallel.gradient_accumulation_steps",
    "parallel.pipeline_interleave",
    "parallel.stage_offset",
    "recompute.layers",
    "offload.layers",
}
# the Layout fields that follow from those keys
COUNTED = (
    "micro_steps",
    "interleave",
    "stages_of_layers",
    "chunks_of_layers",
    "layers_per_stage",
    "recomputed",
    "offloaded",
)


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def stage_roles(cfg, layout, stage: int) -> set[tuple[str, bool]]:
    """(role, dense) of the layers of `stage` (mindscale.config.twin.layer_role)."""
    moe = cfg.model.spec.moe
    return {(layer_role(layout, i), moe and i < cfg.model.moe.dense_layers) for i in layout.layers_of_stage(stage)}


def assert_twin_keeps(full, twin):
    full_layout, twin_layout = Layout.of(full, "Ascend"), Layout.of(twin, "Ascend")
    changed = {key for key, value in flat(twin.to_dict()).items() if flat(full.to_dict())[key] != value}
    assert changed <= SCALED, changed - SCALED
    assert dataclasses.replace(twin_layout, **{f: getattr(full_layout, f) for f in COUNTED}) == full_layout
    assert (twin_layout.interleave > 1, twin_layout.micro_steps > 1) == (
        full_layout.interleave > 1,
        full_layout.micro_steps > 1,
    )
    for stage in range(full_layout.pp):
        want, have = stage_roles(full, full_layout, stage), stage_roles(twin, twin_layout, stage)
        assert {r for r in have if r[0] != "kept"} == {r for r in want if r[0] != "kept"}, stage
        assert {dense for _, dense in have} == {dense for _, dense in want}, stage
        kept_apart = {r for r in want if r[0] == "kept" and ("offloaded", r[1]) not in want}
        assert kept_apart <= have, stage


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_twin_of_every_shipped_config_keeps_its_keys_widths_and_layer_roles(path):
    full = load_config(path)
    twin = load_config(path, twin_overrides(full))
    assert {o.split("=", 1)[0] for o in twin_overrides(full)} <= SCALED
    assert_twin_keeps(full, twin)


def test_a_stage_that_recomputes_and_offloads_keeps_both_in_its_twin():
    """qwen2_5_72b with the first four of its 8 stages recomputing a layer and offloading three: the twin gave
    each stage one layer, which recompute took, and offloaded nothing ([0,0,0,0,0,0,0,0])."""
    layout = ["recompute.mode=full", "recompute.layers=[1,1,1,1,0,0,0,0]", "offload.layers=[3,3,3,3,0,0,0,0]"]
    full = load_config(REPO_ROOT / "configs" / "qwen2" / "qwen2_5_72b.yaml", layout)
    twin = load_config(REPO_ROOT / "configs" / "qwen2" / "qwen2_5_72b.yaml", [*layout, *twin_overrides(full)])
    assert_twin_keeps(full, twin)
    twin_layout = Layout.of(twin, "Ascend")
    assert [twin_layout.offloaded_in(s) for s in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert [twin_layout.recomputed_in(s) for s in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
