"""The checkpoints folder's names and its record of committed steps, without MindSpore: the trainer
writes them (mindscale/train/checkpoints/commit.py has the protocol), the resharder too, and the launcher reads
them to say where a run saved.

`<run>/checkpoints/step_XXXXXXXX/` (a sharded run: `checkpoints/rank_<r>/step_XXXXXXXX/`), and
`checkpoints/COMMITTED`, `{"steps": [...], "unhealthy": [...]}`: the steps every rank has written,
oldest first, and those of them some rank saved unhealthy (mindscale/train/resilience/health.py SaveWindow).
"""

from __future__ import annotations

import json
from pathlib import Path

from mindscale.io import CheckpointError, write_atomically

COMMITTED = "COMMITTED"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def committed_steps(root: Path) -> list[int] | None:
    """The committed steps recorded under `root` (the run's checkpoints folder), oldest first; None
    when the run has no record (saved before run-level commits existed)."""
    record = Path(root) / COMMITTED
    if not record.is_file():
        return None
    try:
        return sorted(json.loads(record.read_text())["steps"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{record} is corrupt; delete it to resume from the newest complete folders")


def unhealthy_steps(root: Path) -> set[int]:
    """The committed steps recorded as saved unhealthy (none in records written before the flag)."""
    record = Path(root) / COMMITTED
    return set(json.loads(record.read_text()).get("unhealthy", [])) if committed_steps(root) else set()


def record_steps(root: Path, steps: list[int], unhealthy=()) -> None:
    """Rank 0 only: the committed steps and which of them are unhealthy, replaced atomically."""
    record = {"steps": sorted(steps), "unhealthy": sorted(set(unhealthy) & set(steps))}
    write_atomically(Path(root) / COMMITTED, json.dumps(record) + "\n")


def newest_committed(root: Path) -> str | None:
    """Where the newest committed step lives, for people: its folder, or `rank_*/step_X` when every
    rank holds a part; None when nothing is committed."""
    steps = committed_steps(root)
    if not steps:
        return None
    name = step_dir_name(steps[-1])
    return str(Path(root) / name) if (Path(root) / name).is_dir() else str(Path(root) / "rank_*" / name)
