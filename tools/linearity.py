"""Multi-device linearity from run folders of one config at different device counts (definition:
docs/mfu.md; computed by mindscale/perf/linearity.py).

    python tools/linearity.py output/llama_tiny_n1 output/llama_tiny_n2 [--threshold 0.8]
        [--plot linearity.png] [--json]

Throughput of a run = its tokens over its time in the steps after warm-up (docs/mfu.md, the
number tools/mfu.py prints). With base = the smallest device count, linearity at N =
(throughput_N / N) / (throughput_base / base), which needs the same per-device batch at every N
(scripts/run_linearity.sh keeps train.micro_batch_size).
Points below --threshold are flagged; the exit status stays 0 (2 on bad input). The sweep is also
written as linearity.json into every run folder, where tools/compare_runs.py looks for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mindscale.cli import fail
from mindscale.config import UserError
from mindscale.perf.linearity import RESULT_FILE, TARGET, plot, sweep, table
from mindscale.perf.metrics_io import add_warmup_argument


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Linearity of a device-count sweep (docs/mfu.md).")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders of the same config")
    parser.add_argument(
        "--threshold", type=float, default=TARGET, help=f"flag linearity below this (default {TARGET:g})"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of per-device throughput and linearity")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_warmup_argument(parser)
    args = parser.parse_args(argv)
    try:
        result = sweep(args.runs, args.threshold, args.warmup)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    if args.plot:
        plot(result, args.plot)
        result["plot"] = str(args.plot)
    for p in result["points"]:
        (Path(p["run"]) / RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
