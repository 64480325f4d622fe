"""`make bench`: MindScale vs MindFormers 1.9.0 vs Hugging Face/torch on this CPU; rewrites BENCHMARKS.md.

    python bench/run_all.py [--reps 3] [--steps 4] [--warmup 1] [--depths 4 16 32 80]
        [--set k=v ...] [--out BENCHMARKS.md] [--json]

Phases (each sub-run is its own process with a timeout; a run that fails or times out is reported
as failed with its last error line, never dropped):
1. machine, versions, and the GEMM peaks (MindSpore one-core peak for MFU; torch's for context),
   measured again at the end: the higher of the two is used;
2. throughput on the peer config (bench/llama_peer.yaml), repetitions interleaved
   ours, MindFormers, HF, ours, ... each pinned to the same core; medians and paired ratios;
3. compile time (graph compile + first step) vs depth at a small width: MindScale and MindFormers
   compile side by side, one per core, under the same machine load; cores alternate between depths
   and repetitions;
4. data-parallel linearity: scripts/run_distribute.sh with 1 worker, 2 workers (one core each), and
   1 worker again; tools/linearity.py on the 2-worker run against each 1-worker run; then the
   gradient all-reduce alone (bench/allreduce.py under msrun, 2 workers) and the linearity ceiling it
   sets, t1 / (t1 + all-reduce);
5. checkpoint I/O (bench/checkpoint_io.py): training blocked per save, synchronous vs
   checkpoint.async_save, and tools/reshard.py's GB/s cutting a step into a sharded layout and back;
6. the sharded training step of MindScale and MindFormers under MindSpore's dry run, for the LLaMA-2 13B
   and 70B layouts at scaled widths (bench/dryrun_compare.py): collectives and bytes sent per step,
   compile seconds, per-rank weights/gradients/optimizer bytes, next to the planner's analytic volume.
7. the sample index (bench/data_index.py): build time and peak memory of the builder at 10^7, 10^8 and
   10^9 samples, and a resuming rank's time to its first batch and its index memory;
8. preprocessing (bench/preprocess_throughput.py): tools/preprocess_data.py's MB/s and tokens/s on 500 MB
   of local text with 2 workers, next to SentencePiece's own encode throughput with 2 threads, and peak memory;
9. waiting for data (bench/data_wait.py): metrics.jsonl's data_wait_s against the step time, per step, on
   the demo (scripts/demo.sh, 2 workers) and on the peer config reading a two-source MindRecord blend;
10. compile time against micro batches (bench/micro_batch_compile.py): rank 0 of llama2_13b's layout under
   the dry run at 8, 64 and 256 micro batches a step, MindScale against MindFormers;
11. the planner's speed model against published 910B throughput (bench/published_ascend.py): every row of
   bench/published_ascend.yaml predicted, with its error (no run: the anchors' figures, the planner's predictions);
13. the communication optimisations' targets (bench/communication_targets.py): the planner's predictions for the
   405B configs, LLaMA-2 at MindSpeed-LLM's card counts and section 6's layouts (no run).
Results go to output/bench/results.json and, rendered by bench/benchmarks_md.py, to --out.
`--set` overrides reach every throughput, linearity and checkpoint run (e.g. a tiny model for a smoke test);
phase 6 keeps its own scaled widths.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import (
    SYSTEMS,
    communication_targets,
    data_index,
    data_wait,
    dryrun_compare,
    micro_batch_compile,
    preprocess_throughput,
    published_ascend,
)
from bench.checkpoint_io import checkpoint_io
from bench.machine import describe, torch_gemm_tflops
from bench.benchmarks_md import lower_sweep, render
from mindscale.config import ConfigError, load_config
from mindscale.cli import OneLineParser, fail
from mindscale.io import write_atomically
from mindscale.perf.gemm_peak import measure as mindspore_gemm_tflops
from mindscale.launch.msrun import free_port
from mindscale.launch.supervisor import kill_tree

REPO = Path(__file__).resolve().parent.parent
PEER_CONFIG = "bench/llama_peer.yaml"
RESULTS = REPO / "output" / "bench" / "results.json"
# Compile vs depth: a small width, so the time is the graph's, not the arithmetic's.
DEPTH_SWEEP_SET = [
    "model.hidden_size=128",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=384",
    "model.vocab_size=2048",
    "model.seq_length=128",
    "train.micro_batch_size=1",
]
COMPILED = ("mindscale", "mindformers")
THROUGHPUT_TIMEOUT_S = 900
COMPILE_TIMEOUT_S = 1500
LINEARITY_TIMEOUT_S = 900
ALLREDUCE_TIMEOUT_S = 300
ALLREDUCE_OUT = REPO / "output" / "bench" / "allreduce.json"
ALLREDUCE_LOGS = "output/bench/allreduce_logs"
GEMM_TIMEOUT_S = 300


def log(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def python() -> str:
    return sys.executable


def bench_command(system: str, overrides: list[str], extra: list[str]) -> list[str]:
    return [
        python(),
        "bench/bench_train.py",
        "--system",
        system,
        "--config",
        PEER_CONFIG,
        *[a for o in overrides for a in ("--set", o)],
        *extra,
        "--json",
    ]


EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b:?")


def useful_lines(text: str) -> list[str]:
    """Non-empty lines that are not log chatter (MindSpore's [WARNING]/[INFO], MindFormers' logger)."""
    stripped = (line.strip() for line in text.splitlines())
    return [
        line
        for line in stripped
        if line
        and not line.startswith(("[WARNING]", "[INFO]"))
        and " - INFO - " not in line
        and " - WARNING - " not in line
    ]


def error_line(stderr: str, code: int) -> str:
    """The line that says what went wrong: the last exception line (with the next line when the
    exception's own line is only its name, as MindSpore's multi-line errors are), else the last
    non-empty stderr line that is not log chatter."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    useful = useful_lines(stderr)
    for i in range(len(useful) - 1, -1, -1):
        if EXCEPTION.match(useful[i]):
            text = useful[i]
            if text.endswith(":") or ":" not in text:
                text += " " + next((line for line in useful[i + 1 :] if not set(line) <= set("-")), "")
            return text.strip()[:300]
    return (useful or lines or [f"exit status {code}, no output"])[-1][:300]


def finish(system: str, command: list[str], proc: subprocess.Popen, timeout: float, started: float) -> dict:
    """Wait for one bench_train process; its JSON, or {"error": ...} naming what failed."""
    try:
        out, err = proc.communicate(timeout=max(timeout - (time.monotonic() - started), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"system": system, "error": f"timed out after {timeout:.0f} s", "command": shlex.join(command)}
    if proc.returncode:
        return {"system": system, "error": error_line(err, proc.returncode), "command": shlex.join(command)}
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"system": system, "error": "printed no JSON result", "command": shlex.join(command)}
    result["command"] = shlex.join(command)
    return result


def start(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOG_v": "3"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_one(system: str, command: list[str], timeout: float) -> dict:
    began = time.monotonic()
    return finish(system, command, start(command), timeout, began)


def run_side_by_side(jobs: list[tuple[str, list[str]]], timeout: float) -> list[dict]:
    began = time.monotonic()
    procs = [(system, command, start(command)) for system, command in jobs]
    return [finish(system, command, proc, timeout, began) for system, command, proc in procs]


# ----------------------------------------------------------------------------------------------
# Phases


def best_gemm_peaks(start: dict, end: dict) -> dict:
    """Per framework, the higher of the peaks measured at the start and at the end of the run: a GEMM
    timed while the host was busy understates the peak (and would overstate MFU)."""
    peaks = {"at_start": start, "at_end": end}
    for name in ("mindspore_tflops", "torch_tflops"):
        values = [p[name] for p in (start, end) if p.get(name)]
        peaks[name] = max(values) if values else None
        if not values:
            peaks[f"{name}_error"] = start.get(f"{name}_error") or end.get(f"{name}_error")
    return peaks


def gemm_peaks(core: int) -> dict:
    peaks = {}
    for name, measure in (
        ("mindspore_tflops", lambda: mindspore_gemm_tflops(timeout=GEMM_TIMEOUT_S)),
        ("torch_tflops", lambda: torch_gemm_tflops(core, GEMM_TIMEOUT_S)),
    ):
        try:
            peaks[name] = measure()
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            peaks[name] = None
            peaks[f"{name}_error"] = str(exc).splitlines()[0]
    return peaks


def throughput(args) -> list[dict]:
    runs = []
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    for rep in range(args.reps):
        for system in SYSTEMS:
            log(f"throughput rep {rep + 1}/{args.reps}: {system}")
            result = run_one(system, bench_command(system, args.overrides, extra), THROUGHPUT_TIMEOUT_S)
            result["rep"] = rep
            runs.append(result)
            log(f"  -> {result.get('tokens_per_s') or result.get('error')}")
    return runs


def compile_sweep(args, cores: list[int]) -> list[dict]:
    runs = []
    for rep in range(args.depth_reps):
        for index, depth in enumerate(args.depths):
            # a shared machine's cores are not equally busy: alternate which system gets which core
            order = COMPILED if (rep + index) % 2 == 0 else COMPILED[::-1]
            jobs = []
            for i, system in enumerate(order):
                core = cores[i % len(cores)]
                extra = ["--layers", str(depth), "--steps", "0", "--warmup", "0", "--core", str(core)]
                jobs.append((system, bench_command(system, DEPTH_SWEEP_SET, extra)))
            if len(cores) < 2:  # one core: one after the other
                results = [run_one(s, c, COMPILE_TIMEOUT_S) for s, c in jobs]
            else:
                results = run_side_by_side(jobs, COMPILE_TIMEOUT_S)
            for result in results:
                result.update(rep=rep, depth=depth)
                runs.append(result)
            log(
                f"compile depth {depth} rep {rep + 1}: "
                + ", ".join(f"{r['system']} {r.get('compile_s') or r.get('error')}" for r in results)
            )
    return runs


LINEARITY_RUNS = (("dp_n1", 1), ("dp_n2", 2), ("dp_n1_after", 1))


def linearity(args) -> dict:
    """The data-parallel runs and their linearity, then the gradient all-reduce alone and the
    linearity ceiling it sets."""
    out = data_parallel_runs(args)
    out["allreduce"] = allreduce(args)
    out["commands"].append(out["allreduce"]["command"])
    log(f"  -> all-reduce {out['allreduce'].get('wall_s') or out['allreduce'].get('error')}")
    out["ceiling"] = ceiling(out)
    return out


def data_parallel_runs(args) -> dict:
    """1 worker, 2 workers (one core each), 1 worker again, through the launcher; tools/linearity.py
    on the 2-worker run against each 1-worker run (a shared machine's load drifts: the report takes
    the lower linearity)."""
    out = {"commands": [], "runs": [], "sweeps": []}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name, workers in LINEARITY_RUNS:
        shutil.rmtree(REPO / "output" / "bench" / name, ignore_errors=True)
        command = [
            "bash",
            "scripts/run_distribute.sh",
            PEER_CONFIG,
            str(workers),
            "--set",
            f"run.name={name}",
            "--set",
            f"train.steps={args.dp_steps}",
            *[a for o in args.overrides for a in ("--set", o)],
        ]
        out["commands"].append(shlex.join(command))
        log(f"linearity: {name}, {workers} worker(s)")
        load = os.getloadavg()[0]
        code, stderr = run_tree(command, env, LINEARITY_TIMEOUT_S)
        error = (
            f"timed out after {LINEARITY_TIMEOUT_S} s" if code is None else error_line(stderr, code) if code else None
        )
        out["runs"].append(
            {
                "run": f"output/bench/{name}",
                "workers": workers,
                "load_1m_before": load,
                "load_1m_after": os.getloadavg()[0],
                "error": error,
            }
        )
        if error:
            out["error"] = f"{name} ({workers} worker(s)): {error}"
            return out
    two = next(r["run"] for r in out["runs"] if r["workers"] == 2)
    for one in (r["run"] for r in out["runs"] if r["workers"] == 1):
        command = [python(), "tools/linearity.py", one, two, "--threshold", "0.95", "--json"]
        out["commands"].append(shlex.join(command))
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode:
            out["error"] = error_line(proc.stderr, proc.returncode)
            return out
        out["sweeps"].append(json.loads(proc.stdout))
    return out


def allreduce(args) -> dict:
    """bench/allreduce.py under msrun, 2 workers: its JSON plus the command, or {"error", "command"}."""
    bin_dir = Path(python()).parent  # msrun starts `python` from PATH: this interpreter's
    command = [
        str(bin_dir / "msrun"),
        "--worker_num=2",
        "--local_worker_num=2",
        f"--master_port={free_port()}",
        f"--log_dir={ALLREDUCE_LOGS}",
        "--join=True",
        "bench/allreduce.py",
        "--out",
        str(ALLREDUCE_OUT),
        *[a for o in args.overrides for a in ("--set", o)],
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GLOG_v": "3",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    record = {"command": shlex.join(command)}
    log("linearity: gradient all-reduce alone, 2 workers")
    ALLREDUCE_OUT.unlink(missing_ok=True)
    shutil.rmtree(REPO / ALLREDUCE_LOGS, ignore_errors=True)  # msrun_error reads the logs of this run only
    code, err = run_tree(command, env, ALLREDUCE_TIMEOUT_S)
    if code is None:
        return record | {"error": f"timed out after {ALLREDUCE_TIMEOUT_S} s"}
    if code:
        return record | {"error": msrun_error(err, code)}
    try:
        return json.loads(ALLREDUCE_OUT.read_text()) | record
    except (OSError, json.JSONDecodeError):
        return record | {"error": f"msrun exited 0 but rank 0 wrote no JSON to {ALLREDUCE_OUT}"}


def msrun_error(stderr: str, code: int) -> str:
    """msrun's own error only says to read the logs: the error of the first worker log (then the
    scheduler's) that has more than log chatter, else msrun's."""
    logs = [*sorted((REPO / ALLREDUCE_LOGS).glob("worker_*.log")), REPO / ALLREDUCE_LOGS / "scheduler.log"]
    for path in logs:
        text = path.read_text(errors="replace") if path.is_file() else ""
        if useful_lines(text):
            return f"{path.name}: {error_line(text, code)}"
    return error_line(stderr, code)


def run_tree(command: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """(exit status, stderr) of a launcher run; (None, stderr) after a timeout, with the launcher and
    every worker under it killed (subprocess.run would kill the launcher alone)."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return None, ""
    return proc.returncode, err


def ceiling(lin: dict) -> dict | None:
    """The linearity 2 workers could reach if the all-reduce were their only overhead:
    t1 / (t1 + all-reduce wall time), with t1 the 1-worker step time of the sweep the report uses
    (the lower linearity). The all-reduce cannot overlap the backward pass (bench/allreduce.py)."""
    sweep, wall = lower_sweep(lin), lin.get("allreduce", {}).get("wall_s")
    if sweep is None or wall is None:
        return None
    base = sweep["points"][0]
    return {
        "value": base["step_time_s"] / (base["step_time_s"] + wall),
        "one_worker_step_s": base["step_time_s"],
        "base_run": base["run"],
        "allreduce_wall_s": wall,
    }


# ----------------------------------------------------------------------------------------------
# Summary numbers (also what render() prints)


def medians(runs: list[dict], key: str) -> dict:
    by_system = {}
    for system in {r["system"] for r in runs}:
        values = [r[key] for r in runs if r["system"] == system and r.get(key) is not None]
        if values:
            by_system[system] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "n": len(values),
            }
    return by_system


def paired_ratios(runs: list[dict], key: str, ours: str, peer: str, group: str) -> dict | None:
    """Median over groups (repetitions, or depth x repetition) of ours/peer measured together."""
    groups = {}
    for r in runs:
        if r.get(key) is not None:
            groups.setdefault(tuple(r[g] for g in group.split(",")), {})[r["system"]] = r[key]
    ratios = [g[ours] / g[peer] for g in groups.values() if ours in g and peer in g and g[peer]]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def summarize(results: dict) -> dict:
    runs, peak = results["throughput"], results["gemm"].get("mindspore_tflops")
    summary = {
        "tokens_per_s": medians(runs, "tokens_per_s"),
        "tflops": medians(runs, "tflops"),
        "compile_s": medians(runs, "compile_s"),
        "peak_rss_gib": medians(runs, "peak_rss_gib"),
        "ratio_vs": {
            peer: paired_ratios(runs, "tokens_per_s", "mindscale", peer, "rep") for peer in ("mindformers", "hf")
        },
    }
    summary["mfu"] = {s: v["median"] / peak for s, v in summary["tflops"].items()} if peak else {}
    sweep = results["compile"]
    summary["compile_by_depth"] = {
        depth: {
            "systems": medians([r for r in sweep if r["depth"] == depth], "compile_s"),
            "ratio": paired_ratios(
                [r for r in sweep if r["depth"] == depth], "compile_s", "mindscale", "mindformers", "rep"
            ),
        }
        for depth in sorted({r["depth"] for r in sweep})
    }
    return summary


def describe_peer(cfg) -> dict:
    m, t = cfg.model, cfg.train
    return {
        "batch": t.micro_batch_size,
        "seq": m.seq_length,
        "hidden": m.hidden_size,
        "layers": m.num_layers,
        "heads": m.num_heads,
        "kv_heads": m.kv_heads,
        "ffn": m.ffn_hidden_size,
        "vocab": m.vocab_size,
        "lr": t.lr,
        "schedule": t.lr_schedule,
        "betas": f"{t.adam_beta1}/{t.adam_beta2}",
        "eps": t.adam_eps,
        "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip,
        "init_std": m.init_std,
    }


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="interleaved throughput repetitions (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per throughput run (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (default 1)")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 32, 80], help="compile sweep depths")
    parser.add_argument("--depth-reps", type=int, default=1, help="compile sweep repetitions (default 1)")
    parser.add_argument("--dp-steps", type=int, default=5, help="steps of each linearity run (default 5)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for every throughput, linearity and checkpoint run (smoke tests)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md", help="Markdown to (re)write")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    for name in ("reps", "steps", "depth_reps", "dp_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0 or min(args.depths) < 1:
        fail("--warmup must be >= 0 and --depths >= 1")
    if args.dp_steps < 2:
        fail(f"--dp-steps {args.dp_steps}: linearity drops the first (compile) step; use at least 2")
    try:
        peer = load_config(REPO / PEER_CONFIG, args.overrides)
    except ConfigError as exc:
        fail(str(exc))

    began = time.time()
    cores = sorted(os.sched_getaffinity(0))
    results = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": describe(),
        "load_1m_start": os.getloadavg()[0],
        "peer": describe_peer(peer),
        "depth_sweep_set": DEPTH_SWEEP_SET,
        "settings": vars(args) | {"out": str(args.out)},
        "command": shlex.join([Path(sys.executable).name, "bench/run_all.py", *(argv or sys.argv[1:])]),
    }
    log("GEMM peaks")
    first_peaks = gemm_peaks(cores[0])
    results["throughput"] = throughput(args)
    results["compile"] = compile_sweep(args, cores)
    results["linearity"] = linearity(args)
    results["checkpoint_io"] = checkpoint_io(PEER_CONFIG, args.overrides, log)
    results["dryrun_compare"] = dryrun_compare.run(log)
    results["data_index"] = data_index.run(log)
    results["preprocess"] = preprocess_throughput.run(log)
    results["data_wait"] = data_wait.run(log)
    results["micro_batch_compile"] = micro_batch_compile.run(log)
    results["published_ascend"] = published_ascend.run(log)
    results["communication_targets"] = communication_targets.run(log)
    log("GEMM peaks again")
    results["gemm"] = best_gemm_peaks(first_peaks, gemm_peaks(cores[0]))
    results["load_1m_end"] = os.getloadavg()[0]
    results["duration_s"] = time.time() - began
    results["summary"] = summarize(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(RESULTS, json.dumps(results, indent=1) + "\n")
    write_atomically(args.out, render(results, (REPO / "bench" / "changes.md").read_text()))
    log(f"wrote {args.out} and {RESULTS} in {results['duration_s'] / 60:.1f} min")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
