"""msrun under watch. msrun alone reports a dead worker only after the scheduler's heartbeat timeout
(about 40 s here) and does not say which rank died; the supervisor polls the workers' exit files
(all ranks': on a shared run folder a peer node's failure is seen too) and, on the first failure,
stops the whole process tree at once and names the log. It also watches the workers' heartbeats
(hangwatch.py: a stalled rank is named, its stacks dumped, the job stopped) and restarts a failed job
up to run.max_restarts times (restarts.py; with NNODES > 1 every node together, nodesync.py). msrun's
output comes through the launcher: all of it into the node's msrun log, to the console less msrun's own
lines and MindSpore's chatter (MsrunConsole).

Signals: Ctrl+C stops the tree at once; the first SIGTERM/SIGUSR1 is a graceful stop (every worker
finishes its step, saves a committed checkpoint and exits 0; the last line says where it saved); a
second signal stops at once (LauncherSignals)."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import psutil

from mindscale.config import UserError
from mindscale.launch import restarts, runlock
from mindscale.launch.hangwatch import HangWatch
from mindscale.launch.msrun import POLL_S, LaunchError, LaunchPlan
from mindscale.launch.nodesync import NODE_TIMEOUT_ENV, NodeSync
from mindscale.launch.restarts import Ended
from mindscale.launch.worker import die_with_parent
from mindscale.train.checkpoints.committed import newest_committed
from mindscale.train.resilience.heartbeat import diverged_file
from mindscale.train.resilience.stop import GRACEFUL


class Interrupted(Exception):
    """Ctrl+C, or a second stop signal, reached the launcher: stop the job at once."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class LauncherSignals:
    """The launcher's handlers. SIGINT (Ctrl+C) stops the whole tree at once, as does any signal after
    a graceful one. The first SIGTERM/SIGUSR1 (a scheduler's preemption, scancel) is a graceful stop:
    the poll loop forwards it to every worker, which finishes its step, saves and exits 0."""

    def __init__(self):
        self.graceful: int | None = None

    def install(self) -> "LauncherSignals":
        for sig in (signal.SIGINT, *GRACEFUL):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, _frame):
        if signum == signal.SIGINT or self.graceful is not None:
            raise Interrupted(signum)
        self.graceful = signum

    def _kept(self, signum, _frame):
        if self.graceful is None:
            self.graceful = signum

    @contextmanager
    def deferred(self):
        """While a tree is stopped: no signal cuts the teardown short, but the first one (Ctrl+C too) is
        kept in `graceful`, so a failed attempt ends the job instead of being restarted (restarts.run's
        `stopping`). The handlers are restored afterwards, for the next attempt."""
        previous = {sig: signal.signal(sig, self._kept) for sig in (signal.SIGINT, *GRACEFUL)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def ask_workers_to_stop(proc: subprocess.Popen, signum: int, asked: set[int]) -> None:
    """Send `signum` to each worker's wrapper under msrun (not to the scheduler) not `asked` yet, and add
    it there; the wrapper forwards it. Called on every poll once a stop is requested: msrun may still
    be starting its workers."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            if p.pid not in asked and "mindscale.launch" in p.cmdline() and p.environ().get("MS_ROLE") == "MS_WORKER":
                p.send_signal(signum)
                asked.add(p.pid)
        except psutil.Error:
            pass


def start_msrun(plan: LaunchPlan, env: dict) -> subprocess.Popen:
    """msrun, dying with us, and deaf to the graceful signals: it has no handler of its own, and their
    default action (a scheduler signals the whole process group) would kill every worker mid-step. Its
    output (its own lines and the worker logs it follows) comes to us through a pipe (MsrunConsole)."""

    def prepare():
        die_with_parent()
        for sig in GRACEFUL:
            signal.signal(sig, signal.SIG_IGN)

    return subprocess.Popen(
        plan.msrun_argv(),
        env=env,
        preexec_fn=prepare,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )


MINDSPORE_CHATTER = re.compile(r"^\[(INFO|WARNING)\] ")  # printed at exit whatever GLOG_v says
# msrun's own lines: one per process it starts, with the whole command line (400 characters and more),
# and its logger's (an exit status it saw, which the launcher's last line names better)
MSRUN_OWN = re.compile(r"^Start (scheduler|worker) process|^\[[A-Z]+\] ME\(.*\[mindspore/parallel/cluster/")
CONSOLE_DRAIN_S = 5.0


class MsrunConsole:
    """msrun's output, line by line: all of it into the node's msrun log (LaunchPlan.msrun_log), and to our
    console what a reader follows: the worker logs msrun tails, less msrun's own lines and MindSpore's
    INFO/WARNING chatter (those stay in the log files: msrun's here, the chatter in the worker logs)."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.thread = threading.Thread(target=self._relay, args=(proc.stdout, log), daemon=True)
        self.thread.start()

    @staticmethod
    def _relay(stream, log: Path) -> None:
        shown = True
        with open(log, "w") as kept:
            for line in stream:  # to the end: msrun must never block on a full pipe
                kept.write(line)
                kept.flush()
                if shown and not (MSRUN_OWN.match(line) or MINDSPORE_CHATTER.match(line)):
                    try:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                    except OSError:  # our console is gone (a closed pipe): the log keeps everything
                        shown = False

    def close(self) -> None:
        """Once msrun is gone: the lines still in the pipe are shown before the launcher's last line."""
        self.thread.join(CONSOLE_DRAIN_S)


def exit_files(log_dir: Path) -> dict[Path, int]:
    """Exit-status files present now, with their modification times."""
    found = {}
    for path in log_dir.glob("*.exit"):
        try:
            found[path] = path.stat().st_mtime_ns
        except FileNotFoundError:
            pass
    return found


def first_failure(plan: LaunchPlan, stale: dict[Path, int]) -> tuple[Path, int] | None:
    """(log file, exit code) of the earliest non-zero exit of any rank or the scheduler. Other
    nodes' files count too when the run folder is shared, so a peer node's dead worker stops this
    node at once; files left by an earlier launch (`stale`, unchanged since we started) do not."""
    candidates = [(plan.log_dir / f"worker_{r}.exit", plan.worker_log(r)) for r in range(plan.world)]
    candidates.append((plan.log_dir / "scheduler.exit", plan.log_dir / "scheduler.log"))
    failed = []
    for status, log in candidates:
        try:
            mtime = status.stat().st_mtime_ns
            code = int(status.read_text())
        except (FileNotFoundError, ValueError):
            continue
        if code and stale.get(status) != mtime:
            failed.append((mtime, log, code))
    return min(failed)[1:] if failed else None


def stop_tree(proc: subprocess.Popen, signals: LauncherSignals) -> None:
    """kill_tree, uninterruptible: a second Ctrl+C must not cut it short (LauncherSignals.deferred)."""
    with signals.deferred():
        kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill msrun and every process under it (workers run in their own sessions, so a process
    group kill would miss them). msrun is frozen first so it cannot start anything new."""
    try:
        root = psutil.Process(proc.pid)
        root.suspend()
        tree = root.children(recursive=True)
        root.kill()
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=5)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def show_tail(log: Path, lines_shown: int = 10) -> None:
    """The end of a process's log (its error, or a stack dump) on stderr."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    tail = [line for line in lines if not MINDSPORE_CHATTER.match(line)][-lines_shown:]
    if tail:
        print(f"--- last lines of {log} ---", *tail, "---", sep="\n", file=sys.stderr)


def report_failure(log: Path, code: int, ledger: dict | None) -> Ended:
    """Show the end of the failed process's log; the end names it. Not retried: bad input (exit 2), and a
    health guard's stop (exit 1 with its cause in the rank's .diverged file): both would fail again."""
    rank = None if log.stem == "scheduler" else int(log.stem.split("_")[-1])
    name = "the scheduler" if rank is None else f"rank {rank}"
    show_tail(log)
    diverged = diverged_file(log.parent, rank) if code == 1 and rank is not None else None
    if diverged is not None and diverged.is_file():
        return Ended(
            1,
            f"{name} stopped by a health guard, not restarted: {diverged.read_text().strip()}",
            ledger=ledger,
            log=log,
        )
    return Ended(2 if code == 2 else 1, f"{name} {describe_exit(code)}", restartable=code != 2, ledger=ledger, log=log)


def report_stall(plan: LaunchPlan, watch: HangWatch, stall, msrun_pid: int, stop: Callable[[], None]) -> Ended:
    """A stalled rank: its stacks into its log (faulthandler), the tree stopped, the dump shown."""
    dumped = watch.dump_stacks(stall, msrun_pid)
    ledger = watch.beats().get(plan.first_rank)
    stop()
    for rank in dumped:
        show_tail(plan.worker_log(rank), lines_shown=30)
    where = (
        f"; its Python stacks are in {plan.worker_log(dumped[0])}"
        if len(dumped) == 1
        else f"; Python stacks of ranks {', '.join(map(str, dumped))} are in their logs"
        if dumped
        else ""
    )
    return Ended(1, stall.describe() + where, restartable=True, ledger=ledger)


def supervise(plan: LaunchPlan, env: dict) -> int:
    """Run the job under node 0's run-folder lock (refused, exit 2, before anything is written when
    another live job holds it), restarting it up to run.max_restarts times (restarts.py); the other
    nodes' launchers write into the run under that lock."""
    signals = LauncherSignals().install()
    with runlock.hold(plan.run_dir, plan.node.node_rank == 0):
        nodes = None
        try:
            nodes = join_nodes(plan) if plan.max_restarts and plan.node.nnodes > 1 else None
            ended = restarts.run(
                plan,
                lambda attempt: _supervise(attempt, env, signals, nodes),
                stopping=lambda: signals.graceful is not None,
                nodes=nodes,
            )
        except Interrupted as exc:  # before the first attempt (the nodes' join) or between two: nothing runs
            ended = Ended(
                128 + exc.signum,
                f"{signal.Signals(exc.signum).name}: stopped while no worker ran; logs in {plan.log_dir}",
                interrupted=True,
            )
        finally:
            if nodes is not None:
                nodes.stop_beating()
    if ended.code == 0:
        report_success(plan, ended.stopped_by, ended.ledger)
    elif ended.interrupted:
        print(ended.cause, file=sys.stderr)
    else:
        print(f"error: {ended.cause}" + (f"; see {ended.log}" if ended.log else ""), file=sys.stderr)
    return ended.code


def join_nodes(plan: LaunchPlan) -> NodeSync:
    """Restarts across nodes (nodesync.py): beat in the shared run folder and wait, as long as msrun would
    wait for a node (--cluster_time_out), until every other node's launcher beats there too. One that
    never does is refused (exit 2) before anything starts: the run folder is not shared with it, or it
    never started."""
    nodes = NodeSync(plan.log_dir, plan.node.nnodes, plan.node.node_rank, plan.node_timeout_s)
    nodes.start_beating()
    try:
        missing = nodes.join(plan.cluster_timeout)
    except Interrupted:
        nodes.stop_beating()
        raise
    if missing:
        nodes.stop_beating()
        raise LaunchError(
            f"run.max_restarts={plan.max_restarts} with NNODES={plan.node.nnodes}: no sign of node {missing[0]}'s "
            f"launcher in {nodes.folder} within {plan.cluster_timeout} s; put run.output_dir on a file system every "
            "node shares (and start every node), or set run.max_restarts=0"
        )
    return nodes


def _supervise(plan: LaunchPlan, env: dict, signals: LauncherSignals, nodes: NodeSync | None) -> Ended:
    """One msrun: until it ends, a worker fails, a rank stalls (run.hang_timeout_s), or, when `nodes`
    syncs restarts across nodes, another node's attempt failed or its launcher fell silent."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    for rank in plan.local_ranks:
        (plan.log_dir / f"worker_{rank}.exit").unlink(missing_ok=True)
        diverged_file(plan.log_dir, rank).unlink(missing_ok=True)
    if plan.node.node_rank == 0:
        (plan.log_dir / "scheduler.exit").unlink(missing_ok=True)
    stale = exit_files(plan.log_dir)
    for note in plan.notes:
        print(f"note: {note}", flush=True)
    print(start_line(plan), flush=True)
    watch = HangWatch(plan.log_dir, plan.world, plan.local_ranks, plan.hang_timeout_s)
    proc = start_msrun(plan, env)
    console = MsrunConsole(proc, plan.msrun_log)

    def stop() -> None:  # the tree, then the lines it left in the pipe, before the launcher's own
        stop_tree(proc, signals)
        console.close()

    forwarded, asked = None, set()
    try:
        while True:
            if signals.graceful is not None:
                if forwarded is None:
                    forwarded = signal.Signals(signals.graceful).name
                    print(
                        f"MindScale: {forwarded}: every worker finishes its step, saves a checkpoint and exits "
                        "(signal again or Ctrl+C to stop at once)",
                        flush=True,
                    )
                ask_workers_to_stop(proc, signals.graceful, asked)
            failure = first_failure(plan, stale)
            if failure:
                ledger = watch.beats().get(plan.first_rank)
                stop()
                return report_failure(*failure, ledger)
            stall = watch.stalled() if forwarded is None else None
            if stall:
                return report_stall(plan, watch, stall, proc.pid, stop)
            peer = watch_peers(nodes) if nodes is not None else None
            if peer:
                ledger = watch.beats().get(plan.first_rank)
                stop()
                return dataclasses.replace(peer, ledger=ledger)
            code = proc.poll()
            if code is not None:
                console.close()
                ledger = watch.beats().get(plan.first_rank)
                failure = first_failure(plan, stale)
                if failure:
                    return report_failure(*failure, ledger)
                if code:
                    return Ended(
                        1,
                        f"msrun exited with code {code} and no worker reported a failure; see {plan.log_dir}",
                        restartable=True,
                        ledger=ledger,
                    )
                return Ended(0, stopped_by=forwarded, ledger=ledger)
            time.sleep(POLL_S)
    except Interrupted as exc:
        stop()
        return Ended(
            128 + exc.signum,
            f"{signal.Signals(exc.signum).name}: stopped all workers; logs in {plan.log_dir}",
            interrupted=True,
        )


def watch_peers(nodes: NodeSync) -> Ended | None:
    """The end of this node's attempt that another node calls for: its attempt failed (restartable: the
    nodes decide together, restarts.agree), or its launcher has been silent past the timeout (the job
    ends, naming it, for the scheduler to requeue)."""
    failed = nodes.failed_peer()
    if failed is not None:
        return Ended(1, f"node {failed.node}: {failed.cause}", restartable=True)
    silent = nodes.silent_peer()
    if silent is not None:
        return Ended(
            1,
            f"node {silent}'s launcher went silent: no sign of it in {nodes.folder} for {nodes.timeout_s:g} s "
            f"({NODE_TIMEOUT_ENV}); ending the job so the scheduler can requeue it",
        )
    return None


def start_line(plan: LaunchPlan) -> str:
    """What runs where, where the logs are, and which of them the console follows."""
    which = "rank 0" if plan.first_rank == 0 else f"rank {plan.first_rank} (first on this node)"
    line = (
        f"MindScale: {plan.world} worker(s) on {plan.node.nnodes} node(s), {plan.local_workers} here ({plan.device}); "
        f"logs in {plan.log_dir} (msrun's output: {plan.msrun_log.name}); following the {which} log "
        f"{plan.worker_log(plan.first_rank)}"
    )
    if plan.step_rank not in plan.local_ranks:
        node = plan.step_rank // plan.local_workers
        line += f"; the step lines are in the rank {plan.step_rank} log, on node {node}'s console"
    elif plan.step_rank != plan.first_rank:  # the last pipeline stage's first rank, tailed too
        line += f" and the rank {plan.step_rank} log {plan.worker_log(plan.step_rank)} (the step lines)"
    return line


def report_success(plan: LaunchPlan, stopped_by: str | None, ledger: dict | None) -> None:
    """The last line of a job that ended well: how, and where its newest committed checkpoint is. A
    graceful stop asked elsewhere (a signal to a worker, or to another node's launcher) shows in the
    first local rank's last heartbeat: fewer steps done than train.steps."""
    done = (ledger or {}).get("step")
    if stopped_by:
        how = f"stopped on {stopped_by}"
    elif done is not None and done < plan.train_steps:
        how = (
            f"stopped gracefully after step {done} of {plan.train_steps} (asked by a signal to a worker or to "
            "another node's launcher)"
        )
    else:
        how = "finished"
    try:
        saved = newest_committed(plan.run_dir / "checkpoints")
    except UserError as exc:
        saved = f"none readable ({exc})"
    where = f"; newest committed checkpoint: {saved}" if saved else ""
    print(
        f"MindScale: all {plan.local_workers} worker(s) on this node {how}{where}; logs in {plan.log_dir}", flush=True
    )
