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
