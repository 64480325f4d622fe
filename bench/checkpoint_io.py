"""`make bench` phase 5, checkpoint I/O on the peer config (bench/run_all.py runs it).

1. Training blocked per save: the peer config through scripts/run_standalone.sh, saving every
   SAVE_INTERVAL steps, once with checkpoint.async_save false and once true; each interval save's
   `save_blocked_s` from metrics.jsonl (the final save is not counted: it waits for its write).
   A synchronous save blocks for the whole write; an asynchronous one for the copy to host, plus the
   wait for the previous write when that is still running.
2. Resharding (tools/reshard.py): the synchronous run's last interval step cut into RESHARD_SET
   (a layout MindSpore's dry run compiles: docs/dryrun.md) and merged back to one whole step. GB/s is
   the step's full bytes over read + cut/merge + write, the compile apart.
Every number is this CPU host's disk and memory: no Ascend device is involved.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from mindscale.config import load_config

REPO = Path(__file__).resolve().parent.parent
SAVE_INTERVAL = 2
SAVES = 3  # interval saves per run
RESHARD_SET = [
    "hardware=ascend910b",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.optimizer_shard=true",
]  # + half the micro batch: the global batch stays
TRAIN_TIMEOUT_S = 900
RESHARD_TIMEOUT_S = 1200


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _run(command: list[str], timeout: float) -> tuple[str | None, str]:
    """(error or None, stdout) of one command run from the repository."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOG_v": "3"}
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s", ""
    if proc.returncode:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return f"exit {proc.returncode}: {lines[-1] if lines else 'no error output'}", proc.stdout
    return None, proc.stdout


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def save_run(config: str, name: str, background: bool, overrides: list[str]) -> dict:
    """One training run with interval saves: the seconds each blocked training and the bytes of a step."""
    shutil.rmtree(REPO / "output" / "bench" / name, ignore_errors=True)
    steps = SAVE_INTERVAL * SAVES + 1
    command = [
        "bash",
        "scripts/run_standalone.sh",
        config,
        "--set",
        f"run.name={name}",
        "--set",
        f"train.steps={steps}",
        "--set",
        f"checkpoint.save_interval={SAVE_INTERVAL}",
        "--set",
        f"checkpoint.async_save={str(background).lower()}",
        "--set",
        "checkpoint.keep_last=1",
        "--set",
        "train.log_interval=1",
        *_sets(overrides),
    ]
    record = {"async": background, "command": shlex.join(command), "run": f"output/bench/{name}"}
    error, _ = _run(command, TRAIN_TIMEOUT_S)
    if error:
        return record | {"error": error}
    run = REPO / record["run"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    blocked = [m["save_blocked_s"] for m in metrics if m["step"] % SAVE_INTERVAL == 1 and m["step"] > 1]
    newest = max((run / "checkpoints").glob("step_*"))
    return record | {
        "blocked_s": blocked,
        "median_blocked_s": statistics.median(blocked),
        "step_bytes": folder_bytes(newest),
        "step_folder": str(newest.relative_to(REPO)),
    }


def reshard_run(source: str, config: str, output: str, overrides: list[str]) -> dict:
    """tools/reshard.py of `source` into `config` + `overrides`: its JSON result plus the command."""
    shutil.rmtree(REPO / output, ignore_errors=True)
    command = [
        sys.executable,
        "tools/reshard.py",
        "--input",
        source,
        "--config",
        config,
        "--output",
        output,
        "--jobs",
        "2",
        "--json",
        *_sets(overrides),
    ]
    record = {"command": shlex.join([Path(sys.executable).name, *command[1:]])}
    error, stdout = _run(command, RESHARD_TIMEOUT_S)
    return record | ({"error": error} if error else json.loads(stdout))


def checkpoint_io(config: str, overrides: list[str], log) -> dict:
    """Phase 5's results: {"saves": [sync, async], "reshard": [cut, merge]} (each entry may hold "error")."""
    out = {"saves": [], "reshard": []}
    for background in (False, True):
        log(f"checkpoint I/O: saves, async_save={str(background).lower()}")
        out["saves"].append(save_run(config, f"ckpt_{'async' if background else 'sync'}", background, overrides))
        log(f"  -> {out['saves'][-1].get('median_blocked_s') or out['saves'][-1].get('error')}")
    sync = out["saves"][0]
    if sync.get("error"):
        return out
    source = sync["step_folder"]
    micro = load_config(REPO / config, overrides).train.micro_batch_size
    into = [*RESHARD_SET, f"train.micro_batch_size={micro // 2}"]
    log("checkpoint I/O: reshard into " + " ".join(into))
    cut = reshard_run(source, config, "output/bench/ckpt_sharded/checkpoints", [*overrides, *into])
    out["reshard"].append(cut | {"into": " ".join(into)})
    if cut.get("error"):
        return out
    log("checkpoint I/O: merge back to one whole step")
    rank_folder = next((REPO / cut["output"]).glob(f"rank_0/{Path(source).name}"))
    merged = reshard_run(str(rank_folder.relative_to(REPO)), config, "output/bench/ckpt_merged/checkpoints", overrides)
    out["reshard"].append(merged | {"into": "whole (the peer config)"})
    return out
