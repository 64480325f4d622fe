"""Plan a config before compiling it: parameters, FLOPs, per-device memory, communication, predicted
step time (as a sum of where it goes) and MFU, goodput and the save interval that maximises it, and the published figures of the anchors for the same model and
card count (mindscale/perf/planner/, as text by mindscale/perf/planner/text.py; formulas and their sources in
docs/planner.md).

    python tools/plan.py --config configs/llama2/llama2_70b.yaml [--set k=v ...] [--json]
    python tools/plan.py --config configs/llama2/llama2_70b.yaml --devices 64          # re-plan: data_parallel changes
    python tools/plan.py --config configs/llama2/llama2_70b.yaml --search --devices 64 # rank layouts, print --set lines
    python tools/plan.py --config configs/llama2/llama2_7b.yaml --strategies           # per-layer shard strategies
    python tools/plan.py --readme-table                                                # Markdown table of shipped configs
"""

from __future__ import annotations

import argparse
import json
import sys

from mindscale.cli import add_config_arguments, config_from_args, fail
from mindscale.config import UserError
from mindscale.perf import planner
from mindscale.perf.planner import published
from mindscale.perf.planner.goodput import COMPILE_S
from mindscale.perf.planner.text import readme_table, search_json, search_text, shipped_configs, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plan memory, communication and MFU of a config before compiling.")
    add_config_arguments(parser, required=False)
    parser.add_argument(
        "--devices",
        type=int,
        help="re-plan for N devices (data_parallel changes; with --search: the device count to search)",
    )
    parser.add_argument(
        "--search",
        action="store_true",
        help="rank valid (dp, mp, pp, micro batches, recompute) layouts and print the top ones as --set lines",
    )
    parser.add_argument("--top", type=int, default=5, help="layouts printed by --search (default 5)")
    parser.add_argument("--strategies", action="store_true", help="print the per-layer sharding strategies")
    parser.add_argument("--readme-table", action="store_true", help="Markdown table of all shipped scale configs")
    parser.add_argument("--peak-tflops", type=float, help="override the hardware profile's peak per device")
    parser.add_argument(
        "--efficiency",
        type=float,
        help="run every hardware FLOP at this fraction of the peak "
        "instead of the profile's fitted speed model (uncalibrated "
        f"profiles: {planner.DEFAULT_EFFICIENCY})",
    )
    parser.add_argument(
        "--compile-s",
        type=float,
        default=COMPILE_S,
        help=f"seconds one compile of the step takes, for the goodput prediction (default {COMPILE_S:g}, assumed)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    if args.peak_tflops is not None and args.peak_tflops <= 0:
        fail(f"--peak-tflops {args.peak_tflops}: must be > 0")
    if args.compile_s < 0:
        fail(f"--compile-s {args.compile_s}: must be >= 0")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        fail(f"--efficiency {args.efficiency}: must be in (0, 1]")
    if args.readme_table:
        print(readme_table(shipped_configs(), args.peak_tflops))
        return 0
    if not args.config:
        fail("--config is required (or --readme-table); e.g. --config configs/llama2/llama2_7b.yaml")
    cfg = config_from_args(args)
    if args.strategies:
        from models.sharding import describe_plan  # imports MindSpore: only here

        print(describe_plan(cfg))
        return 0
    try:
        if args.search:
            devices = args.devices or cfg.devices
            found = planner.search(cfg, devices, args.top, args.peak_tflops, args.efficiency)
            print(json.dumps(search_json(found)) if args.json else search_text(devices, found))
            return 0
        if args.devices is not None and args.devices != cfg.devices:
            cfg = planner.replan_devices(cfg, args.devices)
        result = planner.plan(cfg, args.peak_tflops, args.efficiency, args.compile_s)
        result["published"] = published.entries(cfg)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    print(json.dumps(result) if args.json else text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
