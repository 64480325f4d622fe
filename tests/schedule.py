"""How `make test`'s pytest-xdist workers share the suite (tests/conftest.py hooks these in): in work units
(`work_unit`), the longest first (`longest_first`), so that the workers finish together instead of one
running a long unit that happened to come last while the others wait."""

import json
from pathlib import Path


# modules whose costly module fixture is parametrized: a worker takes the tests of one parameter at a time
BY_PARAMETER = ("tests/dryrun/", "tests/models/test_generate.py")


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs together: a module, so its module-scoped fixtures are built once.
    In tests/dryrun/test_dryrun.py, whose compiles are shared by the whole session (tests/shared.py), a test
    alone; in the other dry-run modules, and in BY_PARAMETER's, the tests of one fixture parameter (one
    compiled layout whose IR a module fixture reads, one converted model: split over workers, each would
    build it again)."""
    module, _, test = nodeid.partition("::")
    if not module.startswith(BY_PARAMETER):
        return module
    if module.endswith("test_dryrun.py"):
        return nodeid
    return module + (test[test.index("[") :] if "[" in test else "")


# Seconds each work unit took in a full run (`make test` writes output/test-durations.json; copy it here to
# refresh). A unit not listed counts as its tests times its tier's typical seconds per test (a dry-run
# compile is about a minute, a process a quarter of one).
DURATIONS = Path(__file__).resolve().parent / "durations.json"
SECONDS_PER_TEST = {"dryrun": 60.0, "integration": 15.0, "bench": 15.0, "models": 3.0}


def unit_costs(items) -> dict[str, float]:
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    costs: dict[str, float] = {}
    for item in items:
        unit = work_unit(item.nodeid)
        tier = Path(str(item.fspath)).parent.name
        costs[unit] = costs.get(unit, 0.0) + SECONDS_PER_TEST.get(tier, 0.5)
    return {unit: known.get(unit, guess) for unit, guess in costs.items()}


def longest_first(items) -> None:
    """Sort the collected items in place: units by their cost, the longest first, each unit's tests together
    in their collected order."""
    costs, first = unit_costs(items), {}
    for i, item in enumerate(items):
        first.setdefault(work_unit(item.nodeid), i)
    items.sort(key=lambda it: (-costs[work_unit(it.nodeid)], first[work_unit(it.nodeid)]))
