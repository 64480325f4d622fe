"""`make test`'s workers take the longest work units first (tests/schedule.py), so that no long unit starts
last: pytest-xdist hands the units out in the order of its workers' collection."""

import itertools
import os

import pytest

from tests.schedule import unit_costs, work_unit


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="the order is for xdist's scheduler")
def test_xdist_workers_collect_the_longest_units_first_each_in_one_piece(request):
    units = [work_unit(item.nodeid) for item in request.session.items]
    runs = [unit for unit, _ in itertools.groupby(units)]
    assert len(runs) == len(set(units)), "a unit's tests are split"
    costs = unit_costs(request.session.items)
    assert [costs[u] for u in runs] == sorted((costs[u] for u in runs), reverse=True)


def test_every_test_module_has_a_basename_of_its_own():
    """The test folders are not packages: pytest imports each module by its basename, and a second module of the
    same name stops the whole collection ("import file mismatch")."""
    from mindscale.config import REPO_ROOT

    names = [path.name for folder in ("tests", "bench") for path in (REPO_ROOT / folder).rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
