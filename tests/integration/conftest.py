import pytest

from tests.integration import tiny_runs, two_nodes


@pytest.fixture
def corpus():
    """tiny_runs.corpus(): built by the session's first test that asks, read by the others."""
    return tiny_runs.corpus()


@pytest.fixture
def two_namespaces():
    """Two network namespaces, one per node (tests/integration/two_nodes.py)."""
    yield from two_nodes.namespaces()
