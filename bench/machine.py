"""What the benchmark ran on: CPU, cores, memory, load, package versions, and GEMM peaks.

The MFU peak is MindSpore's one-core fp32 GEMM (mindscale.perf.gemm_peak, measured afresh in every
`make bench`). torch's GEMM on the same core is measured beside it: when torch's BLAS is faster than
MindSpore's CPU MatMul, that part of a gap to Hugging Face/torch cannot be closed in model code.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from mindscale.perf.gemm_peak import GEMM_SIZE, REPEATS, machine_key

PACKAGES = ("mindspore", "mindformers", "torch", "transformers", "numpy")
REPO = Path(__file__).resolve().parent.parent


def memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def describe() -> dict:
    return {
        "cpu": machine_key().rsplit(" x", 1)[0],
        "logical_cores": os.cpu_count(),
        "usable_cores": sorted(os.sched_getaffinity(0)),
        "memory_gib": memory_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions(),
    }


def torch_gemm_in_this_process(size: int = GEMM_SIZE, repeats: int = REPEATS) -> float:
    """fp32 GEMM TFLOP/s with torch, one thread, best of `repeats` (as mindscale.perf.gemm_peak does)."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def torch_gemm_tflops(core: int, timeout: float = 300) -> float:
    """torch's one-core GEMM in a child pinned to `core` (the caller's threads are left alone)."""
    code = (
        f"import os; os.sched_setaffinity(0, [{core}]); "
        "from bench.machine import torch_gemm_in_this_process as m; print(m())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"torch GEMM measurement failed: {tail}")
    return float(result.stdout.strip().splitlines()[-1])
