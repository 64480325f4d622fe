"""Compile a config's sharded training graph for chosen ranks with MindSpore's dry run, on any host.

    python tools/dryrun.py --config configs/llama2/llama2_70b.yaml                 # rank 0 and the last stage's first rank
    python tools/dryrun.py --config C --rank 5 [--set k=v ...] [--json]
    python tools/dryrun.py --config C --ranks stages                               # the first rank of every stage
    python tools/dryrun.py --config C --ranks 0,7 --packed                         # packed SFT inputs (segment_ids)
    python tools/dryrun.py --config C --memory [run]                               # and MindSpore's device memory
    python tools/dryrun.py --config C [--set k=v ...] --twin                      # its scaled twin: minutes, not hours

Each rank compiles in its own process (mindscale.launch.dryrun_worker, driven by mindscale.launch.dryrun_ranks) with
MS_SIMULATION_LEVEL=0 (1 with --memory) and, where CANN is not installed, the stand-in libraries of
mindscale.launch.standins (built once; needs gcc and binutils).
A dry run verifies that MindSpore's parallel compiler accepts the graph (strategies, redistribution,
pipeline split, optimizer shard) and reports the compiled layouts and collectives. It does not
verify kernels, numerics or speed, and device memory only as MindSpore plans it (--memory; docs/dryrun.md).

--json prints one JSON object per rank, one per line: compiled, error, rank, stage, devices,
local_shapes, bytes, groups, collectives, inputs, row_groups, compile_s, host_peak_rss_gib, and
`planned` (the planner's bytes for that rank's stage and its predicted communication, with ratios to
the compiled ones).
--memory runs MindSpore's dry run at level 1 and adds `device_memory`: its plan of the rank's device memory
(persistent bytes plus its SOMAS block, the largest tensors at the peak, what it leaves out); `--memory run`
executes one step too (the rank's parameters are then allocated on the host) and adds the peak of what
MindSpore's pool handed out; `planned` then adds the planner's device memory and its ratio to MindSpore's
(docs/dryrun.md, "Device memory").
--twin compiles the config's scaled twin (mindscale.config.twin): its widths, keys and degrees, so every
parameter shape, strategy and optimizer shard, with one layer for each kind of layer a stage holds (recomputed,
offloaded, kept), as many micro batches as stages and a 64-token sequence; the overrides it adds are printed on
stderr. The --set assignments apply first: the twin is that of the config they give.
Exit status: 0 every rank compiled, 1 a compile failed, 2 bad input.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from mindscale.cli import OneLineParser, add_config_arguments, config_from_args, fail
from mindscale.config import UserError, validate_packed
from mindscale.config.twin import twin_overrides
from mindscale.launch.dryrun_ranks import DEFAULT_TIMEOUT_S, Job, choose_ranks, compile_ranks, for_ascend, line


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="compile this rank")
    which.add_argument("--ranks", default="first,last", help="first,last (default), stages, or a list like 0,7")
    parser.add_argument("--packed", action="store_true", help="inputs carry segment_ids (packed SFT data)")
    parser.add_argument(
        "--no-collectives",
        action="store_true",
        help="do not dump the compiled graph to read its collectives (saves time and memory)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="ranks compiled at once (each in its own process)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per rank")
    parser.add_argument("--log-dir", help="where each rank's compile log goes (default: a temporary folder)")
    parser.add_argument(
        "--ir-dir",
        help="keep each rank's compiled graph (the validate IR) in DIR/rank<R>/ "
        "(default: read for the collectives, then deleted)",
    )
    parser.add_argument(
        "--twin",
        action="store_true",
        help="compile the config's scaled twin: its widths and layout, few layers and micro batches",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per rank, one per line")
    parser.add_argument(
        "--memory",
        nargs="?",
        const="plan",
        choices=("plan", "run"),
        help="MindSpore's device-memory plan of each rank (level-1 dry run); run: execute a step too",
    )
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if args.twin:
        twin = twin_overrides(cfg)
        print(f"twin of {args.config}: --set {' --set '.join(twin)}", file=sys.stderr)
        args.overrides = [*args.overrides, *twin]
        cfg = config_from_args(args)
    try:
        cfg, layout = for_ascend(cfg)
        ranks = [args.rank] if args.rank is not None else choose_ranks(args.ranks, layout)
        if args.packed:
            validate_packed(cfg, layout)
    except UserError as exc:
        fail(str(exc))
    if args.jobs < 1:
        fail(f"--jobs {args.jobs}: must be >= 1")
    if args.rank is not None and not 0 <= args.rank < layout.devices:
        fail(f"--rank {args.rank} is outside 0..{layout.devices - 1} (the config's {layout.devices} devices)")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mindscale-dryrun-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.ir_dir and args.no_collectives:
        fail("--ir-dir keeps the compiled graph that --no-collectives does not dump; drop one of them")
    job = Job(
        args.config,
        tuple(args.overrides),
        log_dir,
        args.packed,
        not args.no_collectives,
        args.timeout,
        ir_dir=Path(args.ir_dir).resolve() if args.ir_dir else None,
        memory=args.memory,
    )
    failed = False
    try:
        for report in compile_ranks(cfg, job, ranks, args.jobs):
            failed |= not report["compiled"]
            print(json.dumps(report) if args.json else line(report), flush=True)
    except UserError as exc:
        fail(str(exc))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
