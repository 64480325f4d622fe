"""Tests run on CPU, in four tiers (folders), with markers so a quick pass can skip processes:

    tests/unit         config, layout, FLOPs, planner, docs: no model is compiled
    tests/models       GPT/LLaMA built and compiled in this process (CPU, graph mode)
    tests/integration  processes: run_train.py, msrun workers, tools/ CLIs        (marker: integration)
    tests/dryrun       MindSpore's dry run of sharded twins, one process per rank  (markers: integration, dryrun)

`pytest -m "not integration" tests` is the quick pass; `make test` runs everything, bench/ included.
A CLI test in unit/ or models/ carries @pytest.mark.integration itself.
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.run_folder, tools.*: files of the checkout, not of the package
os.environ.setdefault("PYTHONPATH", str(ROOT))
os.environ.setdefault("GLOG_v", "3")

PROCESS_TIERS = {"integration": ("integration",), "dryrun": ("integration", "dryrun")}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in PROCESS_TIERS.get(Path(str(item.fspath)).parent.name, ()):
            item.add_marker(getattr(pytest.mark, marker))
