"""Before/after comparison table of two run folders, judged against the targets you ask for (computed by
mindscale/perf/compare.py).

    python tools/compare_runs.py BASELINE_RUN OPTIMIZED_RUN [--targets seed] [--step-time-target -0.30]
        [--throughput-target 0.50] [--mfu-target 0.60] [--linearity-target 0.8]
        [--linearity FILE] [--baseline-linearity FILE] [--json] [--warmup 1]

Rows: step time and throughput tokens/s (relative change), MFU (points), HFU and peak memory, and
linearity at the largest device count of a sweep when a linearity.json from tools/linearity.py sits
in the run folder or is passed with --linearity. Each run's numbers are those tools/mfu.py prints
(docs/mfu.md: the steps after warm-up, their tokens over their time).

No target is judged unless asked for: --targets seed judges the goals MindScale was started with
(step time <= -30%, throughput >= +50%, MFU of the optimized run >= 60%, linearity >= 0.8), and each
--*-target sets (or, after a preset, replaces) one. Exit 0 when no judged target is missed, 1 when one
is (so a CI job can gate on it), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mindscale.cli import fail
from mindscale.config import UserError
from mindscale.perf.compare import PRESETS, compare, table, targets_of
from mindscale.perf.metrics_io import add_warmup_argument


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Before/after comparison table of two runs.")
    parser.add_argument("baseline", help="baseline run folder")
    parser.add_argument("optimized", help="optimized run folder")
    parser.add_argument(
        "--targets", metavar="PRESET", help=f"judge a named set of targets ({', '.join(PRESETS)}); default: none"
    )
    parser.add_argument(
        "--step-time-target", type=float, help="required relative step-time change, e.g. -0.30 (30%% faster)"
    )
    parser.add_argument("--throughput-target", type=float, help="required relative throughput change, e.g. 0.50")
    parser.add_argument("--mfu-target", type=float, help="required MFU of the optimized run, e.g. 0.60")
    parser.add_argument("--linearity-target", type=float, help="required linearity of the optimized run, e.g. 0.8")
    parser.add_argument("--linearity", type=Path, help="linearity.json of the optimized run's sweep")
    parser.add_argument("--baseline-linearity", type=Path, help="linearity.json of the baseline's sweep")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_warmup_argument(parser)
    args = parser.parse_args(argv)
    try:
        targets = targets_of(
            args.targets,
            step_time=args.step_time_target,
            throughput=args.throughput_target,
            mfu=args.mfu_target,
            linearity=args.linearity_target,
        )
        result = compare(args.baseline, args.optimized, targets, args.warmup, args.linearity, args.baseline_linearity)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    print(json.dumps(result) if args.json else table(result))
    return 1 if result["all_met"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
