"""CANN stand-ins: the shared libraries MindSpore's Ascend plugin loads, so its dry run compiles on any host.

MindSpore's dry run (`MS_SIMULATION_LEVEL=0`, docs/dryrun.md) compiles one rank's semi-auto-parallel
graph without a device. It still loads the Ascend plugin, and the plugin links against CANN's
libraries (libascendcl, libhccl, libge_runner, ...). On a host without CANN, libraries with the
same names whose every function returns 0 let the plugin load; at level 0 none of them is asked
to compute anything. On a host with CANN installed the real libraries are used instead.

Built once per MindSpore install into `$XDG_CACHE_HOME/mindscale/dryrun-standins/<key>/cann/lib64`
(needs gcc and binutils' nm and strings):
  1. the undefined dynamic symbols of every plugin library, minus those MindSpore itself, libc,
     libm, libstdc++, libgcc_s and libgomp define, plus the identifiers the plugin looks up with
     dlsym (acl*, hccl*, rt*, Msprof*, ... found by `strings`);
  2. one C file defining each as `long f(void) { return 0; }` (vtables and typeinfo as zeroed data),
     except the functions that build a `ge::Operator` (OPERATOR_BUILDERS), which zero it;
  3. compiled once per library name.

Two folder names are MindSpore's rules. The plugin looks for `<folder of libascendcl.so>/../lib64/...`
and `lib64/driver/libascend_hal.so`, so the libraries sit in `lib64`. And it finds CANN's root by cutting
the path of the loaded libascendcl.so after its last "cann" or "latest" (GetAscendPath in MindSpore's
`res_manager/symbol_interface/symbol_utils.cc`); at level 1 (device memory, docs/dryrun.md) it loads
`<root>/lib64/libascendcl.so` from there, and a root that does not exist fails as "aclInit is null". So
`lib64` sits in a folder named `cann`, and no other part of the path after it says "cann" or "latest".
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mindscale.config import UserError

LIBRARIES = (
    "libacl_dvpp",
    "libacl_dvpp_mpi",
    "libacl_dvpp_op",
    "libacl_op_compiler",
    "libacl_tdt_channel",
    "libascend_hal",
    "libascendalog",
    "libascendcl",
    "libatb",
    "libc_sec",
    "libge_runner",
    "libgraph",
    "libhccl",
    "libmmpa",
    "libmsprofiler",
    "libnnopbase",
    "libplatform",
    "libprofapi",
    "libregister",
    "libruntime",
)
SYSTEM_LIBRARIES = ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libgomp.so.1")
# a whitespace-separated word of `strings` output that names a CANN function
DLSYM_NAMES = re.compile(
    r"(?<!\S)((?:acl|Acl|hccl|Hccl|rt[A-Z]|Msprof|Nnopbase|hal[A-Z]|drv[A-Z]|prof[A-Z]|mstx|"
    r"Mstx|dcmi|Dlog|Alog|atb|Atb|lccl|Lccl)\w*)(?!\S)"
)
TOOLS = ("gcc", "nm", "strings")


class StandinError(UserError):
    """The stand-ins cannot be built here (a missing tool); the message names the fix."""


def mindspore_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.origin:
        raise StandinError("mindspore is not installed; install requirements.txt")
    return Path(spec.origin).parent


def libgomp() -> str:
    """The system libgomp: MindSpore's Ascend plugin needs it loaded before Python starts (LD_PRELOAD)."""
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        path = Path(folder) / "libgomp.so.1"
        if path.is_file():
            return str(path)
    raise StandinError("libgomp.so.1 not found; install gcc's runtime (Debian: apt-get install libgomp1)")


def jemalloc() -> str | None:
    """jemalloc, if the host has it (Debian: libjemalloc2). MindSpore's graph compiler spends about a sixth of a
    dry run's CPU in glibc's malloc and free; with jemalloc preloaded a 64-stage twin's rank compiled in 26 s
    instead of 32 (docs/dryrun.md). CANN's own guide recommends it on Ascend hosts."""
    found = _system_library("libjemalloc.so.2")
    return str(found) if found else None


def _system_library(name: str) -> Path | None:
    for folder in (
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/lib64",
        "/usr/lib64",
    ):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def _symbols(path: Path, which: str) -> set[str]:
    out = subprocess.run(["nm", "-D", which, str(path)], capture_output=True, text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.split()}


def plugin_libraries(ms: Path) -> list[Path]:
    return sorted(p for p in (ms / "lib" / "plugin").rglob("*.so*") if p.is_file() and not p.is_symlink())


def needed_symbols(ms: Path) -> list[str]:
    """Every name the Ascend plugin needs from CANN (step 1 of the module docstring)."""
    plugin = plugin_libraries(ms)
    providers = [*plugin, *(p for p in (ms / "lib").glob("*.so*") if p.is_file())]
    providers += [p for p in map(_system_library, SYSTEM_LIBRARIES) if p is not None]
    with ThreadPoolExecutor() as pool:  # ~280 nm/strings runs: 43 s one at a time on 2 cores
        defined = pool.map(lambda p: _symbols(p, "--defined-only"), providers)
        undefined = pool.map(lambda p: _symbols(p, "--undefined-only"), plugin)
        looked_up = pool.map(
            lambda p: DLSYM_NAMES.findall(subprocess.run(["strings", str(p)], capture_output=True, text=True).stdout),
            plugin,
        )
        defined = set().union(*defined)
        wanted = set().union(*undefined, *map(set, looked_up))
    return sorted(n for n in wanted - defined if re.fullmatch(r"[A-Za-z_][\w.$]*", n) and not n.startswith("__"))


# The functions that make a ge::Operator (24 bytes: a vtable pointer and a shared_ptr to its implementation):
# ge::OperatorFactory::CreateOperator returns one by value, i.e. into memory its caller passes as the
# first argument, and the constructors build one at `this`. MindSpore's aclop kernels (ReduceSum, AddN,
# StridedSlice, Gather, OneHot, RealDiv, ...) make one when a level-1 dry run resizes them and copy its
# shared_ptr; left uninitialised, that copy segfaults. Zeroed, it is an empty shared_ptr.
GE_OPERATOR_BYTES = 24
OPERATOR_BUILDERS = re.compile(r"_ZN2ge15OperatorFactory14CreateOperatorE\w*|_ZN2ge8OperatorC[12]E\w*")


def c_source(names: list[str]) -> str:
    """Each name a function returning 0; C++ vtables/typeinfo (_ZTV/_ZTI/_ZTS) as zeroed data; the builders
    of a ge::Operator (OPERATOR_BUILDERS) zero the object their first argument points at and return it."""
    lines = ["#include <string.h>"]
    for i, name in enumerate(names):
        if name.startswith(("_ZTV", "_ZTI", "_ZTS")):
            lines.append(f'char d{i}[512] __asm__("{name}") = {{0}};')
        elif OPERATOR_BUILDERS.fullmatch(name):
            lines.append(
                f'void *f{i}(void *made) __asm__("{name}");\n'
                f'void *f{i}(void *made) {{ return memset(made, 0, {GE_OPERATOR_BYTES}); }}'
            )
        else:
            lines.append(f'long f{i}(void) __asm__("{name}");\nlong f{i}(void) {{ return 0; }}')
    return "\n".join(lines) + "\n"


def cache_key(ms: Path) -> str:
    """MindSpore's version and plugin build: the stand-ins follow the plugin they were made for."""
    digest = hashlib.sha256()
    for path in plugin_libraries(ms):
        stat = path.stat()
        digest.update(f"{path.relative_to(ms)}:{stat.st_size}".encode())
    version = re.search(r"__version__ = '([^']+)'", (ms / "version.py").read_text())
    return f"mindspore-{version.group(1) if version else 'unknown'}-{digest.hexdigest()[:12]}"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mindscale" / "dryrun-standins"


def build(lib64: Path, ms: Path) -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise StandinError(
            f"building the CANN stand-ins for the dry run needs {', '.join(missing)}; "
            "install gcc and binutils (Debian: apt-get install gcc binutils)"
        )
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=lib64.parent.parent))
    try:
        source = staging / "standins.c"
        source.write_text(c_source(needed_symbols(ms)))
        out = staging / "lib64"
        (out / "driver").mkdir(parents=True)
        objects = staging / "standins.o"
        commands = [(["gcc", "-c", "-fPIC", "-O0", "-o", str(objects), str(source)], "standins.o")]  # compiled once
        commands += [
            (["gcc", "-shared", f"-Wl,-soname,{name}.so", "-o", str(out / f"{name}.so"), str(objects)], f"{name}.so")
            for name in LIBRARIES
        ]  # linked under every library name
        for argv, made in commands:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                first = (done.stderr.strip().splitlines() or ["no output"])[0]
                raise StandinError(f"gcc could not build the stand-in {made} ({first}); check the gcc install")
        shutil.copy(out / "libascend_hal.so", out / "driver" / "libascend_hal.so")
        if not (lib64 / "libascendcl.so").is_file():
            shutil.rmtree(lib64.parent, ignore_errors=True)  # a folder left by a killed build of an older layout
            try:
                os.rename(staging, lib64.parent)  # atomic: a concurrent builder's result wins, ours is dropped
            except OSError:
                pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cann_lib64() -> Path:
    """The lib64 folder to put first on LD_LIBRARY_PATH: real CANN's when installed, else the stand-ins."""
    real = os.environ.get("ASCEND_HOME_PATH")
    if real and (Path(real) / "lib64" / "libascendcl.so").is_file():
        return Path(real) / "lib64"
    ms = mindspore_dir()
    lib64 = cache_root() / cache_key(ms) / "cann" / "lib64"
    if not (lib64 / "libascendcl.so").is_file():
        print(f"building the CANN stand-ins for the dry run once, into {lib64.parent}", file=sys.stderr, flush=True)
        lib64.parent.parent.mkdir(parents=True, exist_ok=True)
        build(lib64, ms)
    return lib64


def dryrun_environment(base: dict, rank: int, world: int, level: int = 0) -> dict:
    """The environment a dry-run process must start with (the loader reads it before Python runs): MindSpore's
    dry run at `level` (0: compile; 1: and plan device memory, docs/dryrun.md)."""
    ms = mindspore_dir()
    lib64 = cann_lib64()
    paths = [str(lib64), str(ms / "lib"), str(ms / "lib" / "plugin"), str(ms / "lib" / "plugin" / "ascend")]
    if base.get("LD_LIBRARY_PATH"):
        paths.append(base["LD_LIBRARY_PATH"])
    preload: dict[str, str] = {}  # each library once (the caller may preload jemalloc too, by another path)
    for path in filter(None, [libgomp(), jemalloc(), *re.split(r"[\s:]+", base.get("LD_PRELOAD", ""))]):
        preload.setdefault(os.path.realpath(path), path)
    return {
        **base,
        "LD_LIBRARY_PATH": ":".join(paths),
        "LD_PRELOAD": " ".join(preload.values()),
        "MS_SIMULATION_LEVEL": str(level),
        "RANK_SIZE": str(world),
        "RANK_ID": str(rank),
        "GLOG_v": base.get("GLOG_v", "3"),
    }


if __name__ == "__main__":
    print(cann_lib64())
    sys.exit(0)
