"""run.tensorboard (mindscale/train/loop/tensorboard.py): the event files, read back with TensorBoard's own
reader, hold the scalars of metrics.jsonl, also while the run goes on and after a resume: driven with
real time through MetricsLogger, and once through run_train.py (a real run resumed from an earlier step)."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from mindscale.config import ConfigError, load_config
from mindscale.train.loop.metrics import MetricsLogger
from mindscale.train.loop.tensorboard import FLUSH_SECS, FOLDER, scalars
from tests.integration.tiny_runs import train
from tests.run_folder import PEAK_TFLOPS, TINY

accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="TensorBoard's reader (requirements-extras.txt) reads the event files back",
)


def config(tmp_path, *overrides):
    return load_config(
        TINY,
        [
            f"run.output_dir={tmp_path}",
            "run.tensorboard=true",
            "train.steps=8",
            "train.log_interval=2",
            f"hardware.peak_tflops={PEAK_TFLOPS}",
            *overrides,
        ],
    )


def log(logger, steps, step_time):
    for step in steps:
        logger.step(step, 6.0 - 0.1 * step, 1.0 / step, step_time * (1 + step / 100), step == 3, 1e-3 * step, 2.0**16)


def read_back(run_dir) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar tag, as TensorBoard loads the folder (all event files, purges applied)."""
    events = accumulator.EventAccumulator(str(run_dir / FOLDER), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def jsonl_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The same from metrics.jsonl, each value rounded to float32 as event files store it."""
    out: dict[str, list] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in scalars(record).items():
            out.setdefault(key, []).append((record["step"], float(np.float32(value))))
    return out


def test_event_files_hold_every_scalar_of_metrics_jsonl_and_a_live_reader_sees_them(tmp_path):
    cfg, run = config(tmp_path), tmp_path / "run"
    logger = MetricsLogger(cfg, run, "CPU", write=True, first_step=0)
    log(logger, range(1, 5), 0.01)
    began = time.time()
    while read_back(run).get("loss", [(0, 0)])[-1][0] != 4:  # the writer thread flushes every FLUSH_SECS
        assert time.time() - began < FLUSH_SECS + 5, "a live reader did not see step 4"
        time.sleep(0.2)
    assert read_back(run) == jsonl_scalars(run)
    log(logger, range(5, 9), 0.01)
    logger.close()

    seen = read_back(run)
    assert seen == jsonl_scalars(run)
    assert {"loss", "lr", "loss_scale", "skipped_steps", "tokens_per_s", "mfu", "grad_norm"} <= set(seen)
    assert [step for step, _ in seen["loss"]] == [1, 2, 4, 6, 8]
    assert seen["skipped_steps"][-1] == (8, 1.0) and seen["eta_s"][0][0] == 2  # step 1's ETA is null


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    cfg, run = config(tmp_path), tmp_path / "run"
    first = MetricsLogger(cfg, run, "CPU", write=True, first_step=0)
    log(first, range(1, 9), 0.01)
    first.close()
    resumed = MetricsLogger(cfg, run, "CPU", write=True, first_step=4)  # from a checkpoint at step 4
    log(resumed, range(5, 9), 0.05)  # other step times: other throughput at steps 6 and 8
    resumed.close()

    assert len(list((run / FOLDER).iterdir())) == 2  # one event file per process start
    seen, logged = read_back(run), jsonl_scalars(run)
    assert seen == logged
    assert [step for step, _ in seen["tokens_per_s"]] == [1, 2, 4, 5, 6, 8]  # the first step after a resume logs
    assert seen["step_time_s"][-1][1] == pytest.approx(0.05 * 1.075, rel=1e-6)  # the resumed run's (steps 7, 8)


@pytest.mark.integration
def test_a_real_run_resumed_from_an_earlier_step_shows_what_metrics_jsonl_holds(tmp_path):
    common = ("run.tensorboard=true", "train.steps=6", "checkpoint.save_interval=2", "checkpoint.keep_last=3")
    train(tmp_path, "run", *common)
    resumed = train(tmp_path, "run", *common, "checkpoint.resume_step=4")  # re-trains steps 5 and 6
    assert "at step 4" in resumed.stdout
    run = tmp_path / "run"
    seen, logged = read_back(run), jsonl_scalars(run)
    assert seen == logged
    assert [step for step, _ in seen["loss"]] == [1, 2, 3, 4, 5, 6]
    assert len(list((run / FOLDER).iterdir())) == 2


@pytest.mark.integration
def test_a_process_that_exits_without_closing_still_writes_its_queued_events(tmp_path):
    """What a health guard's exit (SystemExit before MetricsLogger.close) leaves: the atexit close."""
    script = (
        "import sys; from mindscale.train.loop.tensorboard import TensorBoardLog; log = TensorBoardLog(sys.argv[1], 0)\n"
        "for step in range(1, 301): log.write({'step': step, 'loss': step / 2})\n"
        "raise SystemExit(1)"
    )
    assert subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=60).returncode == 1
    assert read_back(tmp_path) == {"loss": [(step, step / 2) for step in range(1, 301)]}


def test_only_the_logging_rank_writes_and_without_the_key_nothing(tmp_path):
    MetricsLogger(config(tmp_path), tmp_path / "other_rank", "CPU", write=False, first_step=0).close()
    MetricsLogger(config(tmp_path, "run.tensorboard=false"), tmp_path / "off", "CPU", write=True, first_step=0).close()
    assert not (tmp_path / "other_rank").exists() and not (tmp_path / "off" / FOLDER).exists()


def test_missing_tensorboardx_is_one_line_naming_the_key_and_leaves_metrics_alone(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 9, "loss": 1.0}\n')
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    with pytest.raises(
        ConfigError,
        match=r"^run.tensorboard=true needs the tensorboardX package: .*"
        r"or set run.tensorboard=false$",
    ):
        MetricsLogger(config(tmp_path), run, "CPU", write=True, first_step=0)
    assert (run / "metrics.jsonl").read_text() == '{"step": 9, "loss": 1.0}\n'


def test_a_record_costs_the_training_thread_about_a_millisecond(tmp_path):
    """The step only queues events (the writer thread writes and flushes): measured with a 20 ms step
    between records; `pytest -s -k costs` prints the figure docs/monitoring.md quotes."""
    logger = MetricsLogger(
        config(tmp_path, "train.steps=60", "train.log_interval=1"), tmp_path / "run", "CPU", write=True, first_step=0
    )
    record = logger.step(1, 5.0, 1.0, 0.01, False, 1e-3, 1.0)
    costs = []
    for step in range(2, 61):
        time.sleep(0.02)
        began = time.perf_counter()
        logger.tensorboard.write({**record, "step": step})
        costs.append(time.perf_counter() - began)
    logger.close()
    median = float(np.median(costs))
    print(
        f"\nTensorBoard: {median * 1e3:.2f} ms per record of {len(scalars(record))} scalars (median of "
        f"{len(costs)}) on the training thread"
    )
    assert median < 0.02, f"{median * 1e3:.1f} ms per record"
