"""Bottleneck report from what mindspore.profiler wrote, with the config knobs to try.

    python tools/profile_report.py PROFILE_DIR [--steps N] [--top 15] [--json]

PROFILE_DIR is the run's profile/ folder, the `*_ascend_ms` folder inside it, or any parent: the
layout is detected in the folder or its subfolders.
The layouts read and the time split are described in mindscale/perf/profile.py and docs/tools.md.
"""
import argparse
import json
import sys
from pathlib import Path

from mindscale.cli import fail
from mindscale.config import UserError
from mindscale.perf.profile import analyse, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time split, top operators and diagnosis of a profile.")
    parser.add_argument("profile_dir", type=Path, help="folder mindspore.profiler wrote (or a parent)")
    parser.add_argument("--steps", type=int, help="steps the profile spans, when the profile cannot tell")
    parser.add_argument("--top", type=int, default=15, help="operators to list (default 15)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.top < 1:
        fail(f"--top {args.top}: must be >= 1")
    try:
        report = analyse(args.profile_dir, args.steps, args.top)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    print(json.dumps(report.to_dict()) if args.json else text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
