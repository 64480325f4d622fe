"""Multi-token prediction's keys (model.mtp_depth, model.mtp_loss_weight) and what the planner counts of it: the
modules' parameters and a copy of the embedding on the last pipeline stage, their activations, FLOPs and traffic
there (mindscale/perf/planner/, mindscale/perf/flops.py). tests/dryrun/test_expert_balance.py (its pipeline layout) checks the parameter slices
against MindSpore's compile; tests/models/test_mtp.py the numbers against a torch reference."""

import math
import re
import subprocess
import sys

import pytest

from mindscale.config import REPO_ROOT, ConfigError, load_config
from mindscale.perf import flops, planner
from mindscale.perf.planner.activations import mtp_activation_bytes
from mindscale.perf.planner.speed import SpeedModel, stage_compute_s

DEEPSEEK_V3_TINY = REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml"
LLAMA_TINY = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"
STAGES = [
    "hardware=ascend910b",
    "model.num_layers=4",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=4",
    "parallel.expert_parallel=2",
]


@pytest.mark.parametrize(
    "config, keys, message",
    [
        (DEEPSEEK_V3_TINY, ["model.mtp_depth=-1"], "model.mtp_depth=-1: must be >= 0 (0 = off)"),
        (DEEPSEEK_V3_TINY, ["model.mtp_loss_weight=-0.1"], "model.mtp_loss_weight=-0.1: must be >= 0"),
        (
            LLAMA_TINY,
            ["model.mtp_depth=1"],
            "model.mtp_depth=1 with model.arch=llama: multi-token prediction is built for deepseek_v3 only; set "
            "mtp_depth to 0",
        ),
        (
            DEEPSEEK_V3_TINY,
            ["model.mtp_depth=64", "model.seq_length=64"],
            "model.mtp_depth=64 >= model.seq_length=64: module k predicts from the first seq_length - k positions "
            "only; lower mtp_depth",
        ),
        (
            DEEPSEEK_V3_TINY,
            ["model.mtp_depth=1", "hardware=ascend910b", "model.compute_dtype=bfloat16", "parallel.context_parallel=2"],
            "model.mtp_depth=1 with parallel.context_parallel=2: the modules shift the tokens along the sequence, which "
            "context parallel splits; set mtp_depth to 0 or context_parallel to 1",
        ),
    ],
)
def test_keys_that_cannot_apply_are_refused_in_one_line(config, keys, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        load_config(config, keys)
    assert "\n" not in str(refused.value)


def test_the_parameters_and_flops_count_the_modules_as_the_model_builds_them():
    from models import count_parameters

    off = load_config(DEEPSEEK_V3_TINY).model
    for depth in (1, 2):
        cfg = load_config(DEEPSEEK_V3_TINY, [f"model.mtp_depth={depth}"])
        m = cfg.model
        # every trained weight of the built model (not the routers' correction biases, which are not trained)
        biases = (m.num_layers - m.moe.dense_layers + depth) * m.moe.num_experts
        assert flops.param_count(m) == count_parameters(cfg) - biases
        # each module: its projection, a layer with experts (the active ones) and the head again, 6 FLOPs a weight,
        # and its block's attention core
        module = 2 * m.hidden_size**2 + flops.layer_matmul_params(m) + flops.output_params(m)
        core = 12 * m.num_heads * flops.core_width(m) / m.num_heads * m.seq_length
        assert flops.model_flops_per_token(m) - flops.model_flops_per_token(off) == pytest.approx(
            depth * (6 * module + core)
        )


def test_the_last_stage_holds_the_modules_an_embedding_copy_and_their_activations_and_compute():
    off = load_config(DEEPSEEK_V3_TINY, STAGES)
    on = load_config(DEEPSEEK_V3_TINY, [*STAGES, "model.mtp_depth=1"])
    slices = {p.name: p for p in planner.parameter_slices(on)}
    assert slices["tok_embeddings.weight"].stages == (0, 1)  # read by the module's lookup on the last stage
    assert {slices[n].stages for n in slices if n.startswith("mtp.")} == {(1,)}
    assert {p.name: p.stages for p in planner.parameter_slices(off)}["tok_embeddings.weight"] == (0,)

    first_off, first_on = planner.stage_memory(off, 0), planner.stage_memory(on, 0)
    assert first_on == first_off  # nothing of the modules on the first stage
    last_off, last_on = planner.stage_memory(off, 1), planner.stage_memory(on, 1)
    module = sum(math.prod(p.local) for p in slices.values() if p.name.startswith("mtp."))
    embedding = math.prod(slices["tok_embeddings.weight"].local)
    assert module > 0 and embedding > 0
    # the weights: the module's slices and the embedding copy (fp32, before the optimizer shard's cut of the large)
    assert last_on["weights"] > last_off["weights"] and last_on["grads"] > last_off["grads"]
    assert last_on["activations"] - last_off["activations"] == pytest.approx(mtp_activation_bytes(on))
    # its traffic: the embedding exchanged with the first stage, the block's tp and ep collectives
    comm_off, comm_on = planner.communication(off, 1), planner.communication(on, 1)
    assert comm_on["blocks"] == comm_off["blocks"] + 1
    assert comm_on["pp_tied_embedding"] > 0 == comm_off["pp_tied_embedding"]
    assert comm_on["ep"] > comm_off["ep"] and comm_on["tp"] > comm_off["tp"]
    peak, speed = 300e12, SpeedModel.of(on)
    assert stage_compute_s(on, 1, peak, speed) > stage_compute_s(off, 1, peak, speed)
    assert stage_compute_s(on, 0, peak, speed) == stage_compute_s(off, 0, peak, speed)


@pytest.mark.integration
def test_a_refused_depth_is_one_line_and_exit_2():
    bad = subprocess.run(
        [sys.executable, "tools/config.py", "--config", str(LLAMA_TINY), "--set", "model.mtp_depth=1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "deepseek_v3 only" in bad.stderr, bad.stderr
