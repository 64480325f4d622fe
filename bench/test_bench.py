"""Tests of the benchmark harness (not of the numbers): `pytest -q bench/test_bench.py`.

The three stacks train a tiny LLaMA once per module (about a minute on one core), and the gradient
all-reduce of the tiny LLaMA runs once under msrun with 2 workers; everything else is pure Python
on synthetic results.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import SYSTEMS
from bench.benchmarks_md import render
from bench.run_all import allreduce, best_gemm_peaks, ceiling, error_line, paired_ratios, summarize

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration  # trains three stacks in processes, runs msrun

TINY = [
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=160",
    "model.vocab_size=512",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "model.num_layers=1",
]


def bench_train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOG_v": "3"}
    return subprocess.run(
        [sys.executable, "bench/bench_train.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_runs() -> dict:
    runs = {}
    for system in SYSTEMS:
        proc = bench_train(
            "--system", system, *[a for o in TINY for a in ("--set", o)], "--steps", "2", "--warmup", "1", "--json"
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1, f"{system} printed more than the JSON object: {lines[:3]}"
        runs[system] = json.loads(lines[0])
    return runs


def test_every_system_trains_the_same_model(tiny_runs):
    params = {r["params"] for r in tiny_runs.values()}
    assert len(params) == 1, {s: r["params"] for s, r in tiny_runs.items()}
    for system, r in tiny_runs.items():
        for key in ("tokens_per_s", "tflops", "compile_s", "peak_rss_gib"):
            assert r[key] > 0, (system, key)
        # same init scale: the first loss of a small-std init is close to ln(vocab) for all three
        assert abs(r["losses"][0] - math.log(512)) < 0.1, (system, r["losses"][0])
        assert r["losses"][-1] < r["losses"][0], f"{system} did not train on its fixed batch"
        assert r["threads"] == 1 and len(r["step_times_s"]) == 2


def test_hf_process_does_not_load_mindspore(tiny_runs):
    """MindSpore's import alone is ~350 MB: it must not inflate the hf peak RSS."""
    assert tiny_runs["hf"]["peak_rss_gib"] < tiny_runs["mindscale"]["peak_rss_gib"]
    code = "import sys; from bench.systems import optimizer_rules; optimizer_rules(); print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_optimizer_rules_are_training_optims():
    from bench.systems import optimizer_rules
    from mindscale.config import TrainConfig
    from mindscale.train.loop import optim

    lr_at, decays = optimizer_rules()
    t = TrainConfig(steps=50, lr=1.0, min_lr=0.1, warmup_steps=5)
    assert [lr_at(s, t) for s in range(50)] == [optim.lr_at(s, t) for s in range(50)]
    for name, shape in [("a.weight", (4, 4)), ("layers.0.attention_norm.weight", (4,)), ("norm.weight", (4, 4))]:
        assert decays(name, shape) == optim.decays(name, shape)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--system", "mindscale", "--core", "999"], "--core 999"),
        (["--system", "mindscale", "--layers", "0"], "--layers 0"),
        (["--system", "nope"], "invalid choice"),
        (["--system", "hf", "--set", "model.hiden_size=3"], "did you mean"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, words):
    proc = bench_train(*args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def _run(system, rep, tokens, depth=None, error=None):
    r = {"system": system, "rep": rep, "command": f"bench {system}"}
    if error:
        return {**r, "error": error}
    r.update(
        tokens_per_s=tokens,
        tflops=tokens * 1e-4,
        compile_s=tokens / 100,
        peak_rss_gib=1.0,
        params=10,
        losses=[6.2, 6.0],
        core=rep % 2,
    )
    if depth is not None:
        r["depth"] = depth
    return r


def linearity_result(base_a: float, base_b: float, two_workers: float) -> dict:
    def point(run, devices, tokens, base):
        return {
            "run": run,
            "devices": devices,
            "tokens_per_s": tokens,
            "tokens_per_s_per_device": tokens / devices,
            "step_time_s": 1.0,
            "linearity": tokens / devices / base,
        }

    runs = [("dp_n1", 1), ("dp_n2", 2), ("dp_n1_after", 1)]
    return {
        "commands": ["bash scripts/run_distribute.sh ..."],
        "runs": [{"run": r, "workers": w, "load_1m_before": 1.0, "load_1m_after": 1.0, "error": None} for r, w in runs],
        "sweeps": [
            {"points": [point(one, 1, base, base), point("dp_n2", 2, two_workers, base)]}
            for one, base in (("dp_n1", base_a), ("dp_n1_after", base_b))
        ],
    }


def synthetic_results(hf_error: str | None = None) -> dict:
    throughput = []
    for rep, (ours, mf, hf) in enumerate([(500, 400, 450), (300, 250, 310), (480, 390, 470)]):
        throughput += [_run("mindscale", rep, ours), _run("mindformers", rep, mf), _run("hf", rep, hf, error=hf_error)]
    compile_runs = [_run("mindscale", 0, 1000, depth=32), _run("mindformers", 0, 2000, depth=32)]
    return {
        "throughput": throughput,
        "compile": compile_runs,
        "gemm": {"mindspore_tflops": 0.1, "torch_tflops": 0.08},
        "machine": {
            "cpu": "Test CPU",
            "logical_cores": 2,
            "usable_cores": [0, 1],
            "memory_gib": 8.0,
            "kernel": "6",
            "python": "3.11",
            "versions": {"mindspore": "2.9.0"},
        },
        "linearity": linearity_result(base_a=100.0, base_b=95.0, two_workers=190.0),
        "load_1m_start": 1.0,
        "load_1m_end": 1.5,
        "started": "now",
        "duration_s": 60.0,
        "command": "run_all",
        "depth_sweep_set": ["model.hidden_size=128"],
        "peer": {
            "batch": 4,
            "seq": 512,
            "hidden": 512,
            "layers": 4,
            "heads": 8,
            "kv_heads": 8,
            "ffn": 1536,
            "vocab": 8192,
            "lr": 3e-4,
            "schedule": "cosine",
            "betas": "0.9/0.95",
            "eps": 1e-8,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "init_std": 0.02,
        },
        "settings": {"reps": 3, "steps": 3, "warmup": 1, "depths": [32], "depth_reps": 1, "overrides": []},
    }


def test_ratios_are_medians_of_per_repetition_ratios():
    results = synthetic_results()
    ratio = paired_ratios(results["throughput"], "tokens_per_s", "mindscale", "mindformers", "rep")
    per_rep = sorted([500 / 400, 300 / 250, 480 / 390])
    assert ratio["median"] == pytest.approx(per_rep[1]) and ratio["n"] == 3
    summary = summarize(results)
    assert summary["tokens_per_s"]["mindscale"]["median"] == 480
    assert summary["mfu"]["mindscale"] == pytest.approx(480e-4 / 0.1)
    assert summary["compile_by_depth"][32]["ratio"]["median"] == pytest.approx(0.5)


def rank(sent: float, planned: float, compile_s: float, as_planned: bool) -> dict:
    """One compiled rank of a dry-run comparison, as bench/dryrun_compare.summary gives it."""
    return {
        "rank": 0,
        "stage": 0,
        "compiled": True,
        "compile_s": compile_s,
        "sent_bytes": sent,
        "planned_sent_bytes": planned,
        "bytes": dict(weights=1, grads=1, optimizer=2),
        "planned_bytes": dict(weights=1, grads=1, optimizer=2 if as_planned else 4),
        "collectives": {},
    }


def test_report_states_targets_and_failed_peers():
    results = synthetic_results(hf_error="ImportError: No module named 'transformers'")
    results["summary"] = summarize(results)
    text = render(results, "- nothing changed yet")
    assert "ImportError: No module named 'transformers'" in text  # a failed peer is named, with its error
    assert "| HF transformers / torch | failed" in text
    assert "compile time ≤ 1/3 of MindFormers' at 32 layers | 0.500× | **not met**" in text
    assert "linearity ≥ 0.95 (2 workers) | 0.950 | met" in text  # the lower of 190/2/100 and 190/2/95
    assert "- nothing changed yet" in text and "How to rerun" in text
    assert "Gradient all-reduce" not in text  # results from before bench/allreduce.py still render
    assert "tokens/s ≥ 1.3× MindFormers 1.9.0 | 1.231 (1.200–1.250)× | **not met**" in text
    assert "peak host RSS ≤" not in text  # no HF run, no memory ratio
    results = synthetic_results()
    results["summary"] = summarize(results)
    results["dryrun_compare"] = [
        {
            "config": "c.yaml",
            "devices": 8,
            "layout": {"dp": 8, "tp": 1, "sp": False, "pp": 1},
            "mindscale": [rank(0.9e9, 1.0e9, 10.0, True)],
            "mindformers": [rank(1.0e9, 1.0e9, 20.0, False)],
        }
    ]
    text = render(results, "")
    assert "peak host RSS ≤ 1.5× HF transformers / torch's | 1.00× (1.00 / 1.00 GiB, medians) | met" in text
    assert "bytes sent ≤ 1.0× MindFormers' | 0.90× | met" in text
    assert "stage compile ≤ 1/3 of MindFormers' | 0.50× | **not met**" in text
    assert "weights / grads / AdamW = the planner's | 1 of 1 ranks | met" in text
    results["linearity"]["allreduce"] = {"error": "worker_0.log: RuntimeError: boom", "command": "msrun ..."}
    text = render(results, "")
    assert "Gradient all-reduce (`bench/allreduce.py`): failed: `worker_0.log: RuntimeError: boom`" in text


def test_gemm_peak_is_the_higher_of_start_and_end_and_both_are_shown():
    peaks = best_gemm_peaks(
        {"mindspore_tflops": 0.063, "torch_tflops": 0.076},
        {"mindspore_tflops": 0.077, "torch_tflops": None, "torch_tflops_error": "boom"},
    )
    assert peaks["mindspore_tflops"] == 0.077 and peaks["torch_tflops"] == 0.076
    assert "torch_tflops_error" not in peaks  # one measurement is enough
    results = synthetic_results() | {"gemm": peaks}
    results["summary"] = summarize(results)
    assert summarize(results)["mfu"]["mindscale"] == pytest.approx(480e-4 / 0.077)
    assert "**0.0770 TFLOP/s** (the higher of the start, 0.0630, and the end of the run, 0.0770)" in render(results, "")
    failed = best_gemm_peaks(
        {"mindspore_tflops": None, "mindspore_tflops_error": "no MindSpore"},
        {"mindspore_tflops": None, "mindspore_tflops_error": "no MindSpore"},
    )
    assert failed["mindspore_tflops"] is None and failed["mindspore_tflops_error"] == "no MindSpore"


def test_linearity_above_one_is_called_noise_not_a_pass():
    results = synthetic_results()
    results["linearity"] = linearity_result(base_a=60.0, base_b=65.0, two_workers=190.0)
    results["summary"] = summarize(results)
    assert "| 1.462 | inconclusive" in render(results, "")


def test_error_line_skips_log_chatter():
    stderr = "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n[WARNING] ME(1): at exit\n"
    assert error_line(stderr, 1) == "RuntimeError: boom"
    assert error_line("", 3) == "exit status 3, no output"


def test_allreduce_of_the_gradients_under_msrun_and_its_ceiling():
    """bench/allreduce.py for real, launched as `make bench` does (msrun, 2 workers), on the tiny model."""
    from models import count_parameters
    from mindscale.config import load_config

    ar = allreduce(SimpleNamespace(overrides=TINY))
    assert "error" not in ar, ar
    assert ar["workers"] == 2 and ar["tensors"] == 12  # embedding, 9 in the layer, final norm, head
    assert ar["bytes"] == 4 * count_parameters(load_config(REPO / "bench" / "llama_peer.yaml", TINY))
    assert ar["wall_s"] > 0 and ar["cpu_s"] > 0 and ar["mb_per_s"] == pytest.approx(ar["bytes"] / 1e6 / ar["wall_s"])
    assert len(ar["wall_s_calls"]) == 5 and ar["versions"]["mindspore"]
    results = synthetic_results()
    results["linearity"]["allreduce"] = ar
    results["linearity"]["ceiling"] = ceiling(results["linearity"])
    results["summary"] = summarize(results)
    text = render(results, "")
    # the lower-linearity sweep (base dp_n1) is the reported one; its 1-worker step is 1.0 s
    assert results["linearity"]["ceiling"]["value"] == pytest.approx(1 / (1 + ar["wall_s"]))
    assert (
        f"| {ar['bytes'] / 1e6:.1f} MB in 12 tensors | {ar['wall_s']:.3f} | {ar['cpu_s']:.3f} | "
        f"{ar['mb_per_s']:.0f} | {1 / (1 + ar['wall_s']):.3f} = 1.000 / (1.000 + {ar['wall_s']:.3f}) "
        "(base `dp_n1`) |"
    ) in text


def test_allreduce_bad_input_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "bench/allreduce.py", "--out", "x.json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "runs under msrun" in lines[0], proc.stderr


def test_checkpoint_io_phase_measures_saves_and_reshards_for_real():
    """Phase 5 for real on the tiny model: sync and async runs each report their three interval saves'
    blocked time and the step's bytes; the step is cut into a dry-run-compiled dp2 x mp2 layout (4 rank
    folders) and merged back to the same tensors; the report renders every figure."""
    from bench.checkpoint_io import checkpoint_io
    from mindscale.io import read_tensors

    io = checkpoint_io("bench/llama_peer.yaml", TINY, lambda text: None)
    for run in io["saves"]:
        assert "error" not in run, run
        assert len(run["blocked_s"]) == 3 and all(b > 0 for b in run["blocked_s"]) and run["step_bytes"] > 1e6
    cut, merged = io["reshard"]
    assert "error" not in cut and "error" not in merged, io["reshard"]
    assert cut["ranks"] == 4 and cut["compile_s"] > 0 and merged["ranks"] == 1 and merged["compile_s"] == 0
    assert cut["bytes"] == merged["bytes"] and cut["gb_per_s"] > 0
    source, back = (
        REPO / io["saves"][0]["step_folder"],
        REPO / merged["output"] / Path(io["saves"][0]["step_folder"]).name,
    )
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = read_tensors(source / name), read_tensors(back / name)
        assert a.keys() == b.keys() and all((a[n] == b[n]).all() for n in a), name
    results = synthetic_results()
    results["checkpoint_io"] = io
    results["summary"] = summarize(results)
    text = render(results, "")
    sync = io["saves"][0]
    assert f"| synchronous | {sync['median_blocked_s']:.3f} (" in text and "`checkpoint.async_save: true`" in text
    assert f"| into whole (the peer config) | 1 | {merged['bytes'] / 1e9:.3f} |" in text
    assert "## 5. Checkpoint I/O" not in render(synthetic_results() | {"summary": results["summary"]}, "")


def test_dryrun_comparison_compiles_both_stacks_under_one_layout_and_renders():
    """Phase 6 on a tiny dp2 x pp2 layout, rank 0 only: both stacks compile for real under the dry run,
    their pipeline sends are found, and the section states the targets."""
    from bench.dryrun_compare import compare

    sets = [
        "hardware=ascend910b",
        "model.hidden_size=64",
        "model.num_heads=4",
        "model.num_kv_heads=null",
        "model.ffn_hidden_size=128",
        "model.vocab_size=256",
        "model.seq_length=64",
        "model.num_layers=4",
        "parallel.data_parallel=2",
        "parallel.model_parallel=1",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.sequence_parallel=false",
        "recompute.mode=none",
        "recompute.layers=null",
        "train.global_batch_size=null",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        result = compare("configs/llama2/llama2_13b.yaml", Path(tmp), jobs=2, sets=sets, ranks="0")
    assert result["layout"]["pp"] == 2 and result["devices"] == 4
    for stack in ("mindscale", "mindformers"):
        (rank,) = result[stack]
        assert rank["compiled"], rank.get("error")
        assert rank["collectives"]["Send"]["sent_bytes"] > 0 and rank["compile_s"] > 0
        assert rank["bytes"]["weights"] > 0 and rank["bytes"]["optimizer"] == 2 * rank["bytes"]["grads"]
    assert result["mindscale"][0]["bytes"] == result["mindscale"][0]["planned_bytes"]
    from bench.benchmarks_md import dryrun_compare_section

    text = "\n".join(dryrun_compare_section({"dryrun_compare": [result]}))
    assert "vs MindFormers" in text and "Targets" in text and "MindFormers |" in text


def test_memory_breakdown_phases_of_a_tiny_mindscale_run():
    """bench/memory_breakdown.py: every phase has its own exact peak (clear_refs), the run's peak is the
    largest of them, the compile is its own phase, and --kernels reads the tiny model's kernel graph and
    finds no broadcasting arithmetic kernel in it (models/cpu_kernels.py EqualShapes)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOG_v": "3"}
    proc = subprocess.run(
        [
            sys.executable,
            "bench/memory_breakdown.py",
            "--system",
            "mindscale",
            "--steps",
            "1",
            "--kernels",
            "--maps",
            "3",
            "--json",
            *[a for o in TINY for a in ("--set", o)],
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [p["phase"] for p in r["phases"]] == ["python", "import", "build", "compile", "step 1", "steps 2-2"]
    assert r["compiled_separately"] and r["peak_per_phase_exact"]
    assert r["peak"] == max(p["peak"] for p in r["phases"]) and all(p["peak"] >= p["rss"] > 0 for p in r["phases"])
    assert r["phases"][2]["rss"] - r["phases"][1]["rss"] < 2**30 and len(r["smaps_at_end"]) == 3
    assert len(r["losses"]) == 2 and abs(r["losses"][0] - math.log(512)) < 0.1
    k = r["broadcast_kernels"]
    assert k["arithmetic"] > 50 and k["kernels"] == 0 and k["bytes"] == 0 and k["largest"] == []


def test_accumulation_memory_splits_the_compiled_graph_from_the_step():
    """bench/accumulation_memory.py (one process, the cheap case): per accumulation count, the memory after the
    compile, its peak, and the difference; the unrolled micro batches make the compiled graph larger."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOG_v": "3"}
    proc = subprocess.run(
        [
            sys.executable,
            "bench/accumulation_memory.py",
            "--config",
            "configs/tiny/llama_tiny.yaml",
            "--accumulation",
            "1,2",
            "--workers",
            "1",
            "--json",
            *[a for o in TINY for a in ("--set", o)],
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert [r["accumulation"] for r in rows] == [1, 2] and all(r["rank"] == 0 for r in rows)
    assert all(r["peak_gib"] > r["compiled_gib"] > 0 and abs(r["loss"] - math.log(512)) < 0.2 for r in rows)
    assert rows[1]["compiled_gib"] > rows[0]["compiled_gib"]
    assert all(r["step_gib"] == pytest.approx(r["peak_gib"] - r["compiled_gib"], abs=2e-3) for r in rows)


def test_broadcast_kernels_are_the_ones_off_the_cpu_fast_paths():
    from bench.memory_breakdown import broadcast_kernels

    def node(op, a, b, out, scope):
        sig = ", ".join(f"<Tensor[Float32], {s}>" for s in (a, b))
        return (
            f"  %1(x) = PrimFunc_{op}(%0, %2) {{instance name: m}}\n      : ({sig}) -> (<Tensor[Float32], {out}>)\n"
            f"      # Fullname with scope: ({scope})\n"
        )

    ir = (
        node("Mul", "(8, 4)", "(4)", "(8, 4)", "Default/norm-RMSNorm/Mul-op1")  # broadcast: kept
        + node("Mul", "(8, 4)", "(8, 4)", "(8, 4)", "Default/a/Mul-op2")  # same shape: fast path
        + node("Add", "(8, 4)", "()", "(8, 4)", "Default/b/Add-op3")  # scalar: fast path
        + node("MatMul", "(8, 4)", "(4, 2)", "(8, 2)", "Default/c/MatMul-op4")
    )  # not arithmetic
    (k,) = broadcast_kernels(ir)
    assert k["op"] == "Mul" and k["bytes"] == 16 * 32 and k["scope"] == "Default/norm-RMSNorm/Mul-op1"


def test_data_index_phase_builds_reads_and_renders():
    """Phase 7 for real at a small size: the build and the resuming rank run in their own processes, report
    their times and memory, and the section renders them (and splices into BENCHMARKS.md's text)."""
    from bench import data_index

    results = data_index.run(lambda text: None, sizes=(2 * 10**5,))
    size = results["sizes"][0]
    assert "error" not in size, size
    assert size["build_s"] > 0 and size["peak_mib"] > size["baseline_mib"] > 0 and size["rows_read"] > 0
    assert size["disk_bytes"] >= 4 * 2 * 10**5 and size["rank_peak_mib"] < 64
    lines = data_index.section({"data_index": results})
    assert lines[0].startswith("## 7. Sample index") and f"| 2e+05 | {size['build_s']:.1f} |" in "\n".join(lines)
    text = data_index.splice("# B\n\n## 6. x\n\n## How to rerun\n", lines)
    assert text.index("## 7.") < text.index("## How to rerun") and data_index.splice(text, lines) == text
    assert data_index.section({}) == []


def test_preprocess_phase_measures_the_tool_and_its_ceiling_and_renders():
    """Phase 8 for real on 0.3 MB of text: the tool and the bare tokenizer run in their own processes with the
    same corpus and report time, tokens and memory; the section renders them and splices after section 7."""
    from bench import data_index, preprocess_throughput

    r = preprocess_throughput.run(lambda text: None, megabytes=0.3, workers=2)
    assert "error" not in r, r
    assert r["corpus"]["text_bytes"] >= 3e5 and r["tool"]["num_samples"] > 0 and r["ratio"] > 0
    assert abs(r["tool"]["num_tokens"] - r["corpus"]["documents"] - r["ceiling"]["tokens"]) == 0  # + one EOS each
    assert r["tool"]["main_peak_mib"] > 0 and r["tool"]["worker_peak_mib"] > 0 and r["tool"]["workers_cpu_s"] > 0
    lines = preprocess_throughput.section({"preprocess": r})
    assert lines[0].startswith("## 8. Preprocessing") and f"| {r['tool_mb_s']:.2f} |" in "\n".join(lines)
    text = data_index.splice("# B\n\n## 7. Sample index x\n\ny\n\n## How to rerun\n", lines)
    assert text.index("## 7.") < text.index("## 8.") < text.index("## How to rerun")
    assert data_index.splice(text, lines) == text and preprocess_throughput.section({}) == []


def test_data_wait_phase_takes_the_first_step_apart_and_renders(tmp_path):
    """Phase 9's arithmetic on records of known waits: the first step (read before the compile) apart, the
    median and the worst of the others each against its own step; a window of several steps is refused; the
    section renders the verdict and splices after section 8."""
    from bench import data_index, data_wait

    steps = [(1, 0.5, 9.0), (2, 0.001, 0.1), (3, 0.003, 0.1), (4, 0.002, 0.2), (5, 0.001, 0.05)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "steps_in_window": 1, "data_wait_s": w, "step_time_s": t}) + "\n"
            for s, w, t in steps
        )
    )
    r = data_wait.waits(tmp_path)
    assert (r["steps"], r["first_wait_s"], r["median_wait_s"], r["max_wait_s"]) == (5, 0.5, 0.0015, 0.003)
    assert (r["median_share"], r["max_share"], r["worst_step"]) == (pytest.approx(0.015), pytest.approx(0.03), 3)
    results = {
        "data_wait": {
            "target_share": 0.02,
            "demo": {**r, "command": "bash scripts/demo.sh", "load_1m": [2, 3]},
            "peer": {"error": "exit 1: boom", "commands": []},
        }
    }
    lines = data_wait.section(results)
    assert (
        lines[0] == "## 9. Waiting for data (data_wait_s)"
        and "| 5 | 500 | 100 | 1.50 (1.50%) | 3.00 | 3.00% (step 3) | 2.0 → 3.0 |" in "\n".join(lines)
        and "failed: exit 1: boom" in "\n".join(lines)
        and "data_wait_s under 2% " in "\n".join(lines)
    )
    assert "NOT met" in "\n".join(lines) and data_wait.section({}) == []
    text = data_index.splice("# B\n\n## 8. Preprocessing x\n\ny\n\n## How to rerun\n", lines)
    assert text.index("## 8.") < text.index("## 9.") < text.index("## How to rerun")
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 10, "steps_in_window": 10, "data_wait_s": 0, "step_time_s": 1}) + "\n"
    )
    with pytest.raises(ValueError, match="one record per step"):
        data_wait.waits(tmp_path)


def test_micro_batch_sweep_judges_every_count_and_renders_the_curve():
    """Phase 10's verdict: at most 1.0x MindFormers at every count and 0.8x at the largest; a failed compile
    fails the target and shows its error; the section has the chart, the table and the rerun command."""
    from bench import micro_batch_compile as sweep

    def point(count, ours, peer):
        return {
            "micro_batches": count,
            "load_1m": 1.0,
            "mindscale": {"compile_s": ours},
            "mindformers": {"compile_s": peer},
        }

    data = {
        "config": "configs/llama2/llama2_13b.yaml",
        "overrides": ["model.num_layers=8"],
        "points": [point(8, 5.0, 7.0), point(64, 14.0, 14.0), point(256, 40.0, 52.0)],
    }
    assert sweep.targets(data)[1:] == ("8: 0.71×, 64: 1.00×, 256: 0.77×", True)
    data["points"][-1]["mindscale"]["compile_s"] = 45.0
    assert sweep.targets(data)[2] is False  # 0.87x at 256
    text = "\n".join(sweep.section({"micro_batch_compile": data}))
    assert "| 256 | 45.0 | 52.0 | 0.87× | 1.0 |" in text and "NOT met" in text and "xychart-beta" in text
    assert "line [5.0, 14.0, 45.0]" in text and "--micro 8 64 256" in text
    data["points"][1]["mindformers"] = {"error": "boom"}
    assert sweep.targets(data)[1:] == ("8: 0.71×, 64: failed, 256: 0.87×", False)
    assert "failed: `boom`" in "\n".join(sweep.section({"micro_batch_compile": data})) and sweep.section({}) == []
