"""Launching workers: the logic behind scripts/run_distribute.sh and scripts/run_standalone.sh.

    python -m mindscale.launch distribute CONFIG [NUM_DEVICES] [--set k=v ...] [--dry-run]
    python -m mindscale.launch standalone CONFIG [--set k=v ...]
    python -m mindscale.launch worker ENTRY [ARGS ...]     (what msrun starts in every process)

`distribute` plans the workers (msrun.py: cores, nodes, the msrun line; its docstring lists the
environment variables) and runs msrun under the supervisor (supervisor.py), which stops the whole
job at the first dead worker and names its log; every process msrun starts runs through `worker`
(worker.py), which records its exit status for the supervisor.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import typing

from mindscale.cli import OneLineParser, fail
from mindscale.devices import detect_device
from mindscale.config import UserError, load_config
from mindscale.launch.msrun import (
    QUIET_MINDSPORE,
    LaunchError,
    fit_data_parallel,
    plan_distribute,
    resolve_entry,
    with_repo_on_path,
)
from mindscale.launch.supervisor import supervise
from mindscale.launch.worker import pin_to_core, run_worker
from mindscale.train.loop.runnable import check_device


def standalone(args: argparse.Namespace, env: dict) -> typing.NoReturn:
    """One device without msrun: data_parallel set to 1, pinned to one core on CPU, MindSpore's log at
    errors as under msrun, then exec."""
    cfg = load_config(args.config, args.overrides)
    fitted = fit_data_parallel(cfg, 1)
    overrides = args.overrides + ([fitted] if fitted else [])
    load_config(args.config, overrides)  # the fitted config must still validate (e.g. global batch)
    device = detect_device(cfg.run.device_target, env)
    check_device(cfg, device)
    if device == "CPU":
        pin_to_core(min(os.sched_getaffinity(0)), env)
    cmd = [
        sys.executable,
        str(resolve_entry(env)),
        "--config",
        args.config,
        *[a for o in overrides for a in ("--set", o)],
    ]
    env.setdefault(*QUIET_MINDSPORE)
    os.execve(sys.executable, cmd, {**env, "PYTHONPATH": with_repo_on_path(env)})


def distribute(args: argparse.Namespace, env: dict) -> int:
    overrides = args.overrides + ([] if args.max_restarts is None else [f"run.max_restarts={args.max_restarts}"])
    plan = plan_distribute(args.config, args.num_devices, overrides, env)
    if args.dry_run:
        for note in plan.notes:
            print(f"note: {note}", file=sys.stderr)
        changes = [f"{k}={v}" for k, v in sorted(plan.env_changes(env).items())]
        print(shlex.join(["env", *changes, *plan.msrun_argv()]))
        return 0
    bin_dir = os.path.dirname(sys.executable)
    for tool in ("msrun", "python"):  # msrun starts workers as `python ...` from PATH
        if os.path.dirname(shutil.which(tool, path=plan.env(env)["PATH"]) or "") != bin_dir:
            raise LaunchError(
                f"no {tool} in {bin_dir}; run with the python that has mindspore (PYTHON=.venv/bin/python)"
            )
    return supervise(plan, plan.env(env))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        if len(argv) < 2:
            fail("worker needs the entry point: python -m mindscale.launch worker ENTRY [ARGS ...]")
        return run_worker(argv[1:])
    parser = OneLineParser(prog="python -m mindscale.launch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dist = sub.add_parser(
        "distribute", prog="scripts/run_distribute.sh", help="msrun over all devices of this node (and NNODES nodes)"
    )
    dist.add_argument("config")
    dist.add_argument("num_devices", nargs="?", help="devices (workers) per node; default: all NPUs/GPUs, 2 on CPU")
    dist.add_argument("--dry-run", action="store_true", help="print the msrun command, start nothing")
    dist.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="relaunch the workers from the newest committed checkpoint after a failure, at most N "
        "times (run.max_restarts)",
    )
    alone = sub.add_parser("standalone", prog="scripts/run_standalone.sh", help="one device, no msrun")
    alone.add_argument("config")
    for p in (dist, alone):
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        return {"distribute": distribute, "standalone": standalone}[args.command](args, dict(os.environ))
    except UserError as exc:  # LaunchError, ConfigError, ...: one line, exit 2
        fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
