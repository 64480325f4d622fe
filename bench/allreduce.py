"""Gradient all-reduce time of CPU data parallelism: the measured ceiling of `make bench`'s linearity.

    PATH=.venv/bin:$PATH msrun --worker_num=2 --local_worker_num=2 --master_port=PORT --log_dir=DIR \
        --join=True bench/allreduce.py --out allreduce.json [--config bench/llama_peer.yaml] [--set k=v ...]

A data-parallel step is the 1-worker step plus the all-reduce of every gradient, which
nn.DistributedGradReducer issues as one AllReduce per trainable parameter inside the step's graph.
MindSpore's only CPU collective backend (MCCL) does the reduction on the CPU of the calling process,
so on workers pinned to one core each it cannot overlap the backward pass: linearity is at most
t1 / (t1 + all-reduce time), t1 being the 1-worker step time, before any memory-bandwidth contention.

This script measures that all-reduce time. Each worker pins itself to one core (the rank-th core it
may use, as scripts/run_distribute.sh pins CPU workers) with one operator thread, makes tensors of
the config's trainable parameter shapes and dtypes, and calls one graph-mode Cell that all-reduces
each of them: one warm-up (compile) call, then the median of 5 calls of wall time and of this
process's CPU time (all its threads, MCCL's included). Rank 0 writes one JSON object to --out.
Exit status: 0 measured, 2 bad input (one line on stderr), 1 MindSpore failed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.machine import versions
from mindscale.cli import OneLineParser, add_config_arguments, config_from_args, fail
from mindscale.launch.worker import pin_to_core

PEER_CONFIG = Path(__file__).resolve().parent / "llama_peer.yaml"
CALLS = 5


def parse_args(argv):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, required=False)
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    args = parser.parse_args(argv)
    if "MS_ROLE" not in os.environ:
        fail("bench/allreduce.py runs under msrun (e.g. --worker_num=2 --local_worker_num=2); see its docstring")
    if not args.out.parent.is_dir():
        fail(f"--out {args.out}: folder {args.out.parent} does not exist")
    args.config = args.config or str(PEER_CONFIG)
    return args


def measure(cfg) -> dict:
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import get_group_size, get_rank, init
    from mindspore.nn.utils import no_init_parameters

    from models import build_model

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(1)
    init()  # the scheduler process (MS_ROLE=MS_SCHED) stays in here until the workers finish, then exits

    class AllReduceEach(nn.Cell):
        """One AllReduce per tensor in one graph, as nn.DistributedGradReducer reduces gradients."""

        def __init__(self):
            super().__init__()
            self.all_reduce = ops.AllReduce()

        def construct(self, *tensors):
            return tuple(self.all_reduce(t) for t in tensors)

    with no_init_parameters():  # shapes and dtypes only: no weights are initialised
        params = build_model(cfg).trainable_params()
    grads = [Tensor(np.ones(p.shape, np.float32), dtype=p.dtype) for p in params]
    reduce_all = AllReduceEach()

    def done(outputs):  # waits for every result: asnumpy is zero-copy on CPU (runtime.synchronize is Ascend/GPU only)
        return [o.asnumpy() for o in outputs]

    done(reduce_all(*grads))  # compile + warm-up
    wall, cpu = [], []
    for _ in range(CALLS):
        began_wall, began_cpu = time.perf_counter(), time.process_time()
        done(reduce_all(*grads))
        wall.append(time.perf_counter() - began_wall)
        cpu.append(time.process_time() - began_cpu)
    size = sum(g.nbytes for g in grads)
    return {
        "rank": get_rank(),
        "workers": get_group_size(),
        "tensors": len(grads),
        "bytes": size,
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "mb_per_s": size / 1e6 / statistics.median(wall),
        "wall_s_calls": wall,
        "cpu_s_calls": cpu,
        "core": min(os.sched_getaffinity(0)),
        "threads": 1,
        "versions": {"python": platform.python_version(), **versions()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    if os.environ["MS_ROLE"] != "MS_SCHED":  # the scheduler only coordinates: leave it unpinned
        allowed = sorted(os.sched_getaffinity(0))
        pin_to_core(allowed[int(os.environ.get("DEVICE_ID", "0")) % len(allowed)], os.environ)  # msrun: local rank
    result = measure(cfg)
    if result["rank"] == 0:
        result.update(config=args.config, overrides=args.overrides)
        args.out.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
