"""Reshard a checkpoint step to another layout or card count: weights, AdamW moments, step and data position.

    python tools/reshard.py --input RUN/checkpoints/step_00001000 --config TARGET.yaml [--set k=v ...] \
        --output NEW_RUN/checkpoints [--jobs 2] [--json]

--input is a whole step folder or any rank_<r>/step_* folder of a sharded run (its ranks' slices are
merged). A sharded target is cut by the layouts MindSpore's dry run compiles for it (one compile per
pipeline stage; on a host without CANN the stand-ins of docs/dryrun.md). The output is a run's
checkpoints folder with the step committed: a run of TARGET.yaml whose run folder holds it resumes
there. docs/checkpoints.md describes the protocol. Progress goes to stderr (a bar on a terminal, else
plain lines: mindscale/progress.py). Exit 2 with one line for bad input.
"""

from __future__ import annotations

import sys
from functools import partial

from mindscale.cli import OneLineParser, add_config_arguments, config_from_args, emit, fail
from mindscale.config import UserError
from mindscale.launch.dryrun_ranks import rank_layouts
from mindscale.progress import Progress
from mindscale.train.checkpoints.reshard import reshard


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a step folder, or any rank_<r>/step_* of a sharded run")
    parser.add_argument("--output", required=True, help="a new, empty folder: the target run's checkpoints/")
    parser.add_argument("--jobs", type=int, default=1, help="stages compiled at once by the dry run")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the result")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        with Progress("reshard") as progress:
            layouts = partial(rank_layouts, args.config, args.overrides, cfg, args.jobs)
            result = reshard(args.input, cfg, args.output, layouts, progress)
    except UserError as exc:
        fail(str(exc))
    emit(
        result,
        args.json,
        f"wrote step {result['step']} for {result['ranks']} rank folder(s) under "
        f"{result['output']} ({result['bytes'] / 1e9:.3g} GB in {result['seconds']} s, "
        f"{result['compile_s']} s of it compiling the target layout)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
