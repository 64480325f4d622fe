"""The communication: keys (docs/communication.md) compiled by MindSpore's dry run, read from the compiled graphs.

One LLaMA twin, dp2 x tp2 x pp2, 2 layers (one a stage), 2 rows a micro batch, 2 micro batches, bf16, its first and
last stage, compiled twice:
* "inlined" (run.reuse_layer_graph=false), at level 0 (tools/dryrun.py): multi-copy parallel (micro_batch_interleave
  2) with every overlap option that fits but recompute's. MindSpore's micro-interleave passes tag each copy's
  nodes and order the copies' collectives (micro_interleaved_index, micro_interleaved_forward_comm_order), the
  pipeline sends each copy's half of a micro batch, and grad_matmul_communication_overlap pairs a backward
  collective with the weight-gradient MatMul it runs beside (grad_overlap_matmul);
* "reused" (the default graph reuse) with full recompute, recomputation_communication_overlap, the gradient
  all-reduce fusion and the MatMul-collective kernels (computation_communication_fusion_level 1), at level 1: the
  same worker, with the Ascend backend's final graph kept beside the validate IR (tools/dryrun.py keeps the
  validate IR only). The validate IR marks the recomputed layers' nodes (recompute_subgraph_id: none in an inlined
  network, and no copy is tagged in a reused one, so config/validate.py refuses both); the backend merges the
  all-reduces of one comm_fusion index and group, and turns the forward row-parallel MatMul + AllReduce pairs into
  MatMulAllReduce kernels.
The other options (grad_computation_allreduce_overlap, pp_1f1b_overlap, enable_allreduce_slice_to_reducescatter,
enable_communication_fusion) leave the validate IR as it was (docs/communication.md). A dry run proves compiler
acceptance and what the graph holds, not that anything overlaps on a device, nor its speed.
"""

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.launch.compiled_ir import read_validate_ir
from mindscale.launch.dryrun_ranks import ASCEND
from mindscale.launch.standins import dryrun_environment
from test_dryrun import SMALL, TINY_LLAMA, dryrun
from tests.communication_options import INLINED_OPTIONS

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
    "inlined": ["run.reuse_layer_graph=false", *INLINED_OPTIONS],
    "reused": [
        "recompute.mode=full",
        "communication.recomputation_communication_overlap=true",
        "communication.grad_matmul_communication_overlap=true",
        "communication.allreduce_fusion=true",
        "communication.computation_communication_fusion_level=1",
    ],
}
BACKEND_IR = "hwopt_d_before_acl_graph_final"  # the Ascend backend's graph as it goes to the device
NODE = re.compile(r"^\s+%\d+\(\S+\) = (\w+)\(.*$", re.M)
COPY = re.compile(r"micro_interleaved_index: U64\((\d+)\)")  # set on the copies' collectives it orders
TAG = re.compile(r"micro_interleaved_tag: U64\((\d+)\)")  # the copy every forward node belongs to
MICRO = re.compile(r"\bmicro: I64\((\d+)\)")
PAIRED = re.compile(r'grad_overlap_matmul: "(\d+)"')


def nodes(ir: str, kind: str) -> list[str]:
    """The lines of the IR's nodes of one primitive (PrimFunc_MatMul, AllReduce, ...)."""
    return [m.group(0) for m in NODE.finditer(ir) if m.group(1) == kind]


def compile_backend(sets: list[str], ranks: list[int], devices: int, folder) -> list[tuple[dict, str, str]]:
    """(report, validate IR, backend IR) of `ranks`, each compiled at once in a process of its own by the dry-run
    worker at MindSpore's level 1 (which runs the Ascend backend's passes), with the validate and BACKEND_IR graphs
    kept."""
    argv = [sys.executable, "-m", "mindscale.launch.dryrun_worker", "--config", str(TINY_LLAMA)]
    argv += [a for s in [*sets, ASCEND] for a in ("--set", s)]
    running = []
    for rank in ranks:
        out = folder / f"rank{rank}"
        out.mkdir()
        env = dryrun_environment(dict(os.environ), rank, devices, level=1)
        env.update(
            {
                "MS_DEV_SAVE_GRAPHS": "1",
                "MS_DEV_DUMP_IR_PASSES": f"validate,{BACKEND_IR}",
                "MS_DEV_SAVE_GRAPHS_PATH": str(out),
                "PYTHONPATH": str(REPO_ROOT),
                "MS_COMPILER_CACHE_ENABLE": "0",
            }
        )
        log = open(out / "log", "w")
        running.append(
            (out, log, subprocess.Popen(argv, env=env, cwd=out, stdout=subprocess.PIPE, stderr=log, text=True))
        )
    compiled = []
    for out, log, process in running:
        printed, _ = process.communicate(timeout=900)
        log.close()
        assert process.returncode == 0, (out / "log").read_text()[-2000:]
        report = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
        assert report["compiled"], report["error"]
        backend = sorted(out.rglob(f"*{BACKEND_IR}_0_*.ir"))[-1].read_text()
        compiled.append((report, read_validate_ir(out), backend))
    return compiled


@pytest.fixture(scope="module", params=sorted(OPTIONS))
def compiled(request, tmp_path_factory):
    """(twin, config, layout, [(report, validate IR, backend IR or None)]) of the first and last stage."""
    sets = [*TWIN, *OPTIONS[request.param]]
    folder = tmp_path_factory.mktemp(request.param)
    cfg = load_config(TINY_LLAMA, sets)
    layout = Layout.of(cfg, "Ascend")
    if request.param == "reused":
        ranks = compile_backend(sets, [0, layout.devices - 1], layout.devices, folder)
    else:
        reports = dryrun(TINY_LLAMA, *sets, ir_dir=folder)
        ranks = [(r, read_validate_ir(folder / f"rank{r['rank']}"), None) for r in reports]
    return request.param, cfg, layout, ranks


def test_each_copy_has_its_own_ordered_collectives_and_pipeline_sends(compiled):
    twin, cfg, layout, ranks = compiled
    if twin != "inlined":
        pytest.skip("copies are labelled in an inlined loss network only")
    copies = cfg.communication.micro_batch_interleave
    assert [r["stage"] for r, _, _ in ranks] == [0, 1]
    for report, ir, _ in ranks:
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
    for _, ir, _ in ranks:
        reduces = {PAIRED.search(line).group(1) for line in nodes(ir, "AllReduce") if PAIRED.search(line)}
        matmuls = {PAIRED.search(line).group(1) for line in nodes(ir, "PrimFunc_MatMul") if PAIRED.search(line)}
        assert reduces and reduces == matmuls


def test_recomputed_layers_are_marked_for_their_collectives_overlap(compiled):
    twin, _, layout, ranks = compiled
    marks = [ir.count("recompute_subgraph_id: I64(") for _, ir, _ in ranks]
    if twin == "reused":
        assert layout.recomputed == (0, 1) and all(marks)
    else:  # no recompute here; and MindSpore marks nothing in an inlined network (validate.py refuses it there)
        assert marks == [0, 0]


FUSED = re.compile(r"= AllReduce\(([^)]*)\).*\bfusion: I64\((\d+)\).*\bgroup_rank_ids: \(([\d, ]*)\)")


def gradient_reduces(ir: str) -> list[tuple[int, str, int]]:
    """(comm_fusion index, group, tensors reduced) of every all-reduce with a fusion index (the gradients')."""
    return [
        (int(fusion), group, len(operands.split(",")))
        for operands, fusion, group in (m.groups() for m in map(FUSED.search, nodes(ir, "AllReduce")) if m)
        if int(fusion) > 0
    ]


def test_the_backend_fuses_each_layers_gradient_all_reduces_per_group(compiled):
    """allreduce_fusion: the validate IR keeps one all-reduce per gradient, with its layer's comm_fusion index; the
    backend merges those of one index and group into one, which reduces them all."""
    twin, _, _, ranks = compiled
    if twin != "reused":
        pytest.skip("the backend graph is compiled for the reused twin")
    for _, ir, backend in ranks:
        before, after = gradient_reduces(ir), gradient_reduces(backend)
        assert all(n == 1 for *_, n in before)
        assert Counter((f, g) for f, g, _ in after) == Counter({(f, g): 1 for f, g, _ in before})
        assert sum(n for *_, n in after) == len(before) > len(after)


def test_the_backend_turns_row_parallel_matmuls_and_their_all_reduces_into_one_kernel(compiled):
    """computation_communication_fusion_level 1: each forward MatMul whose output is all-reduced over the tensor-parallel
    group (wo and w2 of every layer, every micro batch) is one MatMulAllReduce in the backend, none in validate."""
    twin, _, layout, ranks = compiled
    if twin != "reused":
        pytest.skip("the backend graph is compiled for the reused twin")
    for report, ir, backend in ranks:
        layers = len(layout.layers_of_stage(report["stage"]))
        assert not nodes(ir, "MatMulAllReduce")
        assert len(nodes(backend, "MatMulAllReduce")) == 2 * layers * layout.micro_steps


def test_copies_compile_without_pipeline_stages(tmp_path):
    """Multi-copy parallel on one stage (dp2 x tp2, one micro batch of 2 rows a step): the rows split in two, each
    copy's forward all-reduces labelled and ordered, as many in each. With accumulation steps and no stages MindSpore
    2.9 fails ("Cannot find micro info"), which config/validate.py refuses (tests/unit/test_communication_keys.py)."""
    sets = [*TWIN, "parallel.pipeline_stage=1", "parallel.micro_batch_num=1", "run.reuse_layer_graph=false"]
    [report] = dryrun(TINY_LLAMA, *sets, "communication.micro_batch_interleave=2", ranks="0", ir_dir=tmp_path)
    ir = read_validate_ir(tmp_path / "rank0")
    assert report["stage"] == 0 and ir.count("interleave_num: I64(2)") > 0
    forward = [line for line in nodes(ir, "AllReduce") if "instance name: forward_op_" in line]
    assert forward and Counter(TAG.search(line).group(1) for line in forward) == {
        "0": len(forward) / 2,
        "1": len(forward) / 2,
    }
    ordered = Counter(COPY.search(line).group(1) for line in forward if COPY.search(line))
    assert set(ordered) == {"0", "1"} and len(set(ordered.values())) == 1
