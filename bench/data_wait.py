"""`make bench` phase 9: how long the training loop waits for its next batch (metrics.jsonl's data_wait_s).

    python bench/data_wait.py [--demo-steps N] [--peer-steps 12] [--json] [--markdown]

1. The demo: `bash scripts/demo.sh` itself (its tokenizer and MindRecord folders made from this Python's
   standard library when output/demo_data lacks them; configs/tiny/llama_tiny.yaml on 2 data-parallel CPU
   workers, a validation pass every 50 steps), with train.log_interval=1 so that every step is a record.
   Like `make demo`, it replaces output/demo.
2. The peer config (bench/llama_peer.yaml, one worker on one core through scripts/run_standalone.sh)
   reading a blend of two MindRecord folders instead of synthetic data: the demo's corpus cut into
   sequences of 512 tokens with the demo's tokenizer, the top-level modules one source and the json and
   email packages the other, weights 0.7 / 0.3.
Per run, over the steps after the first (whose batch is read before the compile; it is reported apart as
the time to the first batch): data_wait_s and its share of the same step's step_time_s, median and
maximum. Target (issue 31): data_wait_s under 2% of the step time at every step.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEER_CONFIG = "bench/llama_peer.yaml"
DEMO_RUN = REPO / "output" / "demo"  # where scripts/demo.sh trains
DEMO_TOKENIZER = REPO / "output" / "demo_data" / "tokenizer.model"  # and keeps its tokenizer
PEER_DATA = REPO / "output" / "bench" / "data_wait_sources"
PEER_RUN = "peer_data_wait"
WEIGHTS = (0.7, 0.3)
TARGET_SHARE = 0.02  # issue 31
TIMEOUT_S = 1800


def _run(command: list[str], timeout: float = TIMEOUT_S) -> str | None:
    """The error of a command run from the repository with this interpreter, or None."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOG_v": "3", "PY": sys.executable, "PYTHON": sys.executable}
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s"
    if proc.returncode:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return f"exit {proc.returncode}: {lines[-1] if lines else 'no error output'}"
    return None


def waits(run_dir: Path) -> dict:
    """data_wait_s against step_time_s in a run's metrics.jsonl (one record per step): the first step apart,
    then the median and maximum over the others, in seconds and as a share of their own step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if any(r["steps_in_window"] != 1 for r in records) or len(records) < 2:
        raise ValueError(f"{run_dir}/metrics.jsonl: need one record per step (train.log_interval=1), two or more")
    rest = records[1:]
    shares = [r["data_wait_s"] / r["step_time_s"] for r in rest]
    worst = max(range(len(rest)), key=lambda i: shares[i])
    return {
        "steps": len(records),
        "first_wait_s": records[0]["data_wait_s"],
        "median_wait_s": statistics.median(r["data_wait_s"] for r in rest),
        "max_wait_s": max(r["data_wait_s"] for r in rest),
        "median_step_s": statistics.median(r["step_time_s"] for r in rest),
        "median_share": statistics.median(shares),
        "max_share": shares[worst],
        "worst_step": rest[worst]["step"],
    }


def demo(log, steps: int | None) -> dict:
    command = [
        "bash",
        "scripts/demo.sh",
        "--set",
        "train.log_interval=1",
        *(["--set", f"train.steps={steps}"] if steps else []),
    ]
    log(f"data wait: the demo ({shlex.join(command)})")
    load = os.getloadavg()[0]
    error = _run(command)
    out = {"command": shlex.join(command), "load_1m": [load, os.getloadavg()[0]]}
    return out | ({"error": error} if error else waits(DEMO_RUN) | {"run": "output/demo"})


def peer(log, steps: int) -> dict:
    """The peer config on a blend of two MindRecord folders made with the demo's tokenizer."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = {
        "modules": sorted(stdlib.glob("*.py")),
        "packages": sorted(stdlib.glob("json/*.py")) + sorted(stdlib.glob("email/*.py")),
    }
    out = {"commands": []}
    for name, files in inputs.items():
        command = [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            *map(str, files),
            "--tokenizer",
            str(DEMO_TOKENIZER),
            "--seq-length",
            "512",
            "--workers",
            "2",
            "--output",
            str(PEER_DATA / name),
            "--overwrite",
        ]
        out["commands"].append(
            f"python tools/preprocess_data.py --input <{len(files)} stdlib files> --tokenizer "
            f"{DEMO_TOKENIZER.relative_to(REPO)} --seq-length 512 --workers 2 --output "
            f"{(PEER_DATA / name).relative_to(REPO)} --overwrite"
        )
        error = _run(command)
        if error:
            return out | {"error": f"preprocessing {name}: {error}"}
    blend = ", ".join(f"{{path: {PEER_DATA / name}, weight: {w}}}" for name, w in zip(inputs, WEIGHTS))
    shutil.rmtree(REPO / "output" / "bench" / PEER_RUN, ignore_errors=True)
    command = [
        "bash",
        "scripts/run_standalone.sh",
        PEER_CONFIG,
        "--set",
        f"run.name={PEER_RUN}",
        "--set",
        f"train.steps={steps}",
        "--set",
        f"data.tokenizer={DEMO_TOKENIZER.relative_to(REPO)}",
        "--set",
        f"data.blend=[{blend}]",
    ]
    out["commands"].append(shlex.join(command).replace(str(REPO) + "/", ""))
    log(f"data wait: the peer config on a blend, {steps} steps")
    load = os.getloadavg()[0]
    error = _run(command)
    out["load_1m"] = [load, os.getloadavg()[0]]
    return out | (
        {"error": error} if error else waits(REPO / "output" / "bench" / PEER_RUN) | {"run": f"output/bench/{PEER_RUN}"}
    )


def run(log=print, demo_steps: int | None = None, peer_steps: int = 12) -> dict:
    out = {"demo": demo(log, demo_steps), "target_share": TARGET_SHARE}
    out["peer"] = peer(log, peer_steps) if "error" not in out["demo"] else {"error": "needs the demo's tokenizer"}
    failed = [f"{name}: {out[name]['error']}" for name in ("demo", "peer") if "error" in out[name]]
    if failed:
        out["error"] = "; ".join(failed)
    for name in ("demo", "peer"):
        r = out[name]
        log(
            f"data wait, {name}: "
            + (
                r["error"]
                if "error" in r
                else f"median {r['median_wait_s'] * 1e3:.2f} ms = {r['median_share']:.2%} of the step, "
                f"max {r['max_share']:.2%}"
            )
        )
    return out


def section(results: dict) -> list[str]:
    """BENCHMARKS.md section 9 (empty without results)."""
    data = results.get("data_wait")
    if not data:
        return []
    rows, met = [], True
    for name, what in (
        ("demo", "the demo (`scripts/demo.sh`): llama_tiny, 2 data-parallel workers, MindRecord"),
        ("peer", "the peer config, 1 worker, a 2-source MindRecord blend"),
    ):
        r = data[name]
        if "error" in r:
            rows.append(f"| {what} | failed: {r['error']} | | | | | | |")
            met = False
            continue
        met = met and r["max_share"] < data["target_share"]
        rows.append(
            f"| {what} | {r['steps']} | {r['first_wait_s'] * 1e3:.0f} | {r['median_step_s'] * 1e3:.0f} | "
            f"{r['median_wait_s'] * 1e3:.2f} ({r['median_share']:.2%}) | {r['max_wait_s'] * 1e3:.2f} | "
            f"{r['max_share']:.2%} (step {r['worst_step']}) | {r['load_1m'][0]:.1f} → {r['load_1m'][1]:.1f} |"
        )
    commands = [data["demo"].get("command"), *data["peer"].get("commands", [])]
    return [
        "## 9. Waiting for data (data_wait_s)",
        "",
        "metrics.jsonl's `data_wait_s`: the seconds the training loop waited for a step's batch (reading the "
        "samples, stacking them, making tensors), not part of `step_time_s`. One record per step "
        "(`train.log_interval=1`); the first step's batch is read before the compile and is shown apart (time to "
        "the first batch); median and maximum over the other steps, the share against the same step's "
        f"`step_time_s`. The peer config reads a blend ({' / '.join(map(str, WEIGHTS))}) of two folders made from "
        "the demo's corpus with its tokenizer at 512 tokens (`bench/data_wait.py`). A rank reads its batches on "
        "a thread two steps ahead (docs/data.md, the loader): what remains is the hand-over and the input "
        "tensors, and, on a loaded host, the loop's wait for a core. This shared 2-core host; its load "
        "(1-minute average) before and after each run.",
        "",
        "| run | steps | first batch, ms | step, ms (median) | data_wait, ms (median, share) | max data_wait, ms "
        "| max share of its step | host load |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Target (issue 31): data_wait_s under {data['target_share']:.0%} of the step time at every step after "
        f"the first: {'met' if met else 'NOT met'}.",
        "",
        "Commands: " + "; ".join(f"`{c}`" for c in commands if c) + ".",
        "",
    ]


def _arguments(parser) -> None:
    parser.add_argument("--demo-steps", type=int, help="train.steps of the demo (default: the demo's own)")
    parser.add_argument("--peer-steps", type=int, default=12, help="steps of the peer config run (default 12)")


def main(argv: list[str] | None = None) -> int:
    from bench.data_index import phase_main

    return phase_main(
        argv, __doc__, "data_wait", section, _arguments, {}, lambda a, log: run(log, a.demo_steps, a.peer_steps)
    )


if __name__ == "__main__":
    sys.exit(main())
