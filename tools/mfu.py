"""MFU and HFU of a run, or of a step time you give it, with the formula, parameter count and peak
printed beside the result (definitions: docs/mfu.md; computed by mindscale/perf/mfu.py over
mindscale/perf/flops.py, the same functions the trainer logs with).

    python tools/mfu.py --metrics RUN_DIR [--skip 1] [--json]                 # config from RUN_DIR/config.yaml
    python tools/mfu.py --config C --step-time S --global-batch B --devices N [--peak-tflops P] [--json]

From a run folder: the first `--skip` records of every training process (compile steps) are
dropped, the kept records' total time over their steps gives tokens/s, MFU and HFU (the same
function as tools/report.py: mindscale/perf/mfu.py `of_run`), and the spread over the records is
reported. A metrics.jsonl whose last line is cut off (a run still writing) is read up to it with a
warning; an empty one, or one with nothing but warm-up records, is an error (exit 2).
Peak: --peak-tflops, else the hardware profile's, else (CPU) the peak logged by the run, else the
cached measured GEMM peak (mindscale/perf/gemm_peak.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from mindscale.cli import add_config_arguments, fail
from mindscale.config import UserError, load_config
from mindscale.perf.mfu import from_metrics, of_step_time, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MFU/HFU from a run folder or from a step time.")
    add_config_arguments(parser, required=False)
    parser.add_argument("--metrics", metavar="RUN_DIR", help="run folder with metrics.jsonl (and config.yaml)")
    parser.add_argument("--step-time", type=float, help="seconds per optimizer step")
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    parser.add_argument("--devices", type=int, help="devices (default: the config's data x model x pipeline)")
    parser.add_argument("--peak-tflops", type=float, help="peak per device, overrides the hardware profile")
    parser.add_argument(
        "--skip",
        "--warmup",
        dest="skip",
        type=int,
        default=1,
        help="records dropped at the start of each training process (default 1: the compile step)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    explicit = args.step_time is not None or args.global_batch is not None
    if bool(args.metrics) == explicit:
        fail("give either --metrics RUN_DIR or both --step-time S and --global-batch B")
    if explicit and (args.step_time is None or args.global_batch is None):
        fail("--step-time and --global-batch go together; give both")
    if args.step_time is not None and args.step_time <= 0 or args.global_batch is not None and args.global_batch < 1:
        fail(f"--step-time {args.step_time} / --global-batch {args.global_batch}: need a time > 0 and a batch >= 1")
    if args.devices is not None and args.devices < 1 or args.peak_tflops is not None and args.peak_tflops <= 0:
        fail(f"--devices {args.devices} / --peak-tflops {args.peak_tflops}: need devices >= 1 and a peak > 0")
    if args.skip < 0:
        fail(f"--skip {args.skip}: must be >= 0")
    if not args.config and not args.metrics:
        fail("--config is required with --step-time (a run folder brings its own config.yaml)")
    try:
        cfg = load_config(args.config, args.overrides) if args.config else None
        if args.metrics:
            result, cfg = from_metrics(args.metrics, cfg, args.overrides, args.skip, args.devices, args.peak_tflops)
        else:
            result = of_step_time(cfg, args.step_time, args.global_batch, args.devices, args.peak_tflops)
    except UserError as exc:
        fail(str(exc))
    print(json.dumps(result) if args.json else text(result, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
