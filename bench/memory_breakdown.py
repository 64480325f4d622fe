"""Where one stack's peak host memory goes on the peer config, phase by phase, in this process.

    python bench/memory_breakdown.py --system mindscale|mindformers|hf [--steps N] [--core C]
        [--config bench/llama_peer.yaml] [--set k=v ...] [--maps N] [--kernels] [--json]

The process is set up exactly as bench/bench_train.py sets it up (pinned to one core, one operator
thread, the same builders from bench/systems.py), then runs these phases. Before each phase the
kernel's peak-RSS counter is reset (`echo 5 > /proc/self/clear_refs`), so every row's `peak` is the
exact high-water mark *within* that phase, not a sampled one:

    python      the interpreter, numpy and MindScale's config modules (no framework yet)
    import      `import mindspore` (mindformers: + mindformers) or `import torch, transformers`
    build       the builder: runtime setup, model, optimizer state, the fixed batch (no compile)
    compile     MindSpore only: the train cell's `compile(*inputs)`, the graph compile on its own
    step 1      the first optimizer step (for hf, which compiles nothing, its first step)
    steps       `--steps` more steps (default 2): the steady state

Columns (GiB): `rss` at the end of the phase, and of it `anon` (heap, arenas, dirtied library data)
and `file` (library text and read-only data, mapped files); `peak` in the phase; `heap used` and
`heap free` are glibc's `mallinfo2()` (bytes malloc has handed out, and bytes it holds free inside
its arenas; free memory that malloc keeps is resident and counted in rss until `malloc_trim`).
`--maps N` adds the N largest groups of /proc/self/smaps at the end (by library or mapping kind).
`--kernels` (MindSpore) dumps the compiled kernel graph (MS_DEV_SAVE_GRAPHS, which slows the
compile) and lists the binary arithmetic kernels (Mul, Add, Sub, RealDiv, ...) whose inputs differ
in shape with neither a single element: MindSpore's CPU kernel for them builds two index vectors
of 8 bytes per output element on its first launch and keeps them as long as the graph lives.
The `tensors` lines are what the model's own state needs: parameters, gradients, the two AdamW
moments (4 bytes each in fp32), and an activation estimate for one micro batch
(mindscale.perf.planner.layer_activation_bytes times layers, plus the logits and their gradient).

Memory: on the peer config (one core, MindSpore 2.9.0) MindScale's peak is the first step's. It was
3.63 GiB, 1.84 GiB of it the broadcast kernels' index vectors that `--kernels` listed (86 kernels);
since models/cpu_kernels.py gives every Add/Sub/Mul equal-shape inputs, `--kernels` lists none and
the peak is 1.96 GiB. bench/changes.md has the measurements.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import sys
import time
from collections import defaultdict

from bench.bench_train import WORK_DIR, add_peer_arguments, enter_peer_process, settle_peer_arguments, stdout_to_stderr
from mindscale.cli import OneLineParser, emit, fail

GIB = 2**30


def parse_args(argv):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add_peer_arguments(parser)
    parser.add_argument("--steps", type=int, default=2, help="steps after the first (default 2)")
    parser.add_argument("--maps", type=int, default=0, help="print the N largest /proc/self/smaps groups at the end")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="MindSpore: dump the kernel graph and sum the CPU broadcast kernels' index buffers",
    )
    args = settle_peer_arguments(parser.parse_args(argv))
    if args.kernels and args.system == "hf":
        fail("--kernels: only for the MindSpore systems (mindscale, mindformers)")
    if args.steps < 0 or args.maps < 0:
        fail(f"--steps {args.steps} --maps {args.maps}: must be >= 0")
    return args


# ----------------------------------------------------------------------------------------------
# What the kernel and malloc say


def status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
    return out


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def heap() -> dict:
    """glibc's view, over all arenas: bytes in use (small + mmapped chunks) and bytes held free."""
    if LIBC is None:
        return {}
    m = LIBC.mallinfo2()
    return {"heap_used": m.uordblks + m.hblkhd, "heap_free": m.fordblks, "heap_mmapped": m.hblkhd}


def _group(path: str, size: int) -> str:
    if not path:
        return "anon (no name, >= 64 MiB)" if size >= 64 * 2**20 else "anon (no name, < 64 MiB)"
    if path.startswith("["):
        return path
    name = os.path.basename(path)
    if "/mindspore/" in path or name.startswith(("libmindspore", "_c_expression", "_ms_")):
        return "mindspore libraries"
    if "/torch/" in path or "/torch.libs/" in path:
        return "torch libraries"
    if ".so" in name or "/python3" in path or name.startswith("python"):
        return "other libraries, python"
    return "other files"


def smaps_groups() -> dict:
    """Resident bytes of /proc/self/smaps by group, split into anonymous (private, dirtied) and file."""
    groups: dict = defaultdict(lambda: {"rss": 0, "anon": 0})
    current = None
    head = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
    with open("/proc/self/smaps") as f:
        for line in f:
            m = head.match(line)
            if m:
                size = int(m.group(2), 16) - int(m.group(1), 16)
                current = groups[_group(m.group(3).strip(), size)]
            elif line.startswith("Rss:"):
                current["rss"] += int(line.split()[1]) * 1024
            elif line.startswith("Anonymous:"):
                current["anon"] += int(line.split()[1]) * 1024
    return dict(groups)


KERNEL = re.compile(r"= PrimFunc_(\w+)\(")  # a kernel node of a kernel-graph IR, and its op
BROADCAST_OPS = {
    "Mul",
    "Add",
    "AddV2",
    "Sub",
    "RealDiv",
    "Div",
    "DivNoNan",
    "Maximum",
    "Minimum",
    "Pow",
    "SquaredDifference",
    "FloorDiv",
    "Mod",
    "FloorMod",
    "Atan2",
}


def broadcast_kernels(ir_text: str) -> list[dict]:
    """The CPU broadcast-path arithmetic kernels of a kernel-graph IR (graph_build_*.ir), each with
    the bytes its two index vectors keep (2 x size_t per output element)."""
    lines = ir_text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = KERNEL.search(line)
        if not m or m.group(1) not in BROADCAST_OPS or i + 1 >= len(lines):
            continue
        shapes = [
            tuple(int(d) for d in s.split(",") if d.strip())
            for s in re.findall(r"<Tensor\[\w+\], \(([\d, ]*)\)[^>]*>", lines[i + 1])
        ]
        if len(shapes) < 3:
            continue
        a, b, out = shapes[:3]
        if a == b or math.prod(a) == 1 or math.prod(b) == 1:
            continue
        scope = next(
            (
                re.sub(r"^.*Fullname with scope: \(", "", lines[j]).rstrip(")")
                for j in range(i + 1, min(i + 6, len(lines)))
                if "Fullname with scope" in lines[j]
            ),
            "",
        )
        found.append({"op": m.group(1), "inputs": [a, b], "output": out, "bytes": 16 * math.prod(out), "scope": scope})
    return found


def arithmetic_kernels(ir_text: str) -> int:
    """How many binary arithmetic kernels (BROADCAST_OPS) a kernel-graph IR holds, on the fast paths or not."""
    return sum(m.group(1) in BROADCAST_OPS for m in KERNEL.finditer(ir_text))


def kernel_summary(found: list[dict], arithmetic: int, top: int = 8) -> dict:
    """Broadcast kernels grouped by cell (layer numbers folded) and op/shape, largest first, among the
    `arithmetic` kernels read."""
    groups: dict = defaultdict(lambda: {"kernels": 0, "bytes": 0})
    for k in found:
        cell = re.sub(r"/[^/]*$", "", k["scope"])
        cell = re.sub(r"(CellList/)\d+-", r"\1*-", cell.replace("Default/", ""))
        g = groups[f"{cell} {k['op']} {k['inputs'][0]}x{k['inputs'][1]}"]
        g["kernels"] += 1
        g["bytes"] += k["bytes"]
    ordered = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])
    return {
        "arithmetic": arithmetic,
        "kernels": len(found),
        "bytes": sum(k["bytes"] for k in found),
        "largest": [{"where": name, **v} for name, v in ordered[:top]],
    }


# ----------------------------------------------------------------------------------------------
# The phases


class Phases:
    def __init__(self):
        self.rows = []
        self.resets = True

    def run(self, name: str, fn, *args):
        self.resets = reset_peak() and self.resets
        began = time.perf_counter()
        value = fn(*args)
        seconds = time.perf_counter() - began
        self.rows.append({"phase": name, "seconds": seconds, **_row_of(status()), **heap()})
        return value


def import_framework(system: str) -> None:
    if system == "hf":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    else:
        import mindspore  # noqa: F401

        if system == "mindformers":
            import mindformers  # noqa: F401


def tensor_bytes(cfg, params: int) -> dict:
    """What the model's state and one step's activations need at least (fp32)."""
    from mindscale.perf.planner import layer_activation_bytes, mindspore_dtypes

    m, b = cfg.model, cfg.train.micro_batch_size
    act = m.num_layers * layer_activation_bytes(
        m.seq_length,
        b,
        m.hidden_size,
        m.num_heads,
        m.kv_heads,
        m.ffn_hidden_size,
        mlp="swiglu" if m.spec.gated_mlp else "gelu",
        dtypes=mindspore_dtypes("float32"),
    )
    logits = b * m.seq_length * m.vocab_size * 4 * 2  # the logits and their softmax/gradient
    return {"params": 4 * params, "grads_and_adam_moments": 3 * 4 * params, "activations_estimate": act + logits}


def measure(system_name: str, cfg, steps: int) -> dict:
    phases = Phases()
    phases.rows.append({"phase": "python", "seconds": 0.0, **_row_of(status()), **heap()})
    phases.run("import", import_framework, system_name)
    from bench.systems import BUILDERS, fixed_batch

    system = phases.run("build", BUILDERS[system_name], cfg, fixed_batch(cfg))
    if system.compile is not None:
        phases.run("compile", system.compile)
    losses = [phases.run("step 1", system.step)]
    phases.run(
        f"steps 2-{steps + 1}" if steps else "steps", lambda: [losses.append(system.step()) for _ in range(steps)]
    )
    peak = max(r["peak"] for r in phases.rows)
    return {
        "system": system_name,
        "framework": system.framework,
        "phases": phases.rows,
        "peak": peak,
        "peak_phase": max(phases.rows, key=lambda r: r["peak"])["phase"],
        "compiled_separately": system.compile is not None,
        "peak_per_phase_exact": phases.resets,
        "losses": losses,
        "params": system.params,
        "tensors": tensor_bytes(cfg, system.params),
        "env": {
            k: os.environ[k]
            for k in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MS_ALLOC_CONF", "LD_PRELOAD")
            if k in os.environ
        },
    }


def _row_of(s: dict) -> dict:
    return {"rss": s["VmRSS"], "anon": s["RssAnon"], "file": s["RssFile"] + s["RssShmem"], "peak": s["VmHWM"]}


def render(result: dict, maps: dict | None = None) -> str:
    g = lambda v: f"{v / GIB:9.3f}" if v is not None else f"{'-':>9}"  # noqa: E731
    lines = [
        f"{result['system']} ({result['framework']}), {result['params'] / 1e6:.1f} M parameters; "
        f"peak {result['peak'] / GIB:.3f} GiB in phase {result['peak_phase']!r}",
        f"{'phase':<12}{'seconds':>9}{'rss':>9}{'anon':>9}{'file':>9}{'peak':>9}{'heap used':>11}{'heap free':>11}",
    ]
    for r in result["phases"]:
        lines.append(
            f"{r['phase']:<12}{r['seconds']:9.1f}{g(r['rss'])}{g(r['anon'])}{g(r['file'])}{g(r['peak'])}"
            f"  {g(r.get('heap_used'))}  {g(r.get('heap_free'))}"
        )
    t = result["tensors"]
    lines.append(
        "tensors (fp32): params {:.3f}, grads + 2 AdamW moments {:.3f}, one step's activations ~{:.3f} GiB".format(
            t["params"] / GIB, t["grads_and_adam_moments"] / GIB, t["activations_estimate"] / GIB
        )
    )
    if not result["peak_per_phase_exact"]:
        lines.append("note: /proc/self/clear_refs refused; each peak is the process's peak so far")
    if result.get("broadcast_kernels"):
        k = result["broadcast_kernels"]
        lines.append(
            f"CPU arithmetic kernels: {k['arithmetic']}, of them broadcasting: {k['kernels']}, their index "
            f"vectors {k['bytes'] / GIB:.3f} GiB" + ("; largest:" if k["largest"] else "")
        )
        lines.extend(f"  {g['bytes'] / GIB:6.3f} GiB {g['kernels']:3d}x {g['where']}" for g in k["largest"])
    if maps:
        lines.append(f"{'smaps group at the end':<32}{'rss':>9}{'anon':>9}")
        for name, v in sorted(maps.items(), key=lambda kv: -kv[1]["rss"]):
            lines.append(f"{name:<32}{g(v['rss'])}{g(v['anon'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = enter_peer_process(args, 1 + args.steps)
    ir_dir = WORK_DIR / "memory_breakdown_ir"
    if args.kernels:  # read when MindSpore is imported
        shutil.rmtree(ir_dir, ignore_errors=True)
        os.environ.update(MS_DEV_SAVE_GRAPHS="1", MS_DEV_SAVE_GRAPHS_PATH=str(ir_dir))
    real_stdout = stdout_to_stderr()
    result = measure(args.system, cfg, args.steps)
    if args.kernels:
        texts = [f.read_text() for f in sorted(ir_dir.rglob("graph_build_*.ir"))]
        result["broadcast_kernels"] = kernel_summary(
            [k for t in texts for k in broadcast_kernels(t)], sum(arithmetic_kernels(t) for t in texts)
        )
    result["smaps_at_end"] = (
        dict(sorted(smaps_groups().items(), key=lambda kv: -kv[1]["rss"])[: args.maps]) if args.maps else None
    )
    sys.stdout.flush()
    os.dup2(real_stdout, 1)
    emit(result, args.json, render(result, result["smaps_at_end"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
