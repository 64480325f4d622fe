"""Tests run on CPU, in four tiers (folders), with markers so a quick pass can skip processes:

    tests/unit         config, layout, FLOPs, planner, docs: no model is compiled
    tests/models       GPT/LLaMA built and compiled in this process (CPU, graph mode)
    tests/integration  processes: run_train.py, msrun workers, tools/ CLIs        (marker: integration)
    tests/dryrun       MindSpore's dry run of sharded twins, one process per rank  (markers: integration, dryrun)

`pytest -m "not integration" tests` is the quick pass; `make test` runs everything, bench/ included.
A CLI test in unit/ or models/ carries @pytest.mark.integration itself.

Both run on pytest-xdist workers (`-n 2` quick, `-n 4` full: the Makefile), a worker taking a module at a time
(tests/schedule.py: the longest units first), so module fixtures are built once; dry-run compiles are shared
across workers through tests/shared.py, single-core runs pin to the worker's own core (tests/cores.py).
"""

import gc
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.run_folder, tools.*: files of the checkout, not of the package
os.environ.setdefault("PYTHONPATH", str(ROOT))
os.environ.setdefault("GLOG_v", "3")
# this process (pytest's rewritten test modules) and the Pythons tests start read the checkout's modules from
# bytecode caches (__pycache__, git-ignored), as a user's do: PYTHONDONTWRITEBYTECODE, set on some hosts, made each
# process compile them again (0.5 of the 2.2 CPU-s a run_train.py spent importing, 1.4 of a worker's collection)
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from tests import shared  # noqa: E402  (needs ROOT on sys.path)
from tests.schedule import longest_first, work_unit  # noqa: E402
from mindscale.train.loop.compile_cache import SHARED_DIR_ENV  # noqa: E402

PROCESS_TIERS = {"integration": ("integration",), "dryrun": ("integration", "dryrun")}


def pytest_collection_modifyitems(items):
    for item in items:
        for marker in PROCESS_TIERS.get(Path(str(item.fspath)).parent.name, ()):
            item.add_marker(getattr(pytest.mark, marker))
    # in xdist's workers, whose collection the scheduler hands out in order (their config.option.numprocesses
    # is None: a check on it never sorted anything)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        longest_first(items)


def pytest_collection_finish(session):
    """What collection imported (MindSpore, torch, transformers, every test module) stays for the session: frozen,
    the collector no longer walks it after each test's allocations."""
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadscope scheduling with the units of `work_unit`, in the collection's order (the
    longest first, above) instead of by their number of tests."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

    return WorkUnits(config, log)


_took: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _took[work_unit(report.nodeid)] = _took.get(work_unit(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
    """MINDSCALE_TEST_DURATIONS=<file> (`make test` sets it): each unit's seconds, for DURATIONS."""
    target = os.environ.get("MINDSCALE_TEST_DURATIONS")
    if target and _took and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps({u: round(t, 1) for u, t in sorted(_took.items())}, indent=0) + "\n")


@pytest.fixture(scope="session", autouse=True)
def session_shared_folder(tmp_path_factory):
    """tests/shared.py's folder: the session's temporary root, which every xdist worker's own is inside."""
    base = tmp_path_factory.getbasetemp()
    shared.ROOT = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    # runs of one graph load its compile from the session's cache (compile_cache.py; a test that checks the
    # run folder's own cache removes this from its runs' environment)
    os.environ.setdefault(SHARED_DIR_ENV, str(shared.ROOT / "compile_cache"))
