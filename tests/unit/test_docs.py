"""Generated docs are current: README's scale-config table and docs/config.md come from commands."""
import pytest
import importlib.util

from mindscale.config import REPO_ROOT, reference_markdown
from tests.unit.test_planner import readme_table

spec = importlib.util.spec_from_file_location("update_docs", REPO_ROOT / "scripts" / "update_docs.py")
update_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(update_docs)


def test_readme_table_is_generated():
    readme = (REPO_ROOT / "README.md").read_text()
    assert update_docs.with_table(readme, readme_table()) == readme, "run `make docs`"


def test_config_reference_is_generated():
    assert (REPO_ROOT / "docs" / "config.md").read_text() == reference_markdown() + "\n", "run `make docs`"


def test_readme_first_screen_has_the_two_commands():
    first_screen = "\n".join((REPO_ROOT / "README.md").read_text().splitlines()[:25])
    assert "make demo" in first_screen and "make test" in first_screen
