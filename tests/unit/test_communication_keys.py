"""communication: refused in one line (exit 2, nothing written) where it cannot apply, and MindSpore's
parallel_speed_up_json written where the runtime says (docs/communication.md). What the keys compile to:
tests/dryrun/test_communication.py."""

import json
import tempfile

import pytest

import run_train
from mindscale.config import REPO_ROOT, load_config
from mindscale.train.loop import runtime
from tests.communication_options import INLINED_OPTIONS

TINY = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"
# a pipeline twin on Ascend that every option below fits but for the one a case changes
SHARDED = [
    "hardware=ascend910b",
    "model.num_layers=2",
    "train.global_batch_size=null",
    "train.micro_batch_size=2",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=2",
]
INLINED = [*SHARDED, "run.reuse_layer_graph=false"]
REFUSED = {  # case: (overrides, what the line must say)
    "copies on CPU": (["communication.micro_batch_interleave=2"], "with hardware 'cpu' (CPU)"),
    "one device": (
        ["hardware=ascend910b", "communication.grad_matmul_communication_overlap=true"],
        "with a layout that is not sharded",
    ),
    "copies without tensor parallel": (
        [*INLINED, "parallel.model_parallel=1", "communication.micro_batch_interleave=2"],
        "communication.micro_batch_interleave=2 with parallel.model_parallel=1",
    ),
    "copies through reused graphs": (
        [*SHARDED, "communication.micro_batch_interleave=2"],
        "with run.reuse_layer_graph=true",
    ),
    "a copy of no rows": (
        [*INLINED, "train.micro_batch_size=1", "communication.micro_batch_interleave=2"],
        "does not divide train.micro_batch_size=1",
    ),
    "no copies": (["communication.micro_batch_interleave=0"], "must be >= 1"),
    "copies in an accumulation loop": (
        [
            *INLINED,
            "parallel.pipeline_stage=1",
            "parallel.micro_batch_num=1",
            "parallel.gradient_accumulation_steps=2",
            "communication.micro_batch_interleave=2",
        ],
        "with parallel.gradient_accumulation_steps=2 and no pipeline stages",
    ),
    "1f1b overlap without stages": (
        [*SHARDED, "parallel.pipeline_stage=1", "parallel.micro_batch_num=1", "communication.pp_1f1b_overlap=true"],
        "communication.pp_1f1b_overlap needs parallel.pipeline_stage > 1",
    ),
    "recompute overlap without recompute": (
        [*SHARDED, "communication.recomputation_communication_overlap=true"],
        "communication.recomputation_communication_overlap needs recompute.mode=full",
    ),
    "recompute overlap inlined": (
        [*INLINED, "recompute.mode=full", "communication.recomputation_communication_overlap=true"],
        "and run.reuse_layer_graph=true",
    ),
    "all-gather overlap without the optimizer shard": (
        [*SHARDED, "communication.computation_allgather_overlap=true"],
        "communication.computation_allgather_overlap needs parallel.optimizer_shard=true",
    ),
    "all-reduce overlap under the optimizer shard": (
        [*SHARDED, "parallel.optimizer_shard=true", "communication.grad_computation_allreduce_overlap=true"],
        "communication.grad_computation_allreduce_overlap needs parallel.data_parallel > 1 without",
    ),
    "all-gather fusion without the optimizer shard": (
        [*SHARDED, "communication.allgather_fusion=true"],
        "communication.allgather_fusion=true without the optimizer shard",
    ),
    "all-reduce fusion on CPU": (["communication.allreduce_fusion=true"], "with hardware 'cpu' (CPU)"),
    "a negative fusion level": ([*SHARDED, "communication.computation_communication_fusion_level=-1"], "must be >= 0"),
    "load balance without context parallel": (
        ["parallel.context_parallel_load_balance=true"],
        "parallel.context_parallel_load_balance=true without context parallel (parallel.context_parallel=1)",
    ),
}
# a context-parallel layout (flash attention, one row per rank)
CONTEXT_PARALLEL = [
    "hardware=ascend910b",
    "model.compute_dtype=bfloat16",
    "train.micro_batch_size=1",
    "parallel.context_parallel=2",
]


@pytest.mark.parametrize("case", REFUSED)
def test_an_option_that_does_not_fit_is_refused_in_one_line_before_anything_is_written(case, tmp_path, capsys):
    sets, said = REFUSED[case]
    argv = ["--config", str(TINY), *[a for s in [*sets, f"run.output_dir={tmp_path}"] for a in ("--set", s)]]
    with pytest.raises(SystemExit) as exit:
        run_train.main(argv)
    assert exit.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_the_options_that_fit_the_inlined_pipeline_twin_validate():
    cfg = load_config(TINY, [*INLINED, *INLINED_OPTIONS, "communication.allreduce_fusion=true"])
    assert cfg.communication.comm_fusion == {"allreduce": {"mode": "auto", "config": None}}
    assert cfg.communication.speed_up == {
        "grad_matmul_communication_overlap": True,
        "grad_computation_allreduce_overlap": True,
        "enable_allreduce_slice_to_reducescatter": True,
        "enable_communication_fusion": True,
        "pp_1f1b_overlap": "AlltoAll,AlltoAllV,AllGather,ReduceScatter,AllReduce",
        "computation_communication_fusion_level": 1,
    }


@pytest.mark.parametrize("dry", [False, True])
def test_the_speed_up_file_goes_to_the_run_folder_and_a_dry_run_leaves_nothing(dry, tmp_path, monkeypatch):
    """MindSpore reads the overlap options from a JSON file only: a run writes it into its folder, one per rank; a
    dry run of the same config into a temporary folder, removed once read (a real run's folder is not touched).
    (On this CPU MindSpore ignores ascend_config with a warning; the dry-run tests show it read on Ascend.)"""
    if dry:
        monkeypatch.setenv("MS_SIMULATION_LEVEL", "0")
    else:
        monkeypatch.delenv("MS_SIMULATION_LEVEL", raising=False)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    cfg = load_config(TINY, [*SHARDED, f"run.output_dir={tmp_path / 'runs'}", "communication.pp_1f1b_overlap=true"])
    runtime._set_communication(cfg, rank=3)
    written = cfg.run_dir / runtime.SPEED_UP_DIR / "rank_3.json"
    assert list(temporary.iterdir()) == []
    assert written.is_file() != dry
    if not dry:
        assert json.loads(written.read_text()) == cfg.communication.speed_up


def test_the_context_parallel_load_balance_goes_into_the_speed_up_file(tmp_path, monkeypatch):
    """parallel.context_parallel_load_balance is MindSpore's enable_flash_attention_load_balance, which it reads from
    the same parallel_speed_up_json (tests/dryrun/test_context_parallel.py: what it compiles)."""
    monkeypatch.delenv("MS_SIMULATION_LEVEL", raising=False)
    sets = [*CONTEXT_PARALLEL, f"run.output_dir={tmp_path}", "parallel.context_parallel_load_balance=true"]
    written = runtime.write_speed_up(load_config(TINY, sets), 0, tmp_path / "speed_up")
    assert json.loads(written.read_text()) == {"enable_flash_attention_load_balance": True}
    assert runtime.speed_up_options(load_config(TINY, CONTEXT_PARALLEL)) == {}
