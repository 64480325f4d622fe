"""tools/mfu.py (docs/mfu.md) and mindscale/perf/gemm_peak.py: the published Megatron MFU/HFU figures
through the CLI, run folders (median, spread, warm-up, truncation), bad input, the CPU peak cache."""

import json
import subprocess
import sys

import pytest

from tests.run_folder import PEAK_TFLOPS, write_run
from tools import compare_runs, linearity, mfu as mfu_cli, report
from mindscale.perf import flops, gemm_peak
from mindscale.config import REPO_ROOT, load_config

# Korthikanti et al. 2022 Table 5 (selective recompute, A100 312 TFLOP/s): (h, layers, heads),
# GPUs, global batch, iteration time s, MFU %, HFU %.
KORTHIKANTI = {
    "22B": ((6144, 48, 64), 8, 4, 1.10, 41.5, 43.7),
    "175B": ((12288, 96, 96), 64, 64, 13.75, 51.4, 52.8),
    "530B": ((20480, 105, 128), 280, 280, 37.83, 56.0, 57.0),
    "1T": ((25600, 128, 160), 512, 512, 71.49, 56.3, 57.0),
}


def paper_config(tmp_path, h, layers, heads):
    path = tmp_path / f"gpt_{h}.yaml"
    path.write_text(
        "hardware: {name: a100_80gb, device_target: GPU, peak_tflops: 312.0, memory_gib: 80.0}\n"
        f"model: {{arch: gpt, vocab_size: 51200, hidden_size: {h}, num_layers: {layers}, num_heads: {heads}, "
        f"ffn_hidden_size: {4 * h}, seq_length: 2048, tie_embeddings: true, compute_dtype: float16}}\n"
        "recompute: {mode: selective}\n"
    )
    return path


def run_json(capsys, *argv) -> dict:
    assert mfu_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(KORTHIKANTI))
def test_reproduces_korthikanti_table_5(tmp_path, capsys, name):
    (h, layers, heads), gpus, batch, seconds, mfu, hfu = KORTHIKANTI[name]
    config = str(paper_config(tmp_path, h, layers, heads))
    results = [
        run_json(
            capsys, "--config", config, "--step-time", str(t), "--global-batch", str(batch), "--devices", str(gpus)
        )
        for t in (seconds + 0.005, seconds - 0.005)
    ]
    # the published time is rounded to 10 ms and the percentages to 0.1
    assert 100 * results[0]["mfu"] - 0.05 <= mfu <= 100 * results[1]["mfu"] + 0.05
    assert 100 * results[0]["hfu"] - 0.05 <= hfu <= 100 * results[1]["hfu"] + 0.05
    assert results[0]["peak_tflops"] == 312.0


def test_json_keys_and_arithmetic(tmp_path, capsys):
    config = str(paper_config(tmp_path, 12288, 96, 96))
    r = run_json(capsys, "--config", config, "--step-time", "13.75", "--global-batch", "64", "--devices", "64")
    for key in ("mfu", "hfu", "flops_per_token", "hflops_per_token", "tokens_per_s", "tflops_per_device"):
        assert key in r
    assert r["tokens_per_s"] == pytest.approx(64 * 2048 / 13.75)
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / (64 * 312e12))
    assert r["tflops_per_device"] == pytest.approx(r["mfu"] * 312)
    halved = run_json(
        capsys,
        "--config",
        config,
        "--step-time",
        "13.75",
        "--global-batch",
        "64",
        "--devices",
        "64",
        "--peak-tflops",
        "156",
    )
    assert halved["mfu"] == pytest.approx(2 * r["mfu"]) and halved["peak_source"] == "--peak-tflops"


def test_text_output_states_formula_params_and_peak(tmp_path, capsys):
    config = str(paper_config(tmp_path, 12288, 96, 96))
    assert mfu_cli.main(["--config", config, "--step-time", "13.75", "--global-batch", "64", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    assert "MFU 51.39%" in out and "peak 312 TFLOP/s" in out and "6N + 12·L·H·Q·T" in out
    assert "174,575,321,088 matmul parameters" in out


@pytest.fixture
def run_dir(tmp_path):
    # step 1 is the compile step; the steady steps take 0.50 s on average, as step 2 does
    return write_run(tmp_path, "demo", [4.0, 0.50, 0.55, 0.45, 0.52, 0.48])


def test_from_metrics_skips_warmup_and_matches_logged_mfu(run_dir, capsys):
    r = run_json(capsys, "--metrics", str(run_dir))
    assert r["records_used"] == 5 and r["steps_used"] == 5 and r["step_time_s"] == pytest.approx(0.50)
    step_2 = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])
    assert r["mfu"] == pytest.approx(step_2["mfu"]) and r["tokens_per_s"] == pytest.approx(step_2["tokens_per_s"])
    assert r["spread"]["step_time_s"]["min"] == 0.45 and r["spread"]["step_time_s"]["max"] == 0.55
    assert r["spread"]["step_time_s"]["rel_spread"] == pytest.approx(0.2)
    assert r["peak_tflops"] == PEAK_TFLOPS  # the CPU peak the run logged
    with_compile = run_json(capsys, "--metrics", str(run_dir), "--skip", "0")
    assert with_compile["records_used"] == 6 and with_compile["step_time_s"] == pytest.approx(6.5 / 6)


def test_explicit_config_overrides_the_run_config(run_dir, capsys):
    tiny = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")
    own = run_json(capsys, "--metrics", str(run_dir))
    deeper = run_json(capsys, "--metrics", str(run_dir), "--config", tiny, "--set", "model.num_layers=4")
    assert deeper["flops_per_token"] > own["flops_per_token"]
    via_set = run_json(capsys, "--metrics", str(run_dir), "--set", "model.num_layers=4")
    assert via_set["flops_per_token"] == deeper["flops_per_token"]


def windowed_run(parent, name="windows", overrides=()):
    """Records as the trainer writes them at train.log_interval=10 with a stop after step 31: the compile step
    alone, then windows of 9, 10, 10 and 1 steps (each record's step_time_s is its window's mean)."""
    run = write_run(parent, name, [6.0, 1.0, 1.4, 1.1, 3.0], list(overrides))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r, (step, window) in zip(records, [(1, 1), (10, 9), (20, 10), (30, 10), (31, 1)]):
        r.update(step=step, steps_in_window=window)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_every_tool_gives_the_same_throughput_and_mfu_total_tokens_over_total_time(tmp_path, capsys):
    """docs/mfu.md: tokens/s over the steps counted = their tokens over their time. tools/mfu.py, the HTML
    report, tools/compare_runs.py and tools/linearity.py print that one number, and the MFU it gives."""
    run = windowed_run(tmp_path)
    cfg = load_config(run / "config.yaml")
    step_time = (9 * 1.0 + 10 * 1.4 + 10 * 1.1 + 1 * 3.0) / 30  # 37 s over steps 2-31
    tokens_per_s = cfg.samples_per_step * cfg.model.seq_length / step_time
    mfu = flops.mfu(tokens_per_s, cfg.devices, PEAK_TFLOPS, cfg.model)

    measured = run_json(capsys, "--metrics", str(run))
    assert measured["step_time_s"] == pytest.approx(step_time) and measured["steps_used"] == 30
    assert measured["tokens_per_s"] == pytest.approx(tokens_per_s) and measured["mfu"] == pytest.approx(mfu)
    assert report.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert f"<td>throughput</td><td>tokens/s</td><td>{tokens_per_s:.1f}</td>" in page
    assert f"<td>MFU</td><td></td><td>{mfu:.2%}</td>" in page
    capsys.readouterr()
    assert compare_runs.main([str(run), str(run), "--json"]) == 0
    rows = {r["metric"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["throughput"]["baseline"] == pytest.approx(tokens_per_s) and rows["MFU"]["baseline"] == pytest.approx(
        mfu
    )
    wider = windowed_run(tmp_path, "windows_dp4", ["parallel.data_parallel=4"])
    assert linearity.main([str(run), str(wider), "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert points[0]["tokens_per_s"] == pytest.approx(tokens_per_s) and points[1]["linearity"] == pytest.approx(1.0)
    assert mfu_cli.main(["--metrics", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"MFU {mfu:.2%}   HFU {mfu:.2%}")


def test_truncated_last_line_is_read_up_to_it(tmp_path, capsys):
    run = write_run(tmp_path, "cut", [4.0, 0.5, 0.5], truncate=True)
    assert mfu_cli.main(["--metrics", str(run), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["records_used"] == 2
    assert "truncated" in out.err


def cli(*argv):
    return subprocess.run(
        [sys.executable, "tools/mfu.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "case,needle",
    [
        ("empty", "no records"),
        ("only-truncated", "only a truncated line"),
        ("all-warmup", "all within"),
        ("no-source", "either --metrics"),
        ("half-explicit", "go together"),
        ("no-config", "--config is required"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, case, needle):
    run = write_run(tmp_path, "r", [4.0])
    if case == "empty":
        (run / "metrics.jsonl").write_text("")
    if case == "only-truncated":
        (run / "metrics.jsonl").write_text('{"step": 1, "loss"')
    argv = {
        "empty": ["--metrics", str(run)],
        "only-truncated": ["--metrics", str(run)],
        "all-warmup": ["--metrics", str(run)],
        "no-source": ["--config", "configs/tiny/llama_tiny.yaml"],
        "half-explicit": ["--config", "configs/tiny/llama_tiny.yaml", "--step-time", "1"],
        "no-config": ["--step-time", "1", "--global-batch", "8"],
    }[case]
    proc = cli(*argv)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0]


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = gemm_peak.cpu_peak_tflops()
    assert 1e-4 < first < 10  # one core, fp32: GFLOP/s to a few TFLOP/s
    cache = json.loads(gemm_peak.cache_path().read_text())
    assert cache[gemm_peak.machine_key()]["tflops"] == first

    def no_second_measurement(*_):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(gemm_peak, "measure", no_second_measurement)
    assert gemm_peak.cpu_peak_tflops() == first
    gemm_peak.cache_path().write_text("{not json")
    monkeypatch.setattr(gemm_peak, "measure", lambda *_: 0.0123)
    assert gemm_peak.cpu_peak_tflops() == 0.0123  # a corrupt cache is re-measured and rewritten
