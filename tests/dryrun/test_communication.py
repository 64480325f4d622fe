"""The communication: keys (docs/communication.md) compiled by MindSpore's dry run, read from the saved validate IR.

One LLaMA twin, dp2 x tp2 x pp2, 2 layers (one a stage), 2 rows a micro batch, 2 micro batches, bf16, its first and
last stage, compiled twice:
* "inlined" (run.reuse_layer_graph=false): multi-copy parallel (micro_batch_interleave 2) with every overlap option
  that fits the layout, but recompute's: MindSpore's micro-interleave passes label each copy's collectives and
  order each copy's forward collectives (micro_interleaved_index, micro_interleaved_forward_comm_order), the
  pipeline sends each copy's half of a micro batch, and grad_matmul_communication_overlap pairs a backward
  all-reduce with the weight-gradient MatMul it runs beside (grad_overlap_matmul);
* "reused" (the default graph reuse) with full recompute and recomputation_communication_overlap: MindSpore marks
  the recomputed layers' nodes with the sub-graph their collectives overlap (recompute_subgraph_id). It marks
  nothing in an inlined network, and labels no copies in a reused one (config/validate.py refuses both).
The other options (grad_computation_allreduce_overlap, pp_1f1b_overlap, enable_allreduce_slice_to_reducescatter,
enable_communication_fusion, computation_communication_fusion_level) change nothing a level-0 dry run keeps: they
are Ascend backend passes (docs/communication.md says what a level-1 compile shows). A dry run proves compiler
acceptance and these marks, not that anything overlaps on a device, nor its speed.
"""

import re
from collections import Counter

import pytest

from mindscale.config import Layout, load_config
from mindscale.launch.compiled_ir import read_validate_ir
from test_dryrun import SMALL, TINY_LLAMA, dryrun

TWIN = [
    *SMALL,
    "model.num_layers=2",
    "model.compute_dtype=bfloat16",
    "train.micro_batch_size=2",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=2",
]
OPTIONS = {
    "inlined": [
        "run.reuse_layer_graph=false",
        "communication.micro_batch_interleave=2",
        "communication.grad_matmul_communication_overlap=true",
        "communication.grad_computation_allreduce_overlap=true",
        "communication.pp_1f1b_overlap=true",
        "communication.enable_allreduce_slice_to_reducescatter=true",
        "communication.enable_communication_fusion=true",
        "communication.computation_communication_fusion_level=1",
    ],
    "reused": [
        "recompute.mode=full",
        "communication.recomputation_communication_overlap=true",
        "communication.grad_matmul_communication_overlap=true",
    ],
}
NODE = re.compile(r"^\s+%\d+\(\S+\) = (\w+)\(.*$", re.M)
COPY = re.compile(r"micro_interleaved_index: U64\((\d+)\)")  # set on the copies' collectives it orders
TAG = re.compile(r"micro_interleaved_tag: U64\((\d+)\)")  # the copy every forward node belongs to
MICRO = re.compile(r"\bmicro: I64\((\d+)\)")
PAIRED = re.compile(r'grad_overlap_matmul: "(\d+)"')


def nodes(ir: str, kind: str) -> list[str]:
    """The lines of the IR's nodes of one primitive (PrimFunc_MatMul, AllReduce, ...)."""
    return [m.group(0) for m in NODE.finditer(ir) if m.group(1) == kind]


@pytest.fixture(scope="module", params=sorted(OPTIONS))
def compiled(request, tmp_path_factory):
    """(twin, config, layout, [(report, validate IR)]) of the first and last stage."""
    sets = [*TWIN, *OPTIONS[request.param]]
    ir_dir = tmp_path_factory.mktemp(request.param)
    reports = dryrun(TINY_LLAMA, *sets, ir_dir=ir_dir)
    cfg = load_config(TINY_LLAMA, sets)
    return (
        request.param,
        cfg,
        Layout.of(cfg, "Ascend"),
        [(r, read_validate_ir(ir_dir / f"rank{r['rank']}")) for r in reports],
    )


def test_each_copy_has_its_own_ordered_collectives_and_pipeline_sends(compiled):
    twin, cfg, layout, ranks = compiled
    if twin != "inlined":
        pytest.skip("copies are labelled in an inlined loss network only")
    copies = cfg.communication.micro_batch_interleave
    assert [r["stage"] for r, _ in ranks] == [0, 1]
    for report, ir in ranks:
        # the micro batch's rows split in two, each copy's tensor-parallel all-reduces labelled and ordered
        assert ir.count(f"interleave_num: I64({copies})") > 0
        forward = [line for line in nodes(ir, "AllReduce") if "instance name: forward_op_" in line]
        assert Counter(TAG.search(line).group(1) for line in forward) == {"0": len(forward) / 2, "1": len(forward) / 2}
        # the decoder layers' (the loss's, outside the micro batches' marks, are tagged only), per micro batch
        layers = [line for line in forward if MICRO.search(line)]
        labelled = Counter((MICRO.search(line).group(1), COPY.search(line).group(1)) for line in layers)
        assert sorted(labelled) == [(str(m), c) for m in range(layout.micro_steps) for c in ("0", "1")]
        assert len(set(labelled.values())) == 1  # the same collectives in each copy of each micro batch
        assert all("micro_interleaved_forward_comm_order" in line for line in layers)
        # each copy sends (receives) its own half of a micro batch between the stages
        pipeline = {c["kind"]: c for c in report["collectives"] if c["purpose"] == "pipeline"}
        half = cfg.train.micro_batch_size // copies * cfg.model.seq_length * cfg.model.hidden_size * 2  # bf16
        border = "Send" if report["stage"] == 0 else "Receive"
        assert pipeline[border]["count"] == layout.micro_steps * copies
        assert pipeline[border]["bytes"] == layout.micro_steps * copies * half
        assert report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}


def test_backward_all_reduces_are_paired_with_weight_gradient_matmuls(compiled):
    """grad_matmul_communication_overlap: each marked backward all-reduce names the MatMul it overlaps."""
    _, _, _, ranks = compiled
    for _, ir in ranks:
        reduces = {PAIRED.search(line).group(1) for line in nodes(ir, "AllReduce") if PAIRED.search(line)}
        matmuls = {PAIRED.search(line).group(1) for line in nodes(ir, "PrimFunc_MatMul") if PAIRED.search(line)}
        assert reduces and reduces == matmuls


def test_recomputed_layers_are_marked_for_their_collectives_overlap(compiled):
    twin, _, layout, ranks = compiled
    marks = [ir.count("recompute_subgraph_id: I64(") for _, ir in ranks]
    if twin == "reused":
        assert layout.recomputed == (0, 1) and all(marks)
    else:  # no recompute here; and MindSpore marks nothing in an inlined network (validate.py refuses it there)
        assert marks == [0, 0]
