"""Training throughput of one stack on the peer config, in this process, pinned to one core.

    python bench/bench_train.py --system mindscale|mindformers|hf [--layers N] [--steps N]
        [--warmup N] [--core C] [--config bench/llama_peer.yaml] [--set k=v ...] [--json]

Timeline: build the model and optimizer (`build_s`), one first step (`compile_s`: graph compile +
first step for MindSpore; for hf, which compiles nothing, just its first step), `--warmup` untimed
steps, then `--steps` timed steps. tokens/s = batch x seq / median step time; `tflops` uses the
model FLOPs per token of docs/mfu.md (mindscale/perf/flops.py), the same for all three stacks.
`peak_rss_gib` is this process's peak resident memory (VmHWM): each system runs in its own
process, so the number covers its framework, model, optimizer state and activations.

Threads: the process pins itself to one core (`--core`, default the lowest allowed core, where
mindscale.perf.gemm_peak measures the peak) before any framework is imported, and every framework gets
one operator thread (MindSpore threads_num, torch.set_num_threads, OMP/MKL/OpenBLAS variables).
The process works in output/bench/work (MindSpore drops rank_0/om/analyze_fail.ir into the working
directory when a graph fails to compile). Exit status: 0 measured, 2 bad input (one line on
stderr), 1 the system failed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from bench import SYSTEMS
from mindscale.cli import OneLineParser, add_config_arguments, config_from_args, emit, fail

REPO = Path(__file__).resolve().parent.parent
PEER_CONFIG = REPO / "bench" / "llama_peer.yaml"
# MindSpore writes rank_0/om/analyze_fail.ir into the working directory when a graph fails to compile
WORK_DIR = REPO / "output" / "bench" / "work"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def parse_args(argv):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_peer_arguments(parser)
    parser.add_argument("--layers", type=int, help="model.num_layers (shorthand for --set model.num_layers=N)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5; 0 = compile only)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (default 2)")
    args = settle_peer_arguments(parser.parse_args(argv))
    if args.layers is not None:
        if args.layers < 1:
            fail(f"--layers {args.layers}: must be >= 1")
        args.overrides.append(f"model.num_layers={args.layers}")
    if args.steps < 0 or args.warmup < 0:
        fail(f"--steps {args.steps} --warmup {args.warmup}: must be >= 0")
    return args


def add_peer_arguments(parser) -> None:
    """What every one-stack measurement of the peer config takes: --system, --config/--set, --core, --json."""
    parser.add_argument("--system", required=True, choices=SYSTEMS)
    add_config_arguments(parser, required=False)
    parser.add_argument("--core", type=int, help="core to pin to (default: the lowest this process may use)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def settle_peer_arguments(args):
    """The peer config unless --config; --core checked against the cores this process may use."""
    args.config = str(Path(args.config).absolute()) if args.config else str(PEER_CONFIG)
    allowed = sorted(os.sched_getaffinity(0))
    if args.core is None:
        args.core = allowed[0]
    elif args.core not in allowed:
        fail(f"--core {args.core}: this process may only use cores {allowed}; pick one of them")
    return args


def pin(core: int) -> None:
    """One core, one thread everywhere; must run before numpy/MindSpore/torch start thread pools."""
    os.sched_setaffinity(0, [core])
    for name in THREAD_VARIABLES:
        os.environ[name] = "1"


def enter_peer_process(args, steps: int):
    """Pin to --core, load the config and work in WORK_DIR; returns the config, its train.steps covering
    the `steps` this run takes (the trainer sizes its lr table by it)."""
    pin(args.core)
    cfg = config_from_args(args)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    os.chdir(WORK_DIR)
    cfg.train.steps = max(cfg.train.steps, steps)
    return cfg


def stdout_to_stderr() -> int:
    """Send everything written to stdout (MindFormers logs there, from Python and C++) to stderr, so
    that --json prints exactly one object; returns a duplicate of the real stdout."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    return real


def peak_rss_gib() -> float:
    """This process's peak resident set since its exec (/proc/self/status VmHWM). Not getrusage's
    ru_maxrss: Linux carries a parent's peak across fork + exec, so a child of a large process (a
    pytest that has compiled models, measured 1.47 GiB) reported its parent's peak, whatever it ran."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib / 2**20


def measure(system_name: str, cfg, steps: int, warmup: int) -> dict:
    from bench.systems import BUILDERS, fixed_batch
    from mindscale.perf.flops import model_flops_per_token

    batch = fixed_batch(cfg)
    began = time.perf_counter()
    system = BUILDERS[system_name](cfg, batch)
    build_s = time.perf_counter() - began
    began = time.perf_counter()
    losses = [system.step()]
    compile_s = time.perf_counter() - began
    for _ in range(warmup):
        losses.append(system.step())
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        losses.append(system.step())
        times.append(time.perf_counter() - began)
    tokens_per_step = cfg.train.micro_batch_size * cfg.model.seq_length
    flops_per_token = model_flops_per_token(cfg.model)
    median_step = statistics.median(times) if times else None
    tokens_per_s = tokens_per_step / median_step if median_step else None
    return {
        "system": system_name,
        "framework": system.framework,
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * flops_per_token / 1e12 if tokens_per_s else None,
        "compile_s": compile_s,
        "build_s": build_s,
        "peak_rss_gib": peak_rss_gib(),
        "median_step_s": median_step,
        "step_times_s": times,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token,
        "params": system.params,
        "losses": losses,
        "layers": cfg.model.num_layers,
        "hidden": cfg.model.hidden_size,
        "warmup_steps": warmup,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = enter_peer_process(args, 1 + args.warmup + args.steps)
    load = os.getloadavg()[0]
    real_stdout = stdout_to_stderr()
    result = measure(args.system, cfg, args.steps, args.warmup)
    sys.stdout.flush()
    os.dup2(real_stdout, 1)
    result.update(
        core=args.core,
        threads=len(os.sched_getaffinity(0)),
        load_1m_before=load,
        load_1m_after=os.getloadavg()[0],
        config=args.config,
        overrides=args.overrides,
    )
    rate = f"{result['tokens_per_s']:.1f} tokens/s, {result['tflops']:.4f} TFLOP/s, " if result["tokens_per_s"] else ""
    emit(
        result,
        args.json,
        f"{args.system} ({result['framework']}), {cfg.model.num_layers} layers: {rate}"
        f"compile+first step {result['compile_s']:.2f} s, peak RSS {result['peak_rss_gib']:.2f} GiB",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
