"""The CPU "peak" for MFU: a measured fp32 GEMM on one core, cached per machine (docs/mfu.md).

A CPU has no datasheet peak that MindSpore can reach, and on CPU "a device" is one worker pinned
to one core, so the peak per device is what a large fp32 MatMul achieves with MindSpore on one
core. It is measured once in a child process (pinned with sched_setaffinity, one operator thread,
so the caller's MindSpore context is untouched) and cached in
`$XDG_CACHE_HOME/mindscale/cpu_peak.json` (default ~/.cache/...), keyed by CPU model and core count.

    python -m mindscale.perf.gemm_peak            # print the cached peak (measure if missing)
    python -m mindscale.perf.gemm_peak --remeasure
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from mindscale.config import REPO_ROOT
from mindscale.io import write_atomically

GEMM_SIZE = 1024  # 2·n³ ≈ 2.1 GFLOP per MatMul: long enough to time, short enough for a shared core
REPEATS = 5  # best of: the machine is shared, the fastest run is the least disturbed


def cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mindscale" / "cpu_peak.json"


def machine_key() -> str:
    """CPU model name and logical core count: a cached peak is only reused on the same kind of machine."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{os.cpu_count()}"


CHAIN = 8  # MatMuls per compiled call: per-call launch overhead is amortised as in a training graph


class _MatMulChain:
    """Built lazily so importing this module does not import MindSpore."""

    @staticmethod
    def build():
        from mindspore import nn, ops

        class MatMulChain(nn.Cell):
            def __init__(self):
                super().__init__()
                self.matmul = ops.MatMul()

            def construct(self, a, b):
                x = self.matmul(a, b)
                for _ in range(CHAIN - 1):
                    x = self.matmul(x, b)
                return x

        return MatMulChain()


def measure_in_this_process(size: int = GEMM_SIZE, repeats: int = REPEATS) -> float:
    """fp32 GEMM TFLOP/s with MindSpore on the core(s) this process may use, one operator thread.

    Graph mode, as training runs: a PyNative MatMul measured 40% lower here (0.048 vs 0.080
    TFLOP/s on one EPYC core) because each call pays the eager dispatch.
    """
    import numpy as np
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(1)
    rng = np.random.default_rng(0)
    scale = 1.0 / size  # keeps the chained products finite
    a = ms.Tensor(rng.random((size, size), dtype=np.float32) * scale)
    b = ms.Tensor(rng.random((size, size), dtype=np.float32) * scale)
    chain = _MatMulChain.build()
    chain(a, b).asnumpy()  # compile, warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        chain(a, b).asnumpy()
        best = min(best, time.perf_counter() - start)
    return CHAIN * 2 * size**3 / best / 1e12


def measure(size: int = GEMM_SIZE, repeats: int = REPEATS, timeout: float = 300) -> float:
    """Measure in a child process pinned to one core (the caller's affinity and context are kept)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_v": "3"}
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from mindscale.perf.gemm_peak import measure_in_this_process as m; "
        f"print(m({size}, {repeats}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"CPU GEMM peak measurement failed: {tail}")
    return float(result.stdout.strip().splitlines()[-1])


def cpu_peak_tflops(remeasure: bool = False) -> float:
    """The cached one-core fp32 GEMM peak of this machine in TFLOP/s, measured on first use."""
    path, key = cache_path(), machine_key()
    cache = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}  # a corrupt cache is re-measured and rewritten
    entry = cache.get(key)
    if entry and not remeasure:
        return float(entry["tflops"])
    tflops = measure()
    cache[key] = {
        "tflops": tflops,
        "gemm": f"{CHAIN} chained {GEMM_SIZE}x{GEMM_SIZE} fp32 MatMuls, graph mode, 1 core, best of {REPEATS}",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(cache, indent=1))
    return tflops


def device_peak_tflops(cfg, cores: int = 1) -> float:
    """The peak of one device: the hardware profile's, or on CPU (a null peak) the cached one-core GEMM
    peak times the cores a worker may run on (a worker pinned to one core by the launchers is one device)."""
    if cfg.hardware.peak_tflops is not None:
        return cfg.hardware.peak_tflops
    return cpu_peak_tflops() * cores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remeasure", action="store_true", help="measure again and overwrite the cache")
    args = parser.parse_args(argv)
    peak = cpu_peak_tflops(args.remeasure)
    print(f"{peak:.4f} TFLOP/s per core (fp32 GEMM, {machine_key()}; cache {cache_path()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
