"""Before/after verification table of two run folders (computed by mindscale/perf/compare.py).

    python tools/compare_runs.py BASELINE_RUN OPTIMIZED_RUN [--step-time-target -0.30]
        [--throughput-target 0.50] [--mfu-target 0.60] [--linearity-target 0.8]
        [--linearity FILE] [--baseline-linearity FILE] [--json]

Rows: step time (relative change, target <= -30%), throughput tokens/s (relative change, target
>= +50%), MFU of the optimized run (target >= 60%), HFU and peak memory (shown, no target) and
linearity at the largest device count of a sweep (target >= 0.8) when a linearity.json from
tools/linearity.py sits in the run folder or is passed with --linearity. Medians over the steps
after warm-up. Exit 0 when every target with a measurement is met, 1 when one is not (so a CI job
can gate on it), 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mindscale.cli import fail
from mindscale.config import UserError
from mindscale.perf.compare import Targets, compare, table
from mindscale.perf.metrics_io import add_warmup_argument


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Before/after verification table of two runs.")
    parser.add_argument("baseline", help="baseline run folder")
    parser.add_argument("optimized", help="optimized run folder")
    parser.add_argument("--step-time-target", type=float, default=Targets.step_time,
                        help="required relative step-time change (default -0.30 = 30%% faster)")
    parser.add_argument("--throughput-target", type=float, default=Targets.throughput,
                        help="required relative throughput change (default 0.50 = +50%%)")
    parser.add_argument("--mfu-target", type=float, default=Targets.mfu, help="required MFU of the optimized run")
    parser.add_argument("--linearity-target", type=float, default=Targets.linearity,
                        help="required linearity (default 0.8)")
    parser.add_argument("--linearity", type=Path, help="linearity.json of the optimized run's sweep")
    parser.add_argument("--baseline-linearity", type=Path, help="linearity.json of the baseline's sweep")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_warmup_argument(parser)
    args = parser.parse_args(argv)
    targets = Targets(args.step_time_target, args.throughput_target, args.mfu_target, args.linearity_target)
    try:
        result = compare(args.baseline, args.optimized, targets, args.warmup, args.linearity, args.baseline_linearity)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    print(json.dumps(result) if args.json else table(result))
    return 0 if result["all_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
