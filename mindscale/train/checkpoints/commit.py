"""The run-level commit: a step counts as saved only when every rank has written its part.

Each writing rank commits its own folder atomically (mindscale/train/checkpoints/folder.py): rank 0's
`checkpoints/step_X/` in a data-parallel run, every rank's `checkpoints/rank_<r>/step_X/` in a
sharded one. Then, per save:

  1. every rank reaches a barrier (its part is on disk, or it writes nothing);
  2. rank 0 adds the step to `checkpoints/COMMITTED` (written atomically), keeping the newest
     `checkpoint.keep_last` committed steps and, beyond them, the newest healthy one (the ranks' vote
     at the barrier says whether every rank saved this step healthy), so that a run which keeps
     saving while unhealthy can still go back to its last healthy step;
  3. after a second barrier every writing rank removes its folders of steps no longer listed.

A rank that dies before the first barrier leaves its step uncommitted, whatever the other ranks
wrote, and no rank prunes an older step for it. On resume every rank checks its own folder of the
newest committed step (checksums included) and the ranks vote: the step is taken only if every rank
can read its part, else the next older committed step is tried, each unusable folder named on one
line. Among the readable steps the newest healthy one is taken (state.json "healthy",
mindscale/train/resilience/health.py SaveWindow), a newer unhealthy one passed over on one line; with none
healthy, the newest readable. `checkpoint.resume_step` asks for one step and refuses instead of falling back. When no
committed step is readable by every rank the resume refuses rather than starting over. The run
folder must be on storage every node shares (rank 0 writes the record the others read). Runs saved
before this file existed have no COMMITTED record: rank 0's complete folders are the candidates, and
the vote still makes every rank agree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor, nn, ops

from mindscale.io import MARKER, CheckpointError, verify_folder
from mindscale.train.checkpoints.folder import STATE, checkpoint_step, complete_checkpoints, reshard_refusal
from mindscale.train.resilience.health import describe_health
from mindscale.train.checkpoints.committed import (
    COMMITTED,
    committed_steps,
    record_steps,
    step_dir_name,
    unhealthy_steps,
)

__all__ = ["COMMITTED", "RankVote", "commit", "committed_steps", "record_steps", "resume_point"]


class _SumCell(nn.Cell):
    def __init__(self):
        super().__init__()
        self.all_reduce = ops.AllReduce()

    def construct(self, x):
        return self.all_reduce(x)


class RankVote:
    """The sum over all ranks of a small float vector; with one process, the vector itself. Used as a
    barrier and to agree on which checkpoint every rank can read.

    A data-parallel run sums with a one-op graph (on CPU MindSpore has no eager collectives: measured,
    "Create kernelmod for op InnerCommAllReduce failed"). A sharded run cannot: a semi-auto-parallel
    graph may hold no communication op (the dry run refuses it), so it sums with MindSpore's eager
    `communication.comm_func.all_reduce`, which MindFormers' barrier uses on Ascend. That path has
    not run here (no Ascend)."""

    def __init__(self, world: int, sharded: bool):
        self.world = world
        self._sum = None
        if world > 1:
            from mindspore.communication import comm_func

            self._sum = (lambda x: comm_func.all_reduce(x, op="sum")) if sharded else _SumCell()

    def count(self, *flags: bool | int) -> list[int]:
        """How many ranks raised each flag (the sum over ranks of each value: small integers stay exact)."""
        votes = Tensor(np.array([float(f) for f in flags], np.float32))
        if self._sum is not None:
            votes = self._sum(votes)
            votes = votes[0] if isinstance(votes, tuple) else votes  # comm_func may add a handle
        return [int(round(v)) for v in votes.asnumpy()]

    def barrier(self) -> None:
        self.count(True)


def _fault_point(root: Path, step: int, rank: int, world: int) -> None:
    """Fault injection for the crash-safety tests: MINDSCALE_FAULT=checkpoint_commit:STEP[@RANK] makes that rank
    (every rank without @RANK) SIGKILL itself after every writing rank's part of STEP is on disk, before the
    commit. (A rank that writes nothing gets here at once: killed then, the launcher would stop rank 0 in the
    middle of its write, and the step would not be the complete-but-uncommitted one the tests need.)"""
    wanted = os.environ.get("MINDSCALE_FAULT", "")
    if wanted not in (f"checkpoint_commit:{step}", f"checkpoint_commit:{step}@{rank}"):
        return
    name = step_dir_name(step)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        (root / name / MARKER).is_file() or all((root / f"rank_{r}" / name / MARKER).is_file() for r in range(world))
    ):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def commit(
    root: Path, own_dir: Path | None, step: int, vote: RankVote, rank: int, keep_last: int, healthy: bool = True
) -> None:
    """Steps 1-3 above, called by every rank after writing its part of `step` into `own_dir` (None:
    this rank writes nothing, as the data-parallel ranks besides 0); `healthy`: this rank's part was
    saved healthy (state.json)."""
    _fault_point(Path(root), step, rank, vote.world)
    all_healthy = vote.count(healthy)[0] == vote.world  # also the barrier
    if rank == 0:
        unhealthy = {s for s in unhealthy_steps(root) if s < step} | (set() if all_healthy else {step})
        steps = [s for s in committed_steps(root) or [] if s < step] + [step]
        kept = steps[-keep_last:] if keep_last else steps
        last_healthy = [s for s in steps if s not in unhealthy][-1:]
        record_steps(root, sorted(set(kept) | set(last_healthy)), unhealthy)
    vote.barrier()
    recorded = committed_steps(root)
    if own_dir is None or not recorded or step not in recorded:
        return  # this rank does not see the record (not a shared folder): it prunes nothing
    kept = {step_dir_name(s) for s in recorded}
    for folder in Path(own_dir).glob("step_*"):
        if folder.is_dir() and folder.name not in kept:
            shutil.rmtree(folder, ignore_errors=True)


def _readable(folder: Path) -> str | None:
    """Why this rank cannot resume from `folder`, or None when it can (checksums verified)."""
    try:
        verify_folder(folder, deep=True)
    except CheckpointError as exc:
        return str(exc)
    return None


def _written_under_another_layout(root: Path, own_dir: Path, steps: list[int], layout: dict | None) -> None:
    """Refuse (naming tools/reshard.py) when the newest of `steps` is no folder of this rank's but was
    written in the other form: a sharded run's rank_<r>/step_X where this run is unsharded and reads
    step_X, or the reverse. `layout`: this run's layout record (folder.layout_record), None if not known."""
    name = step_dir_name(steps[-1])
    if (Path(own_dir) / name).is_dir():
        return
    unsharded = Path(own_dir) == Path(root)
    other = next(iter(sorted(Path(root).glob(f"rank_*/{name}"))), None) if unsharded else Path(root) / name
    if other is not None and (other / MARKER).is_file():
        raise reshard_refusal(
            other, json.loads((other / STATE).read_text()).get("layout", {}), {} if unsharded else layout
        )


def resume_point(
    root: Path, own_dir: Path, vote: RankVote, rank: int, wanted: int | None, say=print, layout: dict | None = None
) -> Path | None:
    """The folder this rank resumes from: its part of the newest committed step every rank can read
    (or of step `wanted`), agreed by vote; None when there is nothing to resume. Every rank calls it.
    `layout`: this run's layout record, for the refusal of a step written under another one."""
    recorded = committed_steps(root)
    if recorded is None:  # an older run: rank 0's complete folders, the same list on every rank
        first = root if Path(own_dir) == Path(root) else Path(root) / "rank_0"
        steps = [checkpoint_step(p) for p in complete_checkpoints(first)]
    else:
        steps = recorded
    if wanted is not None:
        if wanted not in steps:
            raise CheckpointError(
                f"checkpoint.resume_step={wanted} is not a committed step of {root} "
                f"(committed: {steps or 'none'}); pick one of them"
            )
        steps = [wanted]
    if steps:
        _written_under_another_layout(root, own_dir, steps, layout)
    unhealthy = []  # (step, folder, health) readable by every rank, newest first
    for step in reversed(steps):
        folder = Path(own_dir) / step_dir_name(step)
        problem = _readable(folder)
        health = _health(folder) if problem is None else None
        readable, healthy = vote.count(problem is None, health is None)
        if readable == vote.world:
            if wanted is not None or healthy == vote.world:
                if unhealthy and rank == 0:
                    newer, _, why = unhealthy[0]
                    say(
                        f"checkpoint: passing over unhealthy step {newer} ({describe_health(why)}); resuming "
                        f"from healthy step {step}; the later steps leave the run's history (their folders are removed "
                        "at the next save)"
                    )
                return _take(root, recorded, rank, step, folder)
            unhealthy.append((step, folder, health or {}))
            continue
        if wanted is not None:
            raise CheckpointError(
                f"checkpoint.resume_step={wanted}: {problem or 'another rank cannot read its part'}; "
                "pick another committed step"
            )
        if problem:
            say(f"checkpoint: skipping {folder} ({problem}); trying the previous committed step")
        elif rank == 0:
            say(
                f"checkpoint: skipping step {step}: {vote.world - readable} of {vote.world} ranks cannot read their "
                "part (see their logs); trying the previous committed step"
            )
    if unhealthy:
        step, folder, why = unhealthy[0]
        if rank == 0:
            say(f"checkpoint: no healthy committed step; resuming from unhealthy step {step} ({describe_health(why)})")
        return _take(root, recorded, rank, step, folder)
    if steps:
        raise CheckpointError(
            f"no committed step of {root} ({steps}) can be read by every rank (the ranks' logs name "
            "what they cannot read): the run folder must be on storage all nodes share; to train "
            "from scratch instead, name a new run.name and keep these steps"
        )
    return None


def _health(folder: Path) -> dict | None:
    """None when the step was saved healthy (or before saves recorded it), else its state.json "health"."""
    state = json.loads((folder / STATE).read_text())
    return None if state.get("healthy", True) else state.get("health", {})


def _take(root: Path, recorded: list[int] | None, rank: int, step: int, folder: Path) -> Path:
    """Resume from `step`: later steps leave the run's history (rank 0 rewrites the record)."""
    if rank == 0 and recorded is not None and recorded[-1] != step:
        record_steps(root, [s for s in recorded if s <= step], unhealthy_steps(root))
    return folder
