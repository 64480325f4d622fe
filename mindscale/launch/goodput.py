"""The goodput summary a launch ends with: where the job's wall time went, restarts included.

From the launcher's clock (each attempt's start and end) and, per attempt, the heartbeat ledger of
this node's first rank (mindscale/train/resilience/heartbeat.py), the wall time is split into buckets that add
up to it exactly:

    start-up     attempt start -> the rank's first heartbeat (imports, cluster join, graph build,
                 checkpoint read), less the step's compile
    compile      the step's compile (before the first heartbeat in graph mode) and the first step
                 less one mean step (PyNative's first-call cost; in graph mode the wait for slower peers)
    cache load   the same for an attempt whose step loaded MindSpore's compile cache instead of
                 compiling (mindscale/train/loop/compile_cache.py)
    checkpoints  seconds checkpoint saves blocked training
    lost         the steps a failed attempt completed after the checkpoint the next attempt resumed
                 from (or, for the last attempt, after the newest committed step), at that attempt's
                 mean step time: work done twice
    training     every other step second: work kept
    other        the rest: teardown, the final save's process exit, the launcher's own restarts

goodput = training / wall. Printed as one line and written to `<run>/goodput.json` by node 0 and to
`<run>/goodput_node_<k>.json` by node k > 0 (with NNODES > 1 each node's launcher keeps its own clock and
ledger). Its `attempts` list each attempt: its cause, the steps and seconds it lost, and `restart_s`,
the seconds from its end (its workers stopped) to the next attempt's first completed step: the
teardown, the nodes agreeing (nodesync.py), start-up, the compile or cache load and that step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mindscale.io import write_atomically
from mindscale.progress import clock

GOODPUT_FILE = "goodput.json"
BUCKETS = dict(
    startup_s=0.0, compile_s=0.0, cache_load_s=0.0, checkpoint_s=0.0, lost_s=0.0, training_s=0.0, lost_steps=0
)


@dataclass
class Attempt:
    began: float
    ended: float
    ledger: dict | None  # the first local rank's last heartbeat of this attempt, None without one
    failed: bool
    committed: int | None  # newest committed step when it ended
    cause: str | None = None  # why it failed (restarted or not)


def _split(attempt: Attempt, resumed_next: int | None) -> dict:
    """One attempt's seconds by bucket (without `other`) and its lost steps."""
    out = dict(BUCKETS)
    ledger = attempt.ledger
    if not ledger:
        return out
    before_first = max(ledger["started"] - attempt.began, 0.0)
    compiled = min(ledger["compile_s"], before_first)
    out["startup_s"] = before_first - compiled
    out["checkpoint_s"] = ledger["save_s"]
    once = "cache_load_s" if ledger["compile_cache"] == "hit" else "compile_s"
    out[once] = compiled
    first = ledger["first_step_s"]
    if first is None:
        return out
    mean = ledger["steps_s"] / ledger["steps"] if ledger["steps"] else first
    out[once] += max(first - mean, 0.0)
    stepped = min(first, mean) + ledger["steps_s"]
    if attempt.failed:
        kept = resumed_next if resumed_next is not None else (attempt.committed or 0)
        out["lost_steps"] = max(ledger["step"] - kept, 0)
        out["lost_s"] = min(out["lost_steps"] * mean, stepped)
    out["training_s"] = stepped - out["lost_s"]
    return out


def back_to_training(attempt: Attempt, nxt: dict | None) -> float | None:
    """Seconds from a failed attempt's end to the next one's first completed step (None: none completed)."""
    if not nxt or nxt["first_step_s"] is None:
        return None
    return nxt["started"] + nxt["first_step_s"] - attempt.ended


def summarise(attempts: list[Attempt], wall_s: float) -> dict:
    """The buckets over all attempts, `other` making them add up to `wall_s`, and each attempt's own."""
    total, each = dict(BUCKETS), []
    for i, attempt in enumerate(attempts):
        nxt = attempts[i + 1].ledger if i + 1 < len(attempts) else None
        split = _split(attempt, nxt["first_step"] if nxt else None)
        for key, value in split.items():
            total[key] += value
        each.append(
            {
                "cause": attempt.cause,
                "seconds": attempt.ended - attempt.began,
                "lost_steps": split["lost_steps"],
                "lost_s": split["lost_s"],
                "restart_s": back_to_training(attempt, nxt) if i + 1 < len(attempts) else None,
            }
        )
    total["other_s"] = wall_s - sum(v for k, v in total.items() if k.endswith("_s"))
    return {
        "wall_s": wall_s,
        **total,
        "goodput": total["training_s"] / wall_s if wall_s > 0 else 0.0,
        "restarts": [a.cause for a in attempts[:-1]],
        "compile_cache": [a.ledger["compile_cache"] if a.ledger else None for a in attempts],
        "attempts": each,
    }


def describe(summary: dict) -> str:
    restarts = summary["restarts"]
    why = f": {'; '.join(restarts)}" if restarts else ""
    return (
        f"MindScale goodput: {summary['goodput'] * 100:.0f}% of {clock(summary['wall_s'])} wall time trained "
        f"({summary['training_s']:.1f} s); compile {summary['compile_s']:.1f} s, compile cache load "
        f"{summary['cache_load_s']:.1f} s, checkpoints "
        f"{summary['checkpoint_s']:.1f} s, start-up {summary['startup_s']:.1f} s, lost {summary['lost_steps']} "
        f"step(s) after their last save {summary['lost_s']:.1f} s, other {summary['other_s']:.1f} s; "
        f"{len(restarts)} restart(s){why}"
    )


def goodput_file(run_dir: Path, node: int) -> Path:
    return Path(run_dir) / (GOODPUT_FILE if node == 0 else f"goodput_node_{node}.json")


def report(attempts: list[Attempt], wall_s: float, run_dir: Path, node: int) -> dict | None:
    """Print the summary (when a worker kept a ledger) and write it to this node's goodput file."""
    if not any(a.ledger for a in attempts):
        return None
    summary = summarise(attempts, wall_s)
    print(describe(summary), flush=True)
    write_atomically(goodput_file(run_dir, node), json.dumps(summary, indent=1) + "\n")
    return summary
