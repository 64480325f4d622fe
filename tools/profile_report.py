"""Bottleneck report from what mindspore.profiler wrote, with the config knobs to try.

    python tools/profile_report.py PROFILE_DIR [--rank R | --all-ranks] [--steps N] [--top 15]
        [--config C] [--set k=v] [--json]

PROFILE_DIR is the run's profile/ folder, the `*_ascend_ms` folder inside it, or any parent: the
layout is detected in the folder or its subfolders. Each rank writes its own folder; the report
reads the lowest rank's (or --rank R's), names it, and with --all-ranks adds every rank's time split.
The knobs it advises are filtered by the device (the profile's layout) and the run's config: the
config.yaml of the run folder holding profile/, or --config (with --set) when the profile sits elsewhere.
The layouts read and the time split are described in mindscale/perf/profile.py and docs/tools.md.
"""

import argparse
import json
import sys
from pathlib import Path

from mindscale.cli import add_config_arguments, fail
from mindscale.config import UserError, load_config
from mindscale.perf.profile import analyse, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time split, top operators and diagnosis of a profile.")
    parser.add_argument("profile_dir", type=Path, help="folder mindspore.profiler wrote (or a parent)")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--rank", type=int, help="the rank whose profile to report (default: the lowest)")
    ranks.add_argument("--all-ranks", action="store_true", help="add every rank's time split")
    parser.add_argument("--steps", type=int, help="steps the profile spans, when the profile cannot tell")
    parser.add_argument("--top", type=int, default=15, help="operators to list (default 15)")
    add_config_arguments(parser, required=False)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.top < 1:
        fail(f"--top {args.top}: must be >= 1")
    try:
        cfg = load_config(args.config, args.overrides) if args.config else None
        report = analyse(
            args.profile_dir, args.steps, args.top, args.rank, args.all_ranks, cfg, args.config, args.overrides
        )
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    print(json.dumps(report.to_dict()) if args.json else text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
