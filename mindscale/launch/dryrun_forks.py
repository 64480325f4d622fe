"""The process the ranks of dry runs are forked from (mindscale.launch.dryrun_ranks starts it and keeps it).

It imports MindSpore, the training graph's modules and the worker module once, then forks one child per
rank, at most `jobs` at a time. Each child takes its rank's environment (the job's, then RANK_ID and where
MindSpore dumps its IR), working folder, stdout and log, and runs the worker's `main(argv)` as
`python -m <worker>` would. A small twin's rank spent a third of its CPU importing (1.9 of 5.8 s); a forked
one imports only what the worker imports lazily (MindFormers, for bench/mf_dryrun.py). The process serves
job after job until its stdin closes, so a caller with many dry runs (the tests: one per test) imports once.

The process is started with the environment every rank shares (dryrun_ranks.shared_environment): the loader
reads LD_LIBRARY_PATH and LD_PRELOAD before Python runs, and MindSpore reads its variables when imported,
so the caller reuses a process only for jobs whose start-up variables are the same (dryrun_ranks.STARTUP).
MindSpore's import leaves one native thread waiting; a fork copies only the forking thread, so a lock that
thread held would stay held in the child (none has been met: every dry-run test of make test compiles
through here). The first job's `timeout` bounds the imports as well as each child.

Protocol: one JSON line on stdin per job, {"worker", "argv", "jobs", "timeout", "env", "log", "ranks":
[{"index", "env", "cwd", "stdout", "log"}]}; one JSON line on stdout per finished child, {"index",
"returncode"} (negative: the signal that ended it; SIGALRM when it ran past `timeout` seconds), then
{"done": true}. While a job runs, this process's own stderr goes to the job's `log`.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import signal
import sys
import traceback

# what every worker compiles with
PRELOADED = (
    "mindspore",
    "mindscale.train.loop.runtime",
    "mindscale.train.loop.step",
    "models.build",
    "models.sharding",
)


def run_child(module, job: dict, rank: dict) -> None:
    """In the forked child: become the rank's process, run the worker, and exit with its status."""
    code = 1
    try:
        try:
            os.environ.clear()
            os.environ.update({**job["env"], **rank["env"]})
            os.chdir(rank["cwd"])
            for fd, path in ((1, rank["stdout"]), (2, rank["log"])):
                opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
            signal.alarm(max(1, math.ceil(job["timeout"])))
            gc.disable()  # a rank lives for one compile: collecting cost a tenth of it and freed nothing measurable
            code = module.main(job["argv"]) or 0
        except SystemExit as exc:  # fail(): its line is on the log already
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback on the log, exit 1
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # whatever happened, the child never returns into the parent's loop
        os._exit(code)


def log_to(path: str) -> None:
    """This process's stderr, from now on, appended to `path`."""
    sys.stderr.flush()
    opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(opened, 2)
    os.close(opened)


def run_job(job: dict) -> None:
    """Fork the job's ranks, at most `jobs` at once, and report each as it ends."""
    log_to(job["log"])
    module = importlib.import_module(job["worker"])
    pending, running = list(job["ranks"]), {}
    while pending or running:
        while pending and len(running) < job["jobs"]:
            rank = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                run_child(module, job, rank)
            running[pid] = rank["index"]
        pid, status = os.wait()
        print(json.dumps({"index": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)}), flush=True)
    print(json.dumps({"done": True}), flush=True)


def main() -> int:
    line = sys.stdin.readline()
    first = json.loads(line)
    signal.alarm(max(1, math.ceil(first["timeout"])))  # SIGALRM ends this process: every rank is reported failed
    for name in (*PRELOADED, first["worker"]):
        importlib.import_module(name)
    gc.freeze()  # what the imports made stays: no child's collection walks it (nor copies its pages)
    signal.alarm(0)
    while line:
        run_job(json.loads(line))
        line = sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
