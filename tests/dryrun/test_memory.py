"""MindSpore's own device-memory plan of a rank (tools/dryrun.py --memory: the level-1 dry run), next to the
planner's, and the MindSpore internals it relies on, pinned so that an upgrade fails here first:

* the stand-in folder's path: MindSpore finds CANN's root by cutting libascendcl.so's path after its last
  "cann" or "latest" (a folder that does not exist fails as "aclInit is null");
* ge::Operator's layout: CreateOperator returns one by value, 24 bytes the stand-in zeroes;
* the SOMAS plan's file (rank_<R>/Ascend_somas_tensor_offset_<graph>.ir) and its two sections;
* that plan's persistent bytes plus its block are what an executed level-1 step takes from MindSpore's pool.
"""

import contextlib
import ctypes
import io
import json
import subprocess

import pytest

from mindscale.config import REPO_ROOT
from mindscale.launch import standins
from mindscale.launch.dryrun_memory import parse_plan
from mindscale.perf.planner.memory import LOSS_LOGIT_BYTES
from tools import dryrun as dryrun_tool

TINY_LLAMA = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"
# the planner's device memory within this band of MindSpore's plan (the target): its activations are a
# per-layer formula, MindSpore's plan holds every temporary the kernel graph makes
PLANNER_BAND = (0.9, 1.1)


def test_the_stand_in_root_is_the_only_cann_in_its_path():
    """MindSpore's GetAscendPath keeps the path of the loaded libascendcl.so up to its last "cann" or "latest";
    level 1 then loads `<that>/lib64/libascendcl.so`. The stand-ins' lib64 sits in a folder named `cann`."""
    lib64 = standins.cann_lib64()
    below_root = str(lib64).rsplit("cann", 1)[1]
    assert lib64.parent.name == "cann" and "latest" not in below_root and (lib64 / "libascendcl.so").is_file()
    plugin = next((standins.mindspore_dir() / "lib" / "plugin" / "ascend").glob("libmindspore_ascend_res_manager.so"))
    words = subprocess.run(["strings", str(plugin)], capture_output=True, text=True).stdout.splitlines()
    at = words.index("Get dladdr failed.")  # the path rule's strings, next to its error message
    assert {"cann", "latest"} <= set(words[at : at + 4]), words[at : at + 4]


def test_the_operator_stand_in_zeroes_exactly_a_ge_operator():
    """CreateOperator's stand-in writes 24 zero bytes where its caller's result goes (its first argument), and
    no more; the plugin still imports it under that name."""
    lib64 = standins.cann_lib64()
    create = ctypes.CDLL(str(lib64 / "libgraph.so"))["_ZN2ge15OperatorFactory14CreateOperatorEPKcS2_"]
    create.restype, create.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    result = (ctypes.c_ubyte * 32)(*[0xFF] * 32)
    assert create(ctypes.addressof(result), b"op", b"ReduceSum") == ctypes.addressof(result)
    assert list(result) == [0] * standins.GE_OPERATOR_BYTES + [0xFF] * (32 - standins.GE_OPERATOR_BYTES)
    plugin = standins.mindspore_dir() / "lib" / "plugin" / "ascend" / "libmindspore_ascend_res_manager.so"
    imported = subprocess.run(["nm", "-D", "--undefined-only", str(plugin)], capture_output=True, text=True).stdout
    assert "_ZN2ge15OperatorFactory14CreateOperatorEPKcS2_" in imported


def test_a_somas_plan_reads_as_persistent_bytes_a_block_and_its_busiest_step():
    """The plan's format as MindSpore 2.9 writes it (tab-separated; an in-place op's output shares its input's
    offset and counts once)."""
    text = (
        "All Parameters:\n\nindex:\tsize:\tsource node name:\tnode out index:\n"
        "%0P\t#2048S\tinputs0\t0\n%1P\t#4096S\tw.weight\t0\n%2P\t#512S\tDefault/data-3\t0\n\n\n"
        "All Tensors:\n\nindex:\taligned_size:\toriginal_size:\toffset:\ttype:\tlifelong:\tlife_start:\t"
        "life_end:\tsource node name:\n"
        "%0T\t#1024S\t#1000S\t&0\tCommon\tLifeLongNone\t1\t3\tDefault/a/MatMul-op0\n"
        "%1T\t#1024S\t#1000S\t&0\tUnion\tLifeLongNone\t3\t5\tDefault/a/Reshape-op0\n"
        "%2T\t#512S\t#500S\t&1024\tCommon\tLifeLongNone\t4\t4\tGradients/b/Mul-op1\n"
        "%3T\t#256S\t#200S\t&1024\tCommon\tLifeLongNone\t6\t7\tDefault/c/Exp-op0\n"
    )
    plan = parse_plan(text)
    assert plan["persistent_bytes"] == 2048 + 4096 + 512 and plan["constant_bytes"] == 512
    assert plan["somas_bytes"] == 1536 and plan["peak_step"] == 4 and plan["somas_used_at_peak_bytes"] == 1536
    assert [t["node"] for t in plan["top_tensors"]] == ["Default/a/Reshape-op0", "Gradients/b/Mul-op1"]


def test_offloads_host_copies_are_the_moveto_outputs_a_copy_back_reads():
    """Activation offload in the plan: the forward tensor is freed after its copy out (a MoveTo), whose output
    lives in the block until the copy back (another MoveTo) reads it; the copy back's output is device memory."""
    text = (
        "All Parameters:\n\n%0P\t#2048S\tinputs0\t0\n\n\nAll Tensors:\n\n"
        "%0T\t#1024S\t#1000S\t&0\tCommon\tLifeLongNone\t1\t2\tDefault/a/MatMul-op0\n"
        "%1T\t#1024S\t#1000S\t&1024\tCommon\tLifeLongNone\t2\t5\tDefault/a/MoveTo-op0\n"
        "%2T\t#512S\t#500S\t&0\tCommon\tLifeLongNone\t3\t4\tDefault/b/Exp-op0\n"
        "%3T\t#1024S\t#1000S\t&2048\tCommon\tLifeLongNone\t5\t6\tGradients/a/MoveTo-op0\n"
    )
    plan = parse_plan(text)
    assert plan["peak_step"] == 2 and plan["somas_used_at_peak_bytes"] == 2048
    assert plan["host_copy_bytes"] == 1024 and plan["somas_used_on_device_bytes"] == 1024


def level1(*sets: str, run: bool = False, collectives: bool = False) -> dict:
    """tools/dryrun.py --memory [run] on tiny LLaMA dp2·tp2 with `sets`: rank 0's report (with `collectives`, what
    its validate IR shows too)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = dryrun_tool.main(
            [
                "--config",
                str(TINY_LLAMA),
                *(x for s in ("hardware=ascend910b", "parallel.model_parallel=2", *sets) for x in ("--set", s)),
                "--rank",
                "0",
                "--memory",
                "run" if run else "plan",
                "--json",
                *([] if collectives else ["--no-collectives"]),
                "--timeout",
                "600",
            ]
        )
    report = json.loads(printed.getvalue().splitlines()[-1])
    assert code == 0 and report["compiled"], report.get("error")
    return report


@pytest.fixture(scope="module")
def executed() -> dict:
    """The twin planned and one step executed."""
    return level1(run=True)


def test_mindspores_plan_of_a_twin_is_what_its_step_takes_and_near_the_planners(executed):
    """tools/dryrun.py --memory run on tiny LLaMA dp2·tp2 (rank 0): MindSpore's level-1 dry run plans the rank's
    memory at compile time, one step executes, and the pool's peak is the plan's persistent bytes plus its
    SOMAS block, to within the persistent blocks' alignment; the planner's figure is within
    PLANNER_BAND of it. Stand-ins: CANN's calls return 0 (a zeroed ge::Operator); nothing computes."""
    report = executed
    memory = report["device_memory"]
    assert memory["graphs"] == 1 and memory["somas_bytes"] > 0 and memory["used_bytes"] <= memory["peak_bytes"]
    # each of the ~250 persistent tensors (weights, moments, constants) is a pool block of its own, rounded up to
    # the pool's alignment: 0.6% of this small rank (181 KB), nothing at a real model's sizes
    assert memory["peak_bytes"] <= memory["executed_peak_bytes"] <= 1.01 * memory["peak_bytes"]
    # the peak is the loss's, with three fp32 [tokens, vocabulary / tp] tensors live (the logits, the one-hot, their
    # product: models/transformer.py, TokenCrossEntropy); MindSpore's autodiff of the loss held four here
    loss = [t for t in memory["top_tensors"] if "CrossEntropy" in t["node"]]
    assert len(loss) == 3 and {t["bytes"] for t in loss} == {512 * 1024 * 4 + 512}, memory["top_tensors"]
    assert memory["constant_bytes"] < 512 * 1024 * 4  # no [tokens, vocabulary] constant (the 7B slice had one)
    # ... which is what the planner budgets for the loss: 3 fp32 bytes per logit of the rank's split
    assert 3 * LOSS_LOGIT_BYTES * 512 * 1024 == sum(t["bytes"] - 512 for t in loss)  # SOMAS adds 512 to each
    assert PLANNER_BAND[0] <= report["planned"]["device_memory_ratio"] <= PLANNER_BAND[1], report["planned"]
    assert memory["reserve"]["outside_pool_bytes"] == 3 * 2**30  # ascend910b: 64 GiB, a 61 GiB pool


def test_offloads_host_copies_take_device_memory_in_mindspores_o1_plan(executed):
    """offload.layers=1 (layer 0) on the same twin, planned at level 1. SOMAS lays the layer's host copies (the
    validate IR's MoveTo outputs to "CPU", each rounded up to 512 bytes) in its block until the copy back: at O1
    MindSpore's figure does not fall (validate.py refuses offload with memory_optimize_level O1). Without them its
    busiest step holds what the device does when they are in host memory, as at O0: less than the twin without
    offload, by most of the moved bytes."""
    offload = level1("offload.layers=1", collectives=True)
    memory, plain = offload["device_memory"], executed["device_memory"]
    (out,) = [c for c in offload["offload_copies"] if c["to"] == "CPU"]
    assert out["bytes"] <= memory["host_copy_bytes"] <= out["bytes"] + 512 * out["count"], (out, memory)
    assert memory["used_bytes"] >= plain["used_bytes"]
    saved = plain["used_bytes"] - memory["device_used_bytes"]
    assert 0.5 * out["bytes"] <= saved <= out["bytes"], (saved, out)
