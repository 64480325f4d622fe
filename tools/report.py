"""One self-contained HTML report of a run folder, with its plots also written as PNG files
(built by mindscale/perf/run_report.py).

    python tools/report.py RUN_DIR [--output RUN_DIR/report.html] [--warmup 1]

Contents: loss and learning rate, throughput, MFU/HFU and memory over steps; the steady-state
throughput and MFU (tools/mfu.py's, docs/mfu.md) next to the planner's prediction for the same
config (mindscale/perf/planner/); the MFU/HFU formula with the FLOPs per token and the peak used, so the numbers can be redone by hand; the
profiler summary when the run has a profile; the data mix (the tokens each source, data.path or each
data.blend entry, gave by the last logged step, from metrics.jsonl's data_tokens, next to its configured
share) and the time the loop waited for data (data_wait_s); the resolved config. The PNGs are embedded as
base64 and written next to the HTML as <stem>_<plot>.png. A run on MindRecord data also gets the data mix
as one line on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mindscale.cli import fail
from mindscale.config import UserError
from mindscale.perf.metrics_io import add_warmup_argument, load_run
from mindscale.perf.run_report import build, data_mix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Self-contained HTML report of a run folder.")
    parser.add_argument("run_dir", help="run folder (<run.output_dir>/<run.name>)")
    parser.add_argument("--output", type=Path, help="HTML file (default RUN_DIR/report.html); PNGs go next to it")
    add_warmup_argument(parser)
    args = parser.parse_args(argv)
    try:
        output, pngs = build(args.run_dir, args.output, args.warmup)
        mix = data_mix(load_run(args.run_dir).metrics.records)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    print(output)
    if mix:
        print(mix)
    for path in pngs:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
