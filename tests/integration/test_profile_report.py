"""tools/profile_report.py on real CPU profiles (an in-process MLP, and a 2-worker data-parallel run through
scripts/run_distribute.sh) and on the Ascend fixture written from the docs."""

import csv
import dataclasses
import json
import re
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.integration import tiny_runs
from tests.run_folder import ROOT, TINY
from tools import profile_report
from mindscale.perf.profile import KNOBS, Report, Split, analyse, diagnose, is_communication
from mindscale.config import Config, load_config

ASCEND = ROOT / "tests" / "fixtures" / "ascend_profile"
PROFILED_STEPS = 4


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """Profile a few training steps of a small MindSpore MLP on CPU, the way mindscale/train/loop/profiling.py does."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    ms.set_context(device_target="CPU", mode=ms.GRAPH_MODE)
    net = nn.SequentialCell(nn.Dense(64, 128), nn.GELU(), nn.Dense(128, 64))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params()))
    x = ms.Tensor(np.random.rand(16, 64).astype(np.float32))
    y = ms.Tensor(np.random.rand(16, 64).astype(np.float32))
    step(x, y)  # compile outside the window
    out = tmp_path_factory.mktemp("profile")
    prof = profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=0, active=PROFILED_STEPS, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(out)),
    )
    prof.start()
    began = time.perf_counter()
    for _ in range(PROFILED_STEPS):
        step(x, y)
        prof.step()
    wall = time.perf_counter() - began
    prof.stop()
    return out, wall


def test_cpu_profile_split_and_top_ops(cpu_profile):
    out, wall_s = cpu_profile
    report = analyse(out, top=5)
    s = report.split
    assert report.layout == "cpu" and report.steps == PROFILED_STEPS
    assert s.steps_analysed == PROFILED_STEPS - 1
    assert s.computing_ms + s.communication_not_overlapped_ms + s.free_ms == pytest.approx(s.step_ms)
    assert 0 < s.computing_ms < s.step_ms and s.communication_not_overlapped_ms == 0
    assert s.step_ms * s.steps_analysed <= wall_s * 1000  # the windows lie inside the timed loop
    types = [o["type"] for o in report.top_ops]
    assert len(types) == 5 and "MatMul" in types
    assert [o["ms_per_step"] for o in report.top_ops] == sorted(
        (o["ms_per_step"] for o in report.top_ops), reverse=True
    )
    matmul = next(o for o in report.top_ops if o["type"] == "MatMul")
    assert matmul["calls_per_step"] == 5  # 2 forward + 3 backward (no input gradient for the first layer)
    assert report.diagnosis  # at least the compute-bound fallback


def test_cpu_top_ops_match_framework_csv(cpu_profile):
    out, _ = cpu_profile
    report = analyse(out, top=100)
    info = next(out.rglob("cpu_op_type_info_*.csv"))
    with open(info, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(report.top_ops) == len(rows)
    total = sum(float(r["total_compute_time"]) for r in rows)
    for r in rows:
        op = next(o for o in report.top_ops if o["type"] == r["op_type"])
        assert op["ms_per_step"] == pytest.approx(float(r["total_compute_time"]) / PROFILED_STEPS)
        assert op["share"] == pytest.approx(float(r["total_compute_time"]) / total)


def test_collectives_are_told_from_local_ops_by_name():
    assert all(map(is_communication, ["AllReduce", "hcom_allGather_1", "Broadcast", "Send", "Receive"]))
    assert not any(map(is_communication, ["BroadcastTo", "MatMul", "ReduceSum"]))


def test_ascend_fixture(capsys):
    assert profile_report.main([str(ASCEND), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    with open(next(ASCEND.rglob("step_trace_time.csv")), newline="") as handle:
        rows = list(csv.DictReader(handle))
    mean = {
        c: statistics.mean(float(r[c]) for r in rows) / 1000
        for c in ("Computing", "Communication(Not Overlapped)", "Free")
    }
    s = report["split"]
    assert report["layout"] == "ascend" and report["steps"] == 3
    assert s["computing_ms"] == pytest.approx(mean["Computing"])
    assert s["communication_not_overlapped_ms"] == pytest.approx(mean["Communication(Not Overlapped)"])
    assert s["step_ms"] == pytest.approx(sum(mean.values()))
    assert report["top_ops"][0]["type"] == "hcom_allReduce_" and report["top_ops"][0]["communication"]
    assert not next(o for o in report["top_ops"] if o["type"] == "MatMulV2")["communication"]
    assert {c["type"] for c in report["communication"]} == {"allreduce", "allgather", "reducescatter"}
    allreduce = next(c for c in report["communication"] if c["type"] == "allreduce")
    assert allreduce["calls_per_step"] == 8 and 0.15 < allreduce["wait_ratio"] < 0.2
    findings = [d["finding"] for d in report["diagnosis"]]
    assert findings == ["likely communication-bound", "communication not overlapped is large"]


def test_every_named_knob_is_a_config_key():
    defaults = Config()
    names = {
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        if dataclasses.is_dataclass(getattr(defaults, section.name))
        for f in dataclasses.fields(getattr(defaults, section.name))
    }
    knobs = [k.text for kind in KNOBS.values() for k in kind]
    keys = [k.split(":")[0] for k in knobs if ":" in k and " " not in k.split(":")[0] and "." in k.split(":")[0]]
    assert len(keys) >= 15
    assert all(k in names or k.startswith("context.") for k in keys), keys


def stressed(kind: str, layout: str = "cpu") -> Report:
    """A report whose numbers should trigger exactly the rule `kind`."""
    split = {
        "comm": Split(100, 20, 70, 10),
        "free": Split(100, 60, 5, 35),
        "bubble": Split(100, 85, 5, 10, bubble_ms=20),
    }.get(kind, Split(100, 90, 5, 5))
    ops = {
        "layout": [("StridedSlice", 0.2), ("Transpose", 0.1), ("MatMul", 0.7)],
        "optimizer": [("Adam", 0.4), ("MatMul", 0.6)],
    }.get(kind, [("MatMul", 1.0)])
    comm = [{"type": "allreduce", "wait_ratio": 0.8}] if kind == "wait" else []
    top = [
        {"type": t, "share": share, "ms_per_step": share * 90, "calls_per_step": 1, "communication": False}
        for t, share in ops
    ]
    return Report(layout, "x", 3, split, top, comm)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("comm", "likely communication-bound"),
        ("free", "device idle"),
        ("bubble", "pipeline bubble"),
        ("wait", "wait for other ranks"),
        ("layout", "data-movement ops"),
        ("optimizer", "optimizer update"),
        ("none", "compute-bound"),
    ],
)
def test_diagnosis_rules(kind, expected):
    findings = [d["finding"] for d in diagnose(stressed(kind))]
    assert any(expected in f for f in findings), findings
    if kind not in ("comm",):
        assert len(findings) == 1, findings


def test_single_row_step_trace_needs_steps(tmp_path):
    copy = tmp_path / "prof"
    shutil.copytree(ASCEND, copy)
    stt = next(copy.rglob("step_trace_time.csv"))
    with open(stt, newline="") as handle:
        rows = list(csv.DictReader(handle))
    header = list(rows[0])
    total = {c: sum(float(r[c]) for r in rows) for c in header[1:]}
    with open(stt, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerow([""] + [total[c] for c in header[1:]])
    report = analyse(copy, steps=3)
    assert report.split.computing_ms == pytest.approx(total["Computing"] / 3 / 1000)
    assert any("--steps 3" in n for n in report.notes)


def bad(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        profile_report.main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def test_wrong_layout_and_incomplete_profiles(cpu_profile, tmp_path, capsys):
    (tmp_path / "random.txt").write_text("not a profile")
    assert "holds no profile" in bad(capsys, tmp_path)
    assert "is not a folder" in bad(capsys, tmp_path / "missing")
    broken = tmp_path / "cpu"
    shutil.copytree(cpu_profile[0], broken)
    next(broken.rglob("trace_view.json")).unlink()
    assert "trace_view.json is missing" in bad(capsys, broken)
    cut = tmp_path / "ascend"
    shutil.copytree(ASCEND, cut)
    next(cut.rglob("step_trace_time.csv")).write_text("Step,Computing\n1,2\n")
    assert "lacks column(s) Communication(Not Overlapped), Free" in bad(capsys, cut)


def test_command_line_on_parent_folder():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "profile_report.py"), str(ASCEND.parent), "--top", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ascend layout" in done.stdout and "try parallel.sequence_parallel" in done.stdout


# A real 2-worker data-parallel run that profiles steps 1-2 (2 of 3); each rank's profile folder is named by host,
# process id and time, not by rank. The tiny model of tiny_runs.SMALL: the profile, not the training, is under test.
TWO_RANK_RUN = [
    "train.steps=3",
    "checkpoint.save_at_end=false",
    "profile.enable=true",
    "profile.start_step=1",
    "profile.stop_step=3",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The run folder of TWO_RANK_RUN, and {rank: its profile folder}."""
    parent = tmp_path_factory.mktemp("two_ranks")
    overrides = [*TWO_RANK_RUN, f"run.output_dir={parent}", "run.name=dp2"]
    launch = subprocess.run(
        ["bash", "scripts/run_distribute.sh", str(TINY), "2", *tiny_runs.sets(*overrides)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]
    run = parent / "dp2"
    folders = {
        int(info.stem.rsplit("_", 1)[1]): info.parent.parent
        for info in (run / "profile").glob("*/FRAMEWORK/cpu_op_type_info_*.csv")
    }
    assert sorted(folders) == [0, 1]
    return run, folders


def op_totals(folder) -> dict:
    """{op type: ms over the profiled steps} of a rank's cpu_op_type_info_<rank>.csv, as MindSpore wrote it."""
    with open(next((folder / "FRAMEWORK").glob("cpu_op_type_info_*.csv")), newline="") as handle:
        return {r["op_type"]: float(r["total_compute_time"]) for r in csv.DictReader(handle)}


def test_the_lowest_rank_is_read_and_named_whatever_its_folder_is_called(two_ranks, tmp_path, capsys):
    """Process ids are not ranks: with rank 1's folder first by name (pid 100000 against rank 0's 99999), the
    report still reads rank 0's files, says so, and lists rank 1."""
    run, folders = two_ranks
    copy = tmp_path / "dp2"
    shutil.copytree(run / "profile", copy / "profile")
    shutil.copy(run / "config.yaml", copy / "config.yaml")
    renamed = {}
    for rank, pid in ((0, 99999), (1, 100000)):
        renamed[rank] = copy / "profile" / re.sub(r"_\d+(_\d+_ascend_ms)$", rf"_{pid}\1", folders[rank].name)
        (copy / "profile" / folders[rank].name).rename(renamed[rank])
    assert sorted(p.name for p in (copy / "profile").iterdir())[0] == renamed[1].name
    assert profile_report.main([str(copy / "profile"), "--json", "--top", "100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rank"], report["ranks"], report["path"]) == (0, [0, 1], str(renamed[0]))
    assert {o["type"]: o["ms_per_step"] * report["steps"] for o in report["top_ops"]} == pytest.approx(
        op_totals(renamed[0])
    )
    assert profile_report.main([str(copy / "profile"), "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"profile: {renamed[0]} (rank 0 of ranks 0, 1; cpu layout, 2 step(s) profiled, "
        f"{report['split']['steps_analysed']} analysed)"
    )
    assert (
        f"note: 1 more rank(s) profiled under {copy / 'profile'}: rank 1 ({renamed[1].name}); --rank R reads "
        "one, --all-ranks shows every rank's split" in lines
    )


def test_one_rank_on_request_and_every_rank_s_split(two_ranks, capsys):
    run, folders = two_ranks
    cli = subprocess.run(
        [sys.executable, "tools/profile_report.py", str(run / "profile"), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0 and json.loads(cli.stdout)["top_ops"], cli.stderr
    assert profile_report.main([str(run / "profile"), "--rank", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert (one["rank"], one["path"]) == (1, str(folders[1]))
    assert profile_report.main([str(run / "profile"), "--all-ranks", "--json"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert every["rank"] == 0 and [r["rank"] for r in every["per_rank"]] == [0, 1]
    for r in every["per_rank"]:
        alone = analyse(run / "profile", rank=r["rank"]).split
        assert (r["path"], r["step_ms"], r["free_ms"]) == (str(folders[r["rank"]]), alone.step_ms, alone.free_ms)
        assert r["shares"]["computing_ms"] == pytest.approx(alone.computing_ms / alone.step_ms)
    assert profile_report.main([str(run / "profile"), "--all-ranks"]) == 0
    table = capsys.readouterr().out.splitlines()
    header = table.index("every rank, ms per step (share of its step):")
    assert [line.split()[0] for line in table[header + 2 : header + 4]] == ["0", "1"]
    assert f"--rank 2: {run / 'profile'} holds profiles of rank(s) 0, 1; pick one of them" in bad(
        capsys, run / "profile", "--rank", "2"
    )


# Knobs that name what a CPU run cannot have: MindSpore has no semi-auto parallel there, and no jit_level O2.
SHARDED_OR_ASCEND = (
    "sequence_parallel",
    "optimizer_shard",
    "recompute.comm",
    "model_parallel",
    "pipeline_stage",
    "jit_level",
    "model.attention",
)


def test_advice_on_a_cpu_run_names_only_what_applies(two_ranks):
    """The 2-worker CPU run (graph mode, data parallel 2): every rule's knobs, filtered by its device and its
    config.yaml, which the report finds beside profile/."""
    run, _ = two_ranks
    report = analyse(run / "profile")
    assert report.config == str(run / "config.yaml")
    cfg = load_config(run / "config.yaml")
    kinds = ("comm", "free", "bubble", "wait", "layout", "optimizer", "none")
    knobs = [k for r in [report, *map(stressed, kinds)] for d in diagnose(r, cfg) for k in d["knobs"]]
    assert not [k for k in knobs if any(name in k for name in SHARDED_OR_ASCEND)]
    assert not [k for k in knobs if k.startswith("run.mode")]  # already graph mode
    assert any(k.startswith("parallel.gradient_accumulation_steps") for k in knobs)  # 2 ranks all-reduce


def ascend(*overrides):
    return load_config(TINY, ["hardware=ascend910b", "parallel.model_parallel=2", *overrides])


@pytest.mark.parametrize(
    "overrides, named, left_out",
    [
        (
            [
                "parallel.optimizer_shard=true",
                "recompute.comm=true",
                "context={jit_level: O2}",
                "model.compute_dtype=bfloat16",
            ],
            ["parallel.sequence_parallel: true", "parallel.optimizer_shard: false", "recompute.comm: false"],
            ["context.jit_level", "run.mode", "model.attention", "parallel.optimizer_shard: true"],
        ),
        (
            ["parallel.sequence_parallel=true", "run.mode=pynative", "model.compute_dtype=float32"],
            ["context.jit_level: O2", "run.mode: graph", "model.attention: flash", "parallel.optimizer_shard: true"],
            ["parallel.sequence_parallel", "parallel.optimizer_shard: false", "recompute.comm"],
        ),
    ],
)
def test_advice_on_ascend_follows_the_config(overrides, named, left_out):
    """A knob is named where the config leaves it to change: not sequence parallel where it is on, not
    optimizer_shard false where there is no shard (no weight all-gather), not recompute.comm false where it is
    false, not graph mode or jit_level O2 where they are set, not flash attention where the layout has it."""
    cfg = ascend(*overrides)
    kinds = ("comm", "free", "layout", "optimizer")
    knobs = [k for kind in kinds for d in diagnose(stressed(kind, "ascend"), cfg) for k in d["knobs"]]
    assert all(any(k.startswith(n) for k in knobs) for n in named), knobs
    assert not [k for k in knobs if any(k.startswith(n) for n in left_out)], knobs


def test_ascend_rank_from_profiler_info(tmp_path, capsys):
    """MindSpore names profiler_info_<rank>.json by the rank on Ascend: a second rank's copy is rank 1."""
    shutil.copytree(ASCEND, tmp_path / "profile")
    rank0 = next((tmp_path / "profile").glob("*_ascend_ms"))
    rank1 = rank0.with_name(rank0.name.replace("41327", "41328"))
    shutil.copytree(rank0, rank1)
    (rank1 / "profiler_info_0.json").rename(rank1 / "profiler_info_1.json")
    assert profile_report.main([str(tmp_path / "profile"), "--rank", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rank"], report["ranks"], report["path"]) == (1, [0, 1], str(rank1))
    (rank1 / "profiler_info_1.json").rename(rank1 / "profiler_info_0.json")  # two runs' rank 0 in one folder
    assert (
        f"{tmp_path / 'profile'} holds 2 profiles of rank 0 ({rank0.name}, {rank1.name}): several runs profiled "
        "into one folder; pass the folder of one run's profile"
    ) in bad(capsys, tmp_path / "profile")
