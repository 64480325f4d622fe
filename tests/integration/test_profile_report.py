"""tools/profile_report.py on a real CPU profile and on the Ascend fixture written from the docs."""
import csv
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.run_folder import ROOT
from tools import profile_report
from mindscale.perf.profile import Report, Split, analyse, diagnose, is_communication
from mindscale.config import Config

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
    prof = profile(activities=[ProfilerActivity.CPU],
                   schedule=schedule(wait=0, warmup=0, active=PROFILED_STEPS, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(out)))
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
    assert [o["ms_per_step"] for o in report.top_ops] == sorted((o["ms_per_step"] for o in report.top_ops),
                                                                reverse=True)
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
    mean = {c: statistics.mean(float(r[c]) for r in rows) / 1000 for c in
            ("Computing", "Communication(Not Overlapped)", "Free")}
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
    names = {f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
             if dataclasses.is_dataclass(getattr(defaults, section.name))
             for f in dataclasses.fields(getattr(defaults, section.name))}
    every = [stressed(kind) for kind in ("comm", "free", "bubble", "wait", "layout", "optimizer")]
    knobs = [k for report in every for d in diagnose(report) for k in d["knobs"]]
    keys = [k.split(":")[0] for k in knobs if ":" in k and " " not in k.split(":")[0] and "." in k.split(":")[0]]
    assert len(keys) >= 15
    assert all(k in names or k.startswith("context.") for k in keys), keys


def stressed(kind: str) -> Report:
    """A report whose numbers should trigger exactly the rule `kind`."""
    split = {"comm": Split(100, 20, 70, 10), "free": Split(100, 60, 5, 35), "bubble": Split(100, 85, 5, 10, bubble_ms=20),
             }.get(kind, Split(100, 90, 5, 5))
    ops = {"layout": [("StridedSlice", 0.2), ("Transpose", 0.1), ("MatMul", 0.7)],
           "optimizer": [("Adam", 0.4), ("MatMul", 0.6)]}.get(kind, [("MatMul", 1.0)])
    comm = [{"type": "allreduce", "wait_ratio": 0.8}] if kind == "wait" else []
    top = [{"type": t, "share": share, "ms_per_step": share * 90, "calls_per_step": 1, "communication": False}
           for t, share in ops]
    return Report("cpu", "x", 3, split, top, comm)


@pytest.mark.parametrize("kind, expected", [
    ("comm", "likely communication-bound"), ("free", "device idle"), ("bubble", "pipeline bubble"),
    ("wait", "wait for other ranks"), ("layout", "data-movement ops"), ("optimizer", "optimizer update"),
    ("none", "compute-bound")])
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
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_report.py"), str(ASCEND.parent), "--top", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ascend layout" in done.stdout and "try parallel.sequence_parallel" in done.stdout
