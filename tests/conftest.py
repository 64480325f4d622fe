"""Tests run on CPU, in four tiers (folders), with markers so a quick pass can skip processes:

    tests/unit         config, layout, FLOPs, planner, docs: no model is compiled
    tests/models       GPT/LLaMA built and compiled in this process (CPU, graph mode)
    tests/integration  processes: run_train.py, msrun workers, tools/ CLIs        (marker: integration)
    tests/dryrun       MindSpore's dry run of sharded twins, one process per rank  (markers: integration, dryrun)

`pytest -m "not integration" tests` is the quick pass; `make test` runs everything, bench/ included.
A CLI test in unit/ or models/ carries @pytest.mark.integration itself.

Both run on two pytest-xdist workers (`-n 2`, the Makefile), a worker taking a module at a time
(`work_unit`: a dry-run test alone), so module fixtures are built once; dry-run compiles are shared
across workers through tests/shared.py, single-core runs pin to the worker's own core (tests/cores.py).
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.run_folder, tools.*: files of the checkout, not of the package
os.environ.setdefault("PYTHONPATH", str(ROOT))
os.environ.setdefault("GLOG_v", "3")

from tests import shared  # noqa: E402  (needs ROOT on sys.path)

PROCESS_TIERS = {"integration": ("integration",), "dryrun": ("integration", "dryrun")}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in PROCESS_TIERS.get(Path(str(item.fspath)).parent.name, ()):
            item.add_marker(getattr(pytest.mark, marker))


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs together: a module, so its module-scoped fixtures are built once;
    in tests/dryrun, whose module fixtures only read the session's shared compiles (tests/shared.py),
    a test alone, or in test_input_rows.py the tests of one compiled layout (the fixture's parameter)."""
    module, _, test = nodeid.partition("::")
    if not module.startswith("tests/dryrun/"):
        return module
    if module.endswith("test_input_rows.py"):
        return module + test[test.index("["):]
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadscope scheduling (the biggest units first), with the units of `work_unit`."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

    return WorkUnits(config, log)


@pytest.fixture(scope="session", autouse=True)
def session_shared_folder(tmp_path_factory):
    """tests/shared.py's folder: the session's temporary root, which every xdist worker's own is inside."""
    base = tmp_path_factory.getbasetemp()
    shared.ROOT = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
