"""The step line's elapsed time and ETA (mindscale/train/loop/metrics.py), driven with real time."""

import json
import time

import pytest

from mindscale.config import load_config
from mindscale.progress import clock
from mindscale.train.loop.metrics import MetricsLogger
from tests.run_folder import PEAK_TFLOPS, TINY


def test_eta_is_the_wall_clock_pace_since_the_last_line_times_the_steps_left(tmp_path, capsys):
    cfg = load_config(
        TINY,
        [f"run.output_dir={tmp_path}", "train.steps=12", "train.log_interval=4", f"hardware.peak_tflops={PEAK_TFLOPS}"],
    )
    logger = MetricsLogger(cfg, tmp_path / "run", "CPU", write=True, first_step=0)
    pause = 0.05  # wall time per step, of which the step itself (step_time) is only 1 ms
    records = []
    for step in range(1, 13):
        time.sleep(pause)
        records.append(logger.step(step, 5.0, 1.0, 0.001, False, 1e-3, 1.0))
    records = [r for r in records if r]
    assert [r["step"] for r in records] == [1, 4, 8, 12]
    assert records[0]["eta_s"] is None  # the first window holds the compile: no pace yet
    for r in records[1:]:
        assert r["eta_s"] == pytest.approx(pause * (12 - r["step"]), rel=0.5, abs=0.02)
    assert records[-1]["eta_s"] == 0
    assert records[-1]["elapsed_s"] >= 12 * pause
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(" ETA ?") and " elapsed 0:00:00 " in lines[0]
    assert lines[-1].endswith(" ETA 0:00:00") and len(lines) == 4
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["eta_s"] is None


def test_clock():
    assert (clock(65.4), clock(90061), clock(None)) == ("0:01:05", "1 day, 1:01:01", "?")


def test_data_wait_is_the_mean_per_step_of_its_window_and_on_the_step_line(tmp_path, capsys):
    cfg = load_config(
        TINY,
        [f"run.output_dir={tmp_path}", "train.steps=4", "train.log_interval=2", f"hardware.peak_tflops={PEAK_TFLOPS}"],
    )
    logger = MetricsLogger(cfg, tmp_path / "run", "CPU", write=True, first_step=0)
    records = [
        logger.step(step, 5.0, 1.0, 0.01, False, 1e-3, 1.0, data_wait=wait)
        for step, wait in zip(range(1, 5), (0.5, 0.001, 0.003, 0.002))
    ]
    assert [(r["step"], r["data_wait_s"]) for r in records if r] == [(1, 0.5), (2, 0.001), (4, pytest.approx(0.0025))]
    lines = capsys.readouterr().out.splitlines()
    assert " step 10 ms data 500.0 ms " in lines[0] and " step 10 ms data 2.5 ms " in lines[-1]


def test_the_multi_token_prediction_term_is_the_mean_of_its_window_on_the_line_and_in_the_record(tmp_path, capsys):
    cfg = load_config(
        TINY,
        [f"run.output_dir={tmp_path}", "train.steps=4", "train.log_interval=2", f"hardware.peak_tflops={PEAK_TFLOPS}"],
    )
    logger = MetricsLogger(cfg, tmp_path / "run", "CPU", write=True, first_step=0)
    records = []
    for step, term in zip(range(1, 5), (0.9, 0.8, 0.6, 0.5)):
        logger.multi_token(term)
        records.append(logger.step(step, 5.0, 1.0, 0.01, False, 1e-3, 1.0))
    assert [(r["step"], r["mtp_loss"]) for r in records if r] == [(1, 0.9), (2, 0.8), (4, pytest.approx(0.55))]
    assert capsys.readouterr().out.splitlines()[-1].endswith(" mtp_loss 0.5500")
