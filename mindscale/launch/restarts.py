"""Restarts (run.max_restarts, --max-restarts N): a job whose worker failed or stalled (hangwatch.py)
is relaunched, every local worker, by a new msrun after the old tree is gone; the launcher keeps the
run-folder lock throughout. The workers resume from the newest committed checkpoint as any rerun does (preferring a
healthy one, mindscale/train/checkpoints/commit.py); a `checkpoint.resume_step` of the first launch is dropped, or
every restart would go back to it.

Not restarted: success, a graceful stop, Ctrl+C, a worker's exit status 2 (bad input: a restart
would fail the same way) and a health guard's stop (exit 1 with a .diverged file: the same checkpoint
would diverge again; supervisor.report_failure). Each restart is said on one line with its cause;
the failed attempt's logs move to `<logs>/attempt_<k>/` (msrun truncates the log files it opens).
After max_restarts the job gives up with exit 1, naming the last cause.

One node only: the other nodes' launchers cannot learn that node 0 restarted, so a restart with
NNODES > 1 is refused before anything starts (msrun.py); requeue the whole job with the scheduler.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mindscale.config import UserError
from mindscale.launch import goodput
from mindscale.launch.msrun import LaunchPlan, free_port
from mindscale.train.checkpoints.committed import committed_steps


@dataclass
class Ended:
    """How one msrun attempt ended."""

    code: int  # the launcher's exit status if it is the last attempt
    cause: str | None = None  # what failed, one line without its log (None: success)
    restartable: bool = False
    stopped_by: str | None = None  # a graceful stop's signal name
    interrupted: bool = False  # Ctrl+C or a second signal: `cause` is the whole last line
    ledger: dict | None = None  # the first local rank's last heartbeat (goodput)
    log: Path | None = None  # the failed process's log


def newest_committed_step(plan: LaunchPlan) -> int | None:
    try:
        steps = committed_steps(plan.run_dir / "checkpoints")
    except UserError:
        return None
    return steps[-1] if steps else None


def archive_logs(plan: LaunchPlan, attempt: int) -> Path:
    """Move this node's logs of a failed attempt to `<logs>/attempt_<k>/`, before msrun reopens them."""
    kept = plan.log_dir / f"attempt_{attempt}"
    kept.mkdir(exist_ok=True)
    names = [plan.worker_log(r).name for r in plan.local_ranks] + [plan.msrun_log.name]
    if plan.node.node_rank == 0:
        names.append("scheduler.log")
    for name in names:
        if (plan.log_dir / name).is_file():
            shutil.move(plan.log_dir / name, kept / name)
    return kept


def for_restart(plan: LaunchPlan) -> LaunchPlan:
    """The next attempt's plan: a fresh scheduler port (the old one may linger in TIME_WAIT) and no
    pinned resume step (from the config file or --set)."""
    overrides = [o for o in plan.overrides if not o.startswith("checkpoint.resume_step=")]
    overrides.append("checkpoint.resume_step=null")
    port = plan.master_port if plan.node.nnodes > 1 else free_port()
    return dataclasses.replace(plan, overrides=overrides, master_port=port, notes=[])


def run(plan: LaunchPlan, attempt: Callable[[LaunchPlan], Ended], stopping: Callable[[], bool]) -> Ended:
    """Run attempts until one ends without a restartable failure, the budget is spent or a graceful stop
    was asked for (`stopping`); print the goodput summary. Returns the last attempt's end, its cause
    extended when restarts were given up."""
    began, attempts, restarts = time.time(), [], 0
    while True:
        started = time.time()
        ended = attempt(plan)
        attempts.append(
            goodput.Attempt(
                started,
                time.time(),
                ended.ledger,
                failed=ended.code != 0,
                committed=newest_committed_step(plan),
                cause=ended.cause,
            )
        )
        if ended.code == 0 or ended.interrupted or not ended.restartable or restarts >= plan.max_restarts or stopping():
            break
        restarts += 1
        kept = archive_logs(plan, restarts)
        step = newest_committed_step(plan)
        where = f" (its log: {kept / ended.log.name})" if ended.log else f" (logs in {kept})"
        print(
            f"MindScale: restart {restarts} of {plan.max_restarts}: {ended.cause}{where}; relaunching every "
            f"worker from {f'committed step {step}' if step is not None else 'the start (nothing committed)'}",
            flush=True,
        )
        plan = for_restart(plan)
    goodput.report(attempts, time.time() - began, plan.run_dir, plan.node.node_rank == 0)
    if ended.restartable and plan.max_restarts and restarts >= plan.max_restarts:
        ended.cause += f"; gave up after {restarts} restart(s) (run.max_restarts={plan.max_restarts})"
        ended.code = 1
    return ended
