"""A sharded checkpoint resumes only under the layout its slices were written for: state.json's "layout"
(mindscale/train/checkpoints/folder.py), compared by the Checkpointer before it reads a slice."""

import math

import numpy as np
import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.train.checkpoints.folder import RECORD_ADDED, layout_record, same_layout
from models.weights import take_slice

MIXTRAL = REPO_ROOT / "configs" / "mixtral" / "mixtral_8x7b.yaml"  # dp8 x pp8 x ep8, 3 chunks a stage
ONE_CHUNK = ["parallel.pipeline_interleave=1", "parallel.stage_offset=0"]


def record(*overrides: str) -> dict:
    cfg = load_config(MIXTRAL, list(overrides))
    return layout_record(cfg, Layout.of(cfg, "Ascend"))


def test_the_same_layout_resumes():
    assert same_layout(record(), record())
    assert same_layout(record("train.steps=7"), record())  # what does not move a slice


@pytest.mark.parametrize(
    "changed",
    [
        ["parallel.expert_parallel=4"],  # each rank holds 2 of 8 experts, not 1
        ONE_CHUNK,  # a stage holds 4 layers, not 3 chunks
        [*ONE_CHUNK[:1], "parallel.stage_offset=[1,0,0,0,0,0,0,-1]"],  # stage 0 holds 5 layers, the last 3
        ["parallel.data_parallel=4", "parallel.micro_batch_num=256", "parallel.expert_parallel=4"],
    ],
    ids=["expert_parallel", "interleave", "stage_offset", "data_parallel"],
)
def test_a_layout_that_moves_slices_is_refused(changed):
    assert record(*changed) != record() and not same_layout(record(), record(*changed))


def test_a_record_written_before_the_expert_and_stage_keys_is_compared_on_its_own_keys():
    old = {k: v for k, v in record().items() if k not in RECORD_ADDED}
    assert same_layout(old, record())
    assert not same_layout(
        old, record("parallel.data_parallel=4", "parallel.micro_batch_num=256", "parallel.expert_parallel=4")
    )


def test_1d_2d_and_3d_tensor_parallel_do_not_resume_each_other():
    """The same model_parallel cuts a projection into slices of equal shapes and other contents under 1D, 2D and 3D
    (wq [e/2, h/4] at 2D 4 x 2 and at 3D 2 x 2 x 2): the record tells them apart; one written before it kept the
    split resumes as before."""
    llama = REPO_ROOT / "configs" / "llama3" / "llama3_405b.yaml"
    nd = ["parallel.sequence_parallel=false"]
    splits = [
        [],
        [*nd, "parallel.tp_x=2", "parallel.tp_y=4"],
        [*nd, "parallel.tp_x=2", "parallel.tp_y=2", "parallel.tp_z=2"],
    ]
    records = [layout_record(cfg, Layout.of(cfg, "Ascend")) for cfg in (load_config(llama, s) for s in splits)]
    assert [r["tensor_split"] for r in records] == [[1, 1, 1], [2, 4, 1], [2, 2, 2]]
    assert not any(same_layout(a, b) for a in records for b in records if a is not b)
    assert same_layout({k: v for k, v in records[0].items() if k != "tensor_split"}, records[0])


def test_sharded_and_unsharded_never_match():
    assert not same_layout({}, record()) and not same_layout(record(), {}) and same_layout({}, {})


def test_a_record_missing_other_keys_is_refused():
    """Only the keys of RECORD_ADDED may be missing: a record without, say, its vocabulary split is not
    a record of the same layout."""
    assert not same_layout({k: v for k, v in record().items() if k != "vocab_parallel"}, record())


# -- the global batch a resume keeps (mindscale/train/checkpoints/batch.py) ------------------------------
TINY = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"


def refusal(cfg, wanted: int, device: str, world: int, saved_layout) -> str:
    from mindscale.io import CheckpointError
    from mindscale.train.checkpoints.batch import check_global_batch

    with pytest.raises(CheckpointError) as refused:
        check_global_batch("ckpt", {"step": 10, "samples_consumed": 10 * wanted}, cfg, device, world, saved_layout)
    return str(refused.value).split("keep the batch with ")[1]


def test_the_same_global_batch_resumes_and_an_old_state_without_its_position_is_not_judged():
    from mindscale.train.checkpoints.batch import check_global_batch

    cfg = load_config(TINY, ["parallel.data_parallel=1", "train.micro_batch_size=2"])
    check_global_batch("ckpt", {"step": 10, "samples_consumed": 20}, cfg, "CPU", 1, {})
    check_global_batch("ckpt", {"step": 10}, cfg, "CPU", 1, {})


def test_fewer_workers_keep_the_batch_by_accumulation_where_it_keeps_the_layout():
    """CPU: accumulating the same micro batches (the same memory per device). One Ascend device cannot
    accumulate (validate.py: nothing orders the micro batches) and 2 of them would compile a sharded graph
    the unsharded checkpoint does not load into: a larger micro batch there."""
    cfg = load_config(TINY, ["parallel.data_parallel=1", "train.micro_batch_size=2"])
    assert (
        refusal(cfg, 4, "CPU", 1, {}) == "--set parallel.gradient_accumulation_steps=2, or 2 device(s) "
        "(parallel.data_parallel=2)"
    )
    ascend = load_config(TINY, ["parallel.data_parallel=1", "train.micro_batch_size=2", "hardware=ascend910b"])
    assert refusal(ascend, 4, "Ascend", 1, {}).startswith("--set train.micro_batch_size=4,")
    two = load_config(TINY, ["train.micro_batch_size=2", "hardware=ascend910b"])
    assert refusal(two, 8, "Ascend", 2, {}).startswith("--set train.micro_batch_size=4,")
    explicit = load_config(TINY, ["parallel.data_parallel=1", "train.micro_batch_size=2", "train.global_batch_size=2"])
    assert refusal(explicit, 6, "CPU", 1, {}) == (
        "--set parallel.gradient_accumulation_steps=3 --set "
        "train.global_batch_size=6, or 3 device(s) (parallel.data_parallel=3)"
    )


def test_more_workers_and_pipelines_keep_the_batch_with_fewer_micro_batches():
    cfg = load_config(
        TINY, ["parallel.data_parallel=1", "train.micro_batch_size=2", "parallel.gradient_accumulation_steps=4"]
    )
    assert refusal(cfg, 4, "CPU", 1, {}) == "--set parallel.gradient_accumulation_steps=2"
    piped = load_config(MIXTRAL)  # dp8 x pp8, 128 micro batches of 1, train.global_batch_size 1024
    record = layout_record(piped, Layout.of(piped, "Ascend"))
    assert refusal(piped, 512, "Ascend", piped.devices, record) == (
        "--set parallel.micro_batch_num=64 --set train.global_batch_size=512, or 32 device(s) "
        "(parallel.data_parallel=4)"
    )


@pytest.mark.parametrize(
    "tensor_map, nested, full_shape",
    [([2, 0, 1], [2, [0, 1]], [64, 64]), ([0, 2, 1], [0, [2, 1]], [64, 128]), ([0, 1], [[0, 1]], [64])],
    ids=["column", "row", "norm"],
)
def test_a_dimension_split_over_several_axes_slices_as_mindspores_loader(tensor_map, nested, full_shape):
    """3D tensor parallel's projection weights [out, in] come back from MindSpore's compile with one dimension split
    over two mesh axes, listed flat (wq: (y, (x, z)) as [2, 0, 1]; wo: (x, (y, z)) as [0, 2, 1]; 2D's norms: ((x,
    y))). Every rank's slice (models/weights.py take_slice, which checkpoint loads, reshards and exports use) equals
    the one MindSpore's own loader cuts from the expanded layout (mindspore.parallel._tensor)."""
    from mindspore import Tensor
    from mindspore.parallel import _tensor

    dev_matrix = [2, 2, 2]
    full = np.arange(math.prod(full_shape), dtype=np.float32).reshape(full_shape)
    _, expanded_map, expanded_shape = _tensor._expand_layout(dev_matrix, nested, full_shape)
    assert expanded_map == tensor_map
    slice_shape = [n // (2 if isinstance(k, int) and k >= 0 else 4) for n, k in zip(full_shape, nested)]
    for rank in range(8):
        ours = take_slice(full, (dev_matrix, tensor_map, slice_shape, 0, True, "", full_shape), rank)
        theirs = _tensor._load_tensor(Tensor(full), dev_matrix, expanded_map, expanded_shape, rank)
        np.testing.assert_array_equal(ours, theirs.reshape(slice_shape))
    if len(full_shape) == 1:
        return
    # with a data-parallel axis in front and the optimizer shard, the slice MindSpore's layout carries is cut again
    # along its first dimension, over the two data-parallel ranks that hold the same model-parallel slice
    sharded = [slice_shape[0] // 2, *slice_shape[1:]]
    for rank in range(16):
        ours = take_slice(full, ([2, *dev_matrix], tensor_map, sharded, 0, True, "dp", full_shape), rank)
        theirs = _tensor._load_tensor(Tensor(full), dev_matrix, expanded_map, expanded_shape, rank % 8)
        half = theirs.reshape(slice_shape)[rank // 8 * sharded[0] : (rank // 8 + 1) * sharded[0]]
        np.testing.assert_array_equal(ours, half)
