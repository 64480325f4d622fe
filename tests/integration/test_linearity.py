"""tools/linearity.py and the run-folder reader it shares (mindscale/perf/metrics_io.py)."""

import json
import subprocess
import sys

import pytest

from tests.run_folder import ROOT, write_run
from tools import linearity
from mindscale.perf import metrics_io

# Step times after one warm-up record of 5 s. With the per-device batch fixed, the global batch is
# N x the base one, so linearity_N = (B_N / t_N / N) / (B_1 / t_1) = t_1 / t_N.
SWEEP = {1: [5.0, 1.0, 1.1, 1.2], 2: [5.0, 1.1, 1.21, 1.32], 4: [5.0, 2.0, 2.2, 2.4]}


@pytest.fixture(scope="module")
def sweep_dirs(tmp_path_factory):
    parent = tmp_path_factory.mktemp("sweep")
    return [write_run(parent, f"tiny_n{n}", times, [f"parallel.data_parallel={n}"]) for n, times in SWEEP.items()]


def run_cli(capsys, *argv):
    code = linearity.main([str(a) for a in argv])
    return code, capsys.readouterr()


def test_linearity_values_flag_plot_and_json(sweep_dirs, tmp_path, capsys):
    png = tmp_path / "lin.png"
    code, out = run_cli(capsys, *sweep_dirs, "--plot", png, "--json")
    assert code == 0
    result = json.loads(out.out)
    points = {p["devices"]: p for p in result["points"]}
    assert sorted(points) == [1, 2, 4] and result["base_devices"] == 1
    # steps 2..4, their time over their number: t1 = 1.1, t2 = 1.21, t4 = 2.2
    assert points[1]["linearity"] == pytest.approx(1.0)
    assert points[2]["linearity"] == pytest.approx(1.1 / 1.21)
    assert points[4]["linearity"] == pytest.approx(0.5)
    assert result["flagged"] == [4] and points[2]["below_threshold"] is False
    assert points[2]["tokens_per_s"] == pytest.approx(2 * 4 * 128 / 1.21)  # micro 4 x dp 2 x seq 128
    assert points[2]["tokens_per_s_per_device"] == pytest.approx(points[2]["tokens_per_s"] / 2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for run in sweep_dirs:
        assert json.loads((run / "linearity.json").read_text())["flagged"] == [4]


def test_table_shows_flag_and_threshold(sweep_dirs, capsys):
    code, out = run_cli(capsys, *sweep_dirs, "--threshold", "0.95")
    assert code == 0
    lines = out.out.splitlines()
    flagged = [line for line in lines if "< threshold" in line]
    assert [line.split()[0] for line in flagged] == ["2", "4"]
    assert "threshold 0.95" in lines[-1]


def test_warmup_records_are_excluded(sweep_dirs, capsys):
    _, out = run_cli(capsys, *sweep_dirs[:2], "--json", "--warmup", "0")
    with_warmup = {p["devices"]: p for p in json.loads(out.out)["points"]}
    assert with_warmup[1]["step_time_s"] == pytest.approx(8.3 / 4)  # 5.0, 1.0, 1.1, 1.2 s over 4 steps


def bad(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        linearity.main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def test_refuses_runs_of_different_configs(sweep_dirs, tmp_path, capsys):
    other = write_run(tmp_path, "tiny_lr", [5.0, 1.0], ["parallel.data_parallel=4", "train.lr=1e-3"])
    assert "train.lr" in bad(capsys, sweep_dirs[0], other)
    other = write_run(tmp_path, "tiny_mbs", [5.0, 1.0], ["parallel.data_parallel=4", "train.micro_batch_size=2"])
    assert "train.micro_batch_size" in bad(capsys, sweep_dirs[0], other)


def test_refuses_same_device_count_and_single_run(sweep_dirs, tmp_path, capsys):
    twin = write_run(tmp_path, "tiny_again", [5.0, 1.0], ["parallel.data_parallel=2"])
    assert "both ran on 2 devices" in bad(capsys, sweep_dirs[1], twin)
    assert "at least two" in bad(capsys, sweep_dirs[0])


def test_bad_metrics_files(sweep_dirs, tmp_path, capsys):
    empty = write_run(tmp_path, "empty", [1.0], ["parallel.data_parallel=2"])
    (empty / "metrics.jsonl").write_text("")
    assert "no records" in bad(capsys, sweep_dirs[0], empty)
    cut = write_run(tmp_path, "cut", [1.0], ["parallel.data_parallel=2"])
    (cut / "metrics.jsonl").write_text('{"step": 1, "loss": 7.')
    assert "only a truncated line" in bad(capsys, sweep_dirs[0], cut)
    corrupt = write_run(tmp_path, "corrupt", [5.0, 1.0, 1.0], ["parallel.data_parallel=2"])
    lines = (corrupt / "metrics.jsonl").read_text().splitlines()
    (corrupt / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    assert "line 2 is not JSON" in bad(capsys, sweep_dirs[0], corrupt)
    assert "does not exist" in bad(capsys, sweep_dirs[0], tmp_path / "nowhere")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    assert "config.yaml is missing" in bad(capsys, sweep_dirs[0], no_config)


def test_truncated_last_line_is_a_warning(sweep_dirs, tmp_path, capsys):
    cut = write_run(tmp_path, "tiny_cut", SWEEP[2], ["parallel.data_parallel=2"], truncate=True)
    code, out = run_cli(capsys, sweep_dirs[0], cut, "--json")
    assert code == 0 and "truncated line" in out.err
    assert json.loads(out.out)["points"][1]["linearity"] == pytest.approx(1.1 / 1.21)


def test_command_line_exit_codes(sweep_dirs, tmp_path):
    ok = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "linearity.py"), *map(str, sweep_dirs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and "< threshold" in ok.stdout
    missing = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "linearity.py"), str(sweep_dirs[0]), str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


def test_resumed_segments_replace_repeated_steps():
    def rec(step, elapsed):
        return {"step": step, "elapsed_s": elapsed}

    # a run to step 4, resumed from the step-2 checkpoint, then resumed again after step 6
    records = [
        rec(1, 10),
        rec(2, 11),
        rec(3, 12),
        rec(4, 13),
        rec(3, 9),
        rec(4, 10),
        rec(5, 11),
        rec(6, 12),
        rec(7, 8),
        rec(8, 9),
    ]
    parts = metrics_io.segments(records)
    assert [[r["step"] for r in p] for p in parts] == [[1, 2], [3, 4, 5, 6], [7, 8]]
    kept, steady = metrics_io.steady_records(records, warmup=1)
    assert steady and [r["step"] for r in kept] == [2, 4, 5, 6, 8]
    kept, steady = metrics_io.steady_records(records[:1], warmup=1)
    assert not steady and kept == records[:1]


@pytest.mark.parametrize(
    "counts, extra, message",
    [
        ("2", [], "give at least two"),
        ("1 two", [], "not a positive integer"),
        ("1 2 1", [], "repeat a value"),
        ("1 2", ["--set", "train.stepz=3"], "unknown key train.stepz"),
        ("1 2", ["--set", "run.name=taken"], "taken_n1 exists"),
    ],
)
def test_sweep_script_refuses_bad_input(tmp_path, counts, extra, message):
    (tmp_path / "taken_n1").mkdir()
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "run_linearity.sh"),
            str(ROOT / "configs/tiny/llama_tiny.yaml"),
            counts,
            "--set",
            f"run.output_dir={tmp_path}",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_profiled_steps_are_left_out_of_medians():
    records = [{"step": s, "steps_in_window": 1} for s in range(1, 9)]
    kept, _ = metrics_io.steady_records(records, warmup=1, skip_window=(4, 6))
    assert [r["step"] for r in kept] == [2, 3, 7, 8]
    windows = [{"step": s, "steps_in_window": 3} for s in (3, 6, 9, 12)]  # log_interval 3
    kept, _ = metrics_io.steady_records(windows, warmup=1, skip_window=(7, 8))
    assert [r["step"] for r in kept] == [6, 12]
    kept, _ = metrics_io.steady_records(records[:3], warmup=1, skip_window=(1, 8))
    assert [r["step"] for r in kept] == [2, 3]  # nothing unprofiled: keep what there is
