"""MindSpore's compile cache for the train step (run.compile_cache), per rank, inside the run folder.

A relaunch or a `--max-restarts` restart of an unchanged graph loads the step's compiled front end from
`<run>/compile_cache/<key>/rank_<r>/graph_cache/` instead of compiling it again (MindSpore then runs
only its backend actions). MindSpore itself checks only a hash of the entry script and of the files it
finds imported from it outside sys.path (the repository is on sys.path, so none of ours), and it
numbers cached graphs by their order of compilation in the process. Hence three rules:

- The key, the folder's name, is a hash of everything the graph is made of: every source file of
  mindscale/ and models/, the resolved config less the keys that cannot reach the graph
  (NOT_IN_GRAPH), the device target and MindSpore's version. A change of any of them compiles into a
  fresh folder; this rank's folders of other keys are deleted.
- Only the step graph is cached, compiled first and on its own (`compiling`): the small graphs compiled
  later (a save's commit vote, validation) come in an order that depends on the step a run resumes
  from, and MindSpore would hand graph n's cache to whatever is compiled n-th.
- The step's parameter layouts are kept beside the cache (LAYOUTS_FILE) when it compiles, and completed from
  them when it loads: MindSpore 2.9's cached graph comes back with each parameter_layout_dict entry's full
  shape and the field after it empty, and a sharded restore computes every slice a rank reads from the full
  shape (models/weights.py). Every other field must equal the kept one (completed_layouts).

Hit or miss is read from the cache file: a compile that loaded it leaves it untouched, one that
compiled writes it anew. docs/evidence/launch.md has the measurements.

MINDSCALE_COMPILE_CACHE_DIR=<folder> puts the `<key>/rank_<r>/` folders there instead of in the run folder,
so that runs of one graph share them (a sweep of runs; the test suite shares one folder per session). Jobs
may then compile one key at once: a rank holds an exclusive lock on its folder while it compiles, so the
second waits and loads what the first wrote. Nothing is pruned from a shared folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from mindscale.config import REPO_ROOT, Config, Layout, UserError
from mindscale.io import write_atomically

CACHE_DIR = "compile_cache"
LAYOUTS_FILE = "parameter_layouts.json"  # beside graph_cache/ in each rank's folder: the compiled step's layouts
SHARED_DIR_ENV = "MINDSCALE_COMPILE_CACHE_DIR"
ENABLE_ENV, PATH_ENV = "MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH"
SOURCE_PACKAGES = ("mindscale", "models")
# config keys that cannot change the compiled step: the run's name and folder, what the launcher and the
# loggers read, and checkpoints (the step's weights are its inputs, not its graph). Anything else counts.
NOT_IN_GRAPH = {
    "run": (
        "name",
        "output_dir",
        "tensorboard",
        "max_restarts",
        "hang_timeout_s",
        "stop_vote_interval",
        "compile_cache",
    ),
    "train": ("log_interval",),
    "checkpoint": None,  # the whole section
    "profile": None,
}


def graph_config(cfg: Config) -> dict:
    """The resolved config without NOT_IN_GRAPH."""
    tree = cfg.to_dict()
    for section, keys in NOT_IN_GRAPH.items():
        if keys is None:
            tree.pop(section, None)
        else:
            for key in keys:
                tree[section].pop(key, None)
    return tree


def sources_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over every .py file of SOURCE_PACKAGES, by path and content."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(cfg: Config, device: str, mindspore_version: str, sources: str | None = None) -> str:
    """The cache folder's name: 16 hex digits of sha256(sources, graph config, device, MindSpore version)."""
    digest = hashlib.sha256()
    for part in (
        sources or sources_digest(),
        yaml.safe_dump(graph_config(cfg), sort_keys=True),
        device,
        mindspore_version,
    ):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


@dataclass
class Compiled:
    """How the step compiled: seconds, and `cache` hit (loaded), miss (compiled and saved) or off."""

    seconds: float = 0.0
    cache: str = "off"


ENTRY_SKIP = (
    "MindSpore hashes the entry script {script!r} into the cache and cannot open it from the working "
    "directory it was imported in; run the script by a path valid there"
)


def _unreadable_entry_script() -> str | None:
    """sys.argv[0] when MindSpore cannot open it to hash it: it resolves it against the working directory
    when it is imported (mindspore/graph/api.py), and a cached compile then fails on the missing file
    (a `python -c` run, or a script that changed directory before importing MindSpore)."""
    script = sys.argv[0] if sys.argv else ""
    return script if script and not os.path.isfile(os.path.realpath(script)) else None


class CompileCache:
    """This rank's cache folder, or none (`folder` None) when run.compile_cache is off, the mode has no
    graph to cache (PyNative) or the layout is sharded (`skipped` says why)."""

    def __init__(self, folder: Path | None, rank: int, skipped: str | None = None):
        self.folder, self.rank, self.skipped = folder, rank, skipped

    @classmethod
    def of(cls, cfg: Config, layout: Layout, run_dir: Path, device: str, rank: int) -> "CompileCache":
        if not cfg.run.compile_cache or cfg.run.mode != "graph":
            return cls(None, rank)
        if _unreadable_entry_script():
            return cls(None, rank, ENTRY_SKIP.format(script=_unreadable_entry_script()))
        import mindspore as ms

        shared = os.environ.get(SHARED_DIR_ENV)
        root = Path(shared).absolute() if shared else Path(run_dir).absolute() / CACHE_DIR
        key = cache_key(cfg, device, ms.__version__)
        for stale in [] if shared else root.glob("*"):
            if stale.name != key:  # this rank's cache of another key; its folder goes with the last rank
                shutil.rmtree(stale / f"rank_{rank}", ignore_errors=True)
                try:
                    stale.rmdir()
                except OSError:
                    pass
        return cls(root / key, rank)

    def layouts_file(self) -> Path:
        return self.folder / f"rank_{self.rank}" / LAYOUTS_FILE

    def graph_file(self) -> Path | None:
        """MindSpore's cache of the first graph compiled (the step), named by the process's role under
        msrun (MS_WORKERcompile_cache_0.mindir) or not."""
        found = sorted((self.folder / f"rank_{self.rank}" / "graph_cache").glob("*compile_cache_0.mindir"))
        return found[0] if found else None

    @contextmanager
    def compiling(self, step):
        """Around the step's compile, the first of the process: MindSpore's cache on for it alone
        (MS_COMPILER_CACHE_ENABLE is read at each compile), then the step's parameter layouts kept (a compile)
        or completed (a load), and `Compiled` filled in."""
        result = Compiled()
        began = time.perf_counter()
        if self.folder is None:
            yield result
            result.seconds = time.perf_counter() - began
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank_{self.rank}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another job compiling this key and rank writes its cache now
            if self.graph_file() is not None and not self.layouts_file().exists():
                # a compile killed before its layouts were kept: its graph cannot be completed, so compile again
                shutil.rmtree(self.folder / f"rank_{self.rank}" / "graph_cache")
            before = _stamp(self.graph_file())
            os.environ[PATH_ENV], os.environ[ENABLE_ENV] = str(self.folder), "1"
            try:
                yield result
            finally:
                os.environ[ENABLE_ENV] = "0"
            result.cache = "hit" if before is not None and before == _stamp(self.graph_file()) else "miss"
            if result.cache == "hit":
                try:
                    kept = json.loads(self.layouts_file().read_text())
                except ValueError as exc:  # written atomically: only a copy or an edit can truncate it
                    raise _mismatch(self.folder, f"{self.layouts_file().name} is unreadable ({exc})") from None
                step.parameter_layout_dict = completed_layouts(step.parameter_layout_dict, kept, self.folder)
            else:
                self.layouts_file().parent.mkdir(exist_ok=True)
                write_atomically(self.layouts_file(), json.dumps(_plain(step.parameter_layout_dict)))
            result.seconds = time.perf_counter() - began


def completed_layouts(loaded: dict, kept: dict, folder: Path) -> dict:
    """The layouts of a step loaded from the cache, as it compiled: the `kept` ones, once every field the load
    restored equals them. MindSpore 2.9's load leaves the full shape and the field after it empty, and appends
    a field the compile does not give (the optimizer shard's slice shape); any other difference means the
    folder does not hold what this graph compiled to."""
    out = {}
    for name in sorted(set(loaded) | set(kept)):
        if name not in loaded or name not in kept:
            raise _mismatch(folder, f"parameter {name} is in one of the loaded and the compiled graph only")
        restored, compiled = _plain(loaded[name]), kept[name]
        if len(restored) < len(compiled):
            raise _mismatch(folder, f"{name}'s layout has {len(restored)} fields, {len(compiled)} compiled")
        for i, (got, want) in enumerate(zip(restored, compiled)):
            if got != want and got != []:
                raise _mismatch(folder, f"{name}'s layout field {i} is {got}, {want} compiled")
        out[name] = type(loaded[name])(compiled)
    return out


def _mismatch(folder: Path, what: str) -> UserError:
    return UserError(f"compile cache {folder}: {what}; remove the folder or set run.compile_cache=false")


def _plain(value):
    """JSON's view of a layout: tuples as lists, all the way down."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _stamp(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    st = path.stat()
    return st.st_ino, st.st_mtime_ns
