"""A sharded checkpoint resumes only under the layout its slices were written for: state.json's "layout"
(mindscale/train/checkpoints/folder.py), compared by the Checkpointer before it reads a slice."""
import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.train.checkpoints.folder import RECORD_ADDED, layout_record, same_layout

MIXTRAL = REPO_ROOT / "configs" / "mixtral" / "mixtral_8x7b.yaml"   # dp8 x pp8 x ep8, 3 chunks a stage
ONE_CHUNK = ["parallel.pipeline_interleave=1", "parallel.stage_offset=0"]


def record(*overrides: str) -> dict:
    cfg = load_config(MIXTRAL, list(overrides))
    return layout_record(cfg, Layout.of(cfg, "Ascend"))


def test_the_same_layout_resumes():
    assert same_layout(record(), record())
    assert same_layout(record("train.steps=7"), record())   # what does not move a slice


@pytest.mark.parametrize("changed", [
    ["parallel.expert_parallel=4"],                                      # each rank holds 2 of 8 experts, not 1
    ONE_CHUNK,                                                           # a stage holds 4 layers, not 3 chunks
    [*ONE_CHUNK[:1], "parallel.stage_offset=[1,0,0,0,0,0,0,-1]"],       # stage 0 holds 5 layers, the last 3
    ["parallel.data_parallel=4", "parallel.micro_batch_num=256", "parallel.expert_parallel=4"],
], ids=["expert_parallel", "interleave", "stage_offset", "data_parallel"])
def test_a_layout_that_moves_slices_is_refused(changed):
    assert record(*changed) != record() and not same_layout(record(), record(*changed))


def test_a_record_written_before_the_expert_and_stage_keys_is_compared_on_its_own_keys():
    old = {k: v for k, v in record().items() if k not in RECORD_ADDED}
    assert same_layout(old, record())
    assert not same_layout(old, record("parallel.data_parallel=4", "parallel.micro_batch_num=256",
                                       "parallel.expert_parallel=4"))


def test_sharded_and_unsharded_never_match():
    assert not same_layout({}, record()) and not same_layout(record(), {}) and same_layout({}, {})


def test_a_record_missing_other_keys_is_refused():
    """Only the keys added on 2026-12-06 may be missing: a record without, say, its vocabulary split is not
    a record of the same layout."""
    assert not same_layout({k: v for k, v in record().items() if k != "vocab_parallel"}, record())
