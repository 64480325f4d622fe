"""tools/compare_runs.py: the before/after verification table and its exit status."""

import json
import subprocess
import sys

import pytest

from tests.run_folder import ROOT, write_run
from tools import compare_runs, linearity
from mindscale.perf import flops
from mindscale.config import Layout, load_config

BASE_TIMES = [5.0, 1.0, 1.0, 1.0]
FAST_TIMES = [5.0, 0.6, 0.6, 0.6]  # 40% less step time, +66.7% throughput


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    parent = tmp_path_factory.mktemp("compare")
    base = write_run(parent, "recompute_off", BASE_TIMES, ["parallel.data_parallel=1"], memory_gib=2.0)
    # recompute on: slower, more hardware FLOPs per model FLOP, less memory
    full = write_run(
        parent,
        "recompute_full",
        [5.0, 1.2, 1.2, 1.2],
        ["parallel.data_parallel=1", "recompute.mode=full"],
        memory_gib=1.2,
    )
    fast = write_run(parent, "fast", FAST_TIMES, ["parallel.data_parallel=1"], memory_gib=2.0)
    return {"base": base, "full": full, "fast": fast, "parent": parent}


def compare(capsys, *argv):
    code = compare_runs.main([str(a) for a in argv] + ["--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out)


def rows(result):
    return {r["metric"].split(" at ")[0]: r for r in result["rows"]}


def test_without_targets_the_comparison_is_printed_and_exits_zero(runs, capsys):
    """Targets are asked for: an ordinary comparison judges nothing and exits 0."""
    assert compare_runs.main([str(runs["base"]), str(runs["full"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "+20.0%" in next(line for line in lines if line.startswith("step time"))
    assert "NO" not in "\n".join(lines) and "NOT met" not in lines[-1]
    assert (
        lines[-1] == "no targets judged: pass --targets seed or --step-time-target, --throughput-target, "
        "--mfu-target, --linearity-target"
    )
    code, result = compare(capsys, runs["base"], runs["full"])
    assert code == 0 and result["all_met"] is None and result["targets"] == {}
    assert all(r["target"] is None and r["met"] is None for r in result["rows"])


def test_recompute_off_vs_on_pair(runs, capsys):
    code, result = compare(capsys, runs["base"], runs["full"], "--targets", "seed")
    r = rows(result)
    assert code == 1 and not result["all_met"]
    assert r["step time"]["change"] == pytest.approx(0.2) and r["step time"]["met"] is False
    assert r["throughput"]["change"] == pytest.approx(1 / 1.2 - 1) and r["throughput"]["met"] is False
    # MFU falls with the throughput; HFU counts the recomputed forward
    cfg = load_config(runs["full"] / "config.yaml")
    layout = Layout.of(cfg)
    ratio = flops.hardware_flops_per_token(
        cfg.model, layout.recompute, len(layout.recomputed)
    ) / flops.model_flops_per_token(cfg.model)
    assert 1.2 < ratio < 4 / 3 + 1e-9
    assert r["MFU"]["optimized"] == pytest.approx(r["MFU"]["baseline"] / 1.2)
    assert r["HFU"]["baseline"] == pytest.approx(r["MFU"]["baseline"])
    assert r["HFU"]["optimized"] == pytest.approx(r["MFU"]["optimized"] * ratio)
    assert r["HFU"]["met"] is None and r["peak memory"]["optimized"] < r["peak memory"]["baseline"]
    assert r["linearity"]["met"] is None


def test_targets_met_exit_zero_and_overridable(runs, capsys):
    code, result = compare(capsys, runs["base"], runs["fast"], "--targets", "seed", "--mfu-target", "0.01")
    r = rows(result)
    assert r["step time"]["change"] == pytest.approx(-0.4) and r["step time"]["met"]
    assert r["throughput"]["change"] == pytest.approx(1 / 0.6 - 1) and r["throughput"]["met"]
    assert r["MFU"]["met"] and code == 0 and result["all_met"]
    code, result = compare(
        capsys, runs["base"], runs["fast"], "--targets", "seed", "--mfu-target", "0.01", "--step-time-target", "-0.5"
    )
    assert code == 1 and rows(result)["step time"]["met"] is False
    code, _ = compare(capsys, runs["base"], runs["fast"], "--targets", "seed")  # the seed's MFU 60% is far on CPU
    assert code == 1
    code, result = compare(capsys, runs["base"], runs["fast"], "--step-time-target", "-0.5")  # one target alone
    assert code == 1 and [r["metric"] for r in result["rows"] if r["met"] is not None] == ["step time"]


def test_linearity_from_sweep_and_from_file(runs, capsys, tmp_path):
    sweep = [
        write_run(tmp_path, f"fast_n{n}", times, [f"parallel.data_parallel={n}"])
        for n, times in ((1, [5.0, 0.6, 0.6]), (2, [5.0, 0.8, 0.8]))
    ]
    assert linearity.main([str(d) for d in sweep]) == 0
    capsys.readouterr()
    code, result = compare(capsys, runs["base"], sweep[0], "--targets", "seed", "--mfu-target", "0.01")
    lin = result["rows"][-1]
    assert lin["metric"] == "linearity at 2 devices" and lin["optimized"] == pytest.approx(0.75)
    assert lin["met"] is False and code == 1
    code, result = compare(
        capsys,
        runs["base"],
        runs["fast"],
        "--targets",
        "seed",
        "--mfu-target",
        "0.01",
        "--linearity",
        sweep[0] / "linearity.json",
        "--linearity-target",
        "0.7",
    )
    assert result["rows"][-1]["met"] is True and code == 0


def test_table_output(runs, capsys):
    assert compare_runs.main([str(runs["base"]), str(runs["fast"]), "--targets", "seed", "--mfu-target", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "-40.0%" in out and "+66.7%" in out and "peak TFLOP/s per device" in out
    assert out.splitlines()[-1].startswith("all targets met (not measured: linearity")


def bad(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        compare_runs.main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def test_bad_input(runs, capsys, tmp_path):
    other = write_run(tmp_path, "wide", BASE_TIMES, ["parallel.data_parallel=1", "model.hidden_size=256"])
    assert "model.hidden_size 128 vs 256" in bad(capsys, runs["base"], other)
    junk = tmp_path / "linearity.json"
    junk.write_text("{}")
    assert "not a linearity.json" in bad(capsys, runs["base"], runs["fast"], "--linearity", junk)
    empty = write_run(tmp_path, "empty", BASE_TIMES, ["parallel.data_parallel=1"])
    (empty / "metrics.jsonl").write_text("\n")
    assert "no records" in bad(capsys, runs["base"], empty)
    assert "--targets fast: no such preset; the presets are: seed" in bad(
        capsys, runs["base"], runs["fast"], "--targets", "fast"
    )


def test_command_line_gates_ci(runs):
    tool = str(ROOT / "tools" / "compare_runs.py")
    met = subprocess.run(
        [sys.executable, tool, str(runs["base"]), str(runs["fast"]), "--targets", "seed", "--mfu-target", "0.01"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    missed = subprocess.run(
        [sys.executable, tool, str(runs["base"]), str(runs["full"]), "--targets", "seed"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (met.returncode, missed.returncode) == (0, 1)
    assert "targets NOT met" in missed.stdout
