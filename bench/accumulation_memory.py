"""Host memory of the compiled train step against parallel.gradient_accumulation_steps, on CPU, at a fixed
micro batch: how much of the growth is the compiled graph and how much the step's own tensors.

    python bench/accumulation_memory.py --config C [--set k=v ...] [--workers 2] [--accumulation 1,2,4,8] [--json]

For each accumulation count g, `--workers` data-parallel workers (msrun; 1 = one process, no msrun) build
the step run_train.py trains (mindscale.train.loop.step.build_train_graph) with the config's
train.micro_batch_size and g micro batches per step, compile it on random tokens, then run two steps.
Rank 0 reports `compiled_gib` (its resident memory after the compile: the graph, its kernels, weights
and optimizer state) and `peak_gib` (its peak resident memory, VmHWM, after the steps); `step_gib` =
peak - compiled is what the steps themselves held at most: activations, gradients, workspace.
docs/launch.md ("Gradient accumulation with several workers") has the numbers.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from mindscale.cli import OneLineParser, add_config_arguments, config_from_args, emit, fail
from mindscale.launch.msrun import free_port

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
WORKER_ENV = "MINDSCALE_ACCUMULATION_WORKER"  # set in the processes this script starts (msrun parses --flags)


def measure_rank() -> dict:
    """Inside a worker: compile and run the step of the config on the command line; rank 0's numbers."""
    import numpy as np
    import mindspore as ms
    import psutil

    from mindscale.train.loop.runtime import setup
    from mindscale.train.loop.step import build_train_graph

    cfg = config_from_args(parse_args(sys.argv[1:]))
    rt = setup(cfg)
    step = build_train_graph(cfg, rt.layout).step
    shape = (rt.layout.rows_per_step, cfg.model.seq_length + 1)  # the stored tokens (dataset.py, make_batch)
    inputs = (ms.Tensor(np.random.default_rng(rt.rank).integers(0, cfg.model.vocab_size, shape).astype(np.int32)),)
    step.compile(*inputs)
    compiled = psutil.Process().memory_info().rss
    for _ in range(2):
        loss = float(step(*inputs)[0].asnumpy())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rank": rt.rank,
        "compiled_gib": round(compiled / GIB, 3),
        "peak_gib": round(peak / GIB, 3),
        "step_gib": round((peak - compiled) / GIB, 3),
        "loss": loss,
    }


def run(args, accumulation: int, log_dir: Path) -> dict:
    """One accumulation count: rank 0's report."""
    sets = [
        *args.overrides,
        f"parallel.gradient_accumulation_steps={accumulation}",
        f"parallel.data_parallel={args.workers}",
        "train.global_batch_size=null",
    ]
    worker = [str(Path(__file__).resolve()), "--config", args.config, *[a for o in sets for a in ("--set", o)]]
    env = {
        **os.environ,
        WORKER_ENV: "1",
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    if args.workers == 1:
        proc = subprocess.run([sys.executable, *worker], env=env, capture_output=True, text=True)
        lines = proc.stdout.splitlines()
    else:  # msrun starts `python` from PATH
        msrun = [
            "msrun",
            "--worker_num",
            str(args.workers),
            "--local_worker_num",
            str(args.workers),
            "--master_port",
            str(free_port()),
            "--log_dir",
            str(log_dir),
            "--join",
            "True",
        ]
        proc = subprocess.run([*msrun, *worker], env=env, capture_output=True, text=True)
        log = log_dir / "worker_0.log"
        lines = log.read_text().splitlines() if log.exists() else []
    reports = [json.loads(line) for line in lines if line.startswith('{"rank": 0')]
    if proc.returncode or not reports:
        said = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        fail(f"accumulation {accumulation}: the workers failed (exit {proc.returncode}): {said[0]}", code=1)
    return {"accumulation": accumulation, **reports[-1]}


def parse_args(argv):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    parser.add_argument("--workers", type=int, default=2, help="data-parallel workers (default 2; 1: one process)")
    parser.add_argument("--accumulation", default="1,2,4,8", help="accumulation counts (default 1,2,4,8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get(WORKER_ENV):
        report = measure_rank()
        if report["rank"] == 0:
            print(json.dumps(report), flush=True)
        return 0
    config_from_args(args)  # bad input: one line, exit 2
    args.config = str(Path(args.config).resolve())
    with tempfile.TemporaryDirectory(prefix="mindscale-accumulation-") as tmp:
        rows = [run(args, int(g), Path(tmp) / f"g{g}") for g in args.accumulation.split(",")]
    table = "\n".join(
        ["accumulation  compiled_gib  peak_gib  step_gib"]
        + [f"{r['accumulation']:>12}  {r['compiled_gib']:>12}  {r['peak_gib']:>8}  {r['step_gib']:>8}" for r in rows]
    )
    emit({"workers": args.workers, "rows": rows}, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
