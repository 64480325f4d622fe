import pytest

from tests.integration import tiny_runs


@pytest.fixture
def corpus():
    """tiny_runs.corpus(): built by the session's first test that asks, read by the others."""
    return tiny_runs.corpus()
