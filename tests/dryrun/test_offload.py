"""Activation offload (offload.layers) compiled by MindSpore's dry run, read from the saved validate IR.

Two LLaMA twins of llama3_405b's kind (GQA, bf16, flash attention, tp2 with sequence parallel, optimizer shard, the
inputs regathered in the backward: recompute.comm), one per way MindSpore reuses a compiled graph
(Layout.graph_reuse; tests/dryrun/test_kept_activations.py offloads without recompute.comm too):
* "model": dp2 x tp2 x pp2 with 2 chunks per stage, 4 micro batches, 8 layers (stage 0 holds layers 0-1 and
  4-5, stage 1 layers 2-3 and 6-7); each stage recomputes its first layer and offloads the next ones (2 on
  stage 0, 1 on stage 1), so both marks meet on a stage;
* "layer": dp2 x tp2, one micro batch, 2 layers, the first offloaded.
What each stage's IR must show: MindSpore's offload pass put a MoveTo to "CPU" (non-blocking) after the forward
ops of exactly the offloaded layers whose output the backward reads, and a MoveTo back to "Ascend" for each,
carrying the config's backward_prefetch; none in recomputed or kept layers; each offloaded layer moves the
planner's `offloaded_layer_bytes` per micro batch; and the planner's per-rank weights, gradients and optimizer
state still equal the compiled ones.

A dry run proves compiler acceptance and what the graph moves: not that the copies overlap compute, their
speed, or device and host memory (tests/models/test_models.py runs the marks on CPU, where nothing moves).
"""

import math
import re

import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.launch.compiled_ir import read_validate_ir
from mindscale.perf import planner
from test_dryrun import dryrun

LLAMA3_405B = REPO_ROOT / "configs" / "llama3" / "llama3_405b.yaml"
SMALL = [
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
    "model.seq_length=64",
    "train.global_batch_size=null",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.stage_offset=0",
]
TWINS = {  # graph reuse: (overrides, recomputed layers, offloaded layers)
    "model": (
        [
            *SMALL,
            "model.num_layers=8",
            "parallel.pipeline_stage=2",
            "parallel.micro_batch_num=4",
            "parallel.pipeline_interleave=2",
            "recompute.mode=full",
            "recompute.layers=[1,1]",
            "offload.layers=[2,1]",
            "offload.backward_prefetch=2",
        ],
        (0, 2),
        (1, 3, 4),
    ),
    "layer": (
        [
            *SMALL,
            "model.num_layers=2",
            "parallel.pipeline_stage=1",
            "parallel.micro_batch_num=1",
            "parallel.pipeline_interleave=1",
            "parallel.gradient_accumulation_shard=false",
            "recompute.mode=none",
            "recompute.layers=null",
            "offload.layers=1",
        ],
        (),
        (0,),
    ),
}
ITEMSIZE = {"Float32": 4, "BFloat16": 2, "Float16": 2, "Int32": 4}
# a MoveTo node, its input/output types and its scope: ...layers-CellList/<layer>-TransformerBlock/... (a copy back
# that a recomputed all-gather reads, under recompute.comm: Default/MoveTo-opN)
MOVE_TO = re.compile(
    r'= MoveTo\(%\w+, "(\w+)", Bool\(0\)\) primitive_attrs: \{backward_prefetch: I64\((\d+)\)\}\n'
    r'\s*: \(<Tensor\[(\w+)\], \(([\d, ]*)\)>[^\n]*\n'
    r'\s*# Fullname with scope: \(([^)]*)\)'
)
LAYER_SCOPE = re.compile(r"layers-CellList/(\d+)-\w*TransformerBlock/")


def nbytes(dtype: str, shape: str) -> int:
    """Bytes of a tensor as the IR prints it: Tensor[dtype], (shape)."""
    return math.prod(int(x) for x in shape.split(",") if x.strip()) * ITEMSIZE[dtype]


def moves_of(ir: str) -> list[tuple[str, int, int, int | None]]:
    """(destination, backward_prefetch, bytes, layer, or None outside a layer's scope) of every MoveTo of an IR."""
    out = []
    for where, prefetch, dtype, shape, scope in MOVE_TO.findall(ir):
        layer = LAYER_SCOPE.search(scope)
        out.append((where, int(prefetch), nbytes(dtype, shape), int(layer.group(1)) if layer else None))
    return out


@pytest.fixture(scope="module", params=sorted(TWINS))
def compiled(request, tmp_path_factory):
    """(reuse, config, layout, [(report, [(destination, prefetch, bytes, layer)])]) for the first and last stage."""
    sets = TWINS[request.param][0]
    ir_dir = tmp_path_factory.mktemp(request.param)
    reports = dryrun(LLAMA3_405B, *sets, ir_dir=ir_dir)
    cfg = load_config(LLAMA3_405B, sets)
    ranks = []
    for report in reports:
        ranks.append((report, moves_of(read_validate_ir(ir_dir / f"rank{report['rank']}"))))
    return request.param, cfg, Layout.of(cfg, "Ascend"), ranks


def test_exactly_the_offloaded_layers_move_out_and_back_with_the_prefetch(compiled):
    reuse, cfg, layout, ranks = compiled
    assert (layout.graph_reuse, layout.recomputed, layout.offloaded) == (reuse, *TWINS[reuse][1:])
    assert [r["stage"] for r, _ in ranks] == sorted({0, layout.pp - 1})
    for report, moves in ranks:
        out = {layer for where, _, _, layer in moves if where == "CPU"}
        assert out == {i for i in layout.offloaded if layout.stages_of_layers[i] == report["stage"]}
        # every copy out has its copy back (the backward op that reads it names the copy back's scope, which in
        # the interleaved graph is not always its own layer's: they are matched per stage)
        assert sorted(size for where, _, size, _ in moves if where == "CPU") == sorted(
            size for where, _, size, _ in moves if where == "Ascend"
        )
        assert {prefetch for _, prefetch, _, _ in moves} == {cfg.offload.backward_prefetch}
        assert report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}


def test_an_offloaded_layer_moves_what_the_planner_counts(compiled):
    """Per micro batch, each offloaded layer moves the planner's offloaded_layer_bytes (docs/planner.md,
    "Activation offload"): its activations (the all-gathered input of the column-parallel matmuls among them,
    which MindSpore keeps under sequence parallel, and the norms' reciprocal RMS) less Q, K and V, which stay (the
    attention kernel reads them through reshapes no Cell.offload mark reaches), and, where each layer is its own
    reused graph, its weights' compute-dtype copies; besides, a 2-byte scalar of the attention."""
    _, cfg, layout, ranks = compiled
    for _, moves in ranks:
        for layer in {layer for where, _, _, layer in moves if where == "CPU"}:
            moved = sum(size for where, _, size, at in moves if where == "CPU" and at == layer)
            assert moved == planner.offloaded_layer_bytes(cfg, layout) + 2
