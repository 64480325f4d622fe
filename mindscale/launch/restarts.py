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

With NNODES > 1 the nodes restart together (nodesync.py): each node reports how its attempt ended once
its workers are gone, and a node that wants a restart waits for every node's report; all of them wanting
one, every node relaunches with the scheduler port node 0 chose; otherwise the job ends with the cause of
the first node that did not, or, when a node does not report within MINDSCALE_NODE_TIMEOUT, naming it.
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
from mindscale.launch.nodesync import NodeLost, NodeSync, Report, decide
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


def for_restart(plan: LaunchPlan, port: int) -> LaunchPlan:
    """The next attempt's plan: a fresh scheduler port (the old one may linger in TIME_WAIT) and no
    pinned resume step (from the config file or --set)."""
    overrides = [o for o in plan.overrides if not o.startswith("checkpoint.resume_step=")]
    overrides.append("checkpoint.resume_step=null")
    return dataclasses.replace(plan, overrides=overrides, master_port=port, notes=[])


def agree(nodes: NodeSync, ended: Ended, again: bool) -> tuple[Ended, int | None]:
    """Report this node's end of the attempt and, when it wants a restart, wait for every node's: the
    next scheduler port when all of them want one, else None and the end that stops the job here."""
    port = free_port() if nodes.node == 0 and again else None
    nodes.report(Report(nodes.node, again, failed=ended.code != 0, cause=ended.cause, port=port))
    if not again:
        return ended, None
    try:
        restart, decider = decide(nodes.gather())
    except NodeLost as exc:
        return Ended(1, str(exc), ledger=ended.ledger), None
    if restart:
        return ended, decider.port
    if ended.cause == f"node {decider.node}: {decider.cause}":  # we stopped on that node's failure: said once
        cause = f"{ended.cause} (not restarted there)"
    else:
        why = f"node {decider.node} " + (f"ended: {decider.cause}" if decider.failed else "finished")
        cause = f"{ended.cause}; not restarted: {why}"
    return dataclasses.replace(ended, code=1, cause=cause, restartable=False), None


def run(
    plan: LaunchPlan, attempt: Callable[[LaunchPlan], Ended], stopping: Callable[[], bool], nodes: NodeSync | None
) -> Ended:
    """Run attempts until one ends without a restartable failure, the budget is spent or a graceful stop
    was asked for (`stopping`), on every node when `nodes` syncs several; print the goodput summary.
    Returns the last attempt's end, its cause extended when restarts were given up."""
    began, attempts, restarts = time.time(), [], 0
    while True:
        started = time.time()
        ended = attempt(plan)
        stopped = time.time()
        again = (
            ended.code != 0
            and not ended.interrupted
            and ended.restartable
            and restarts < plan.max_restarts
            and not stopping()
        )
        if nodes is not None:
            ended, port = agree(nodes, ended, again)
            again = port is not None
        else:
            port = free_port() if again else None
        attempts.append(
            goodput.Attempt(
                started,
                stopped,
                ended.ledger,
                failed=ended.code != 0,
                committed=newest_committed_step(plan),
                cause=ended.cause,
            )
        )
        if not again:
            break
        restarts += 1
        kept = archive_logs(plan, restarts)
        step = newest_committed_step(plan)
        where = f" (its log: {kept / ended.log.name})" if ended.log else f" (logs in {kept})"
        everywhere = f" on {plan.node.nnodes} nodes" if nodes else ""
        print(
            f"MindScale: restart {restarts} of {plan.max_restarts}: {ended.cause}{where}; relaunching every "
            f"worker{everywhere} from "
            f"{f'committed step {step}' if step is not None else 'the start (nothing committed)'}",
            flush=True,
        )
        plan = for_restart(plan, port)
        if nodes is not None:
            nodes.generation += 1
    goodput.report(attempts, time.time() - began, plan.run_dir, plan.node.node_rank)
    if ended.restartable and plan.max_restarts and restarts >= plan.max_restarts:
        ended.cause += f"; gave up after {restarts} restart(s) (run.max_restarts={plan.max_restarts})"
        ended.code = 1
    return ended
