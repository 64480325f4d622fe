"""Generated docs are current: README's scale-config table, docs/config.md and the configs' save intervals come
from commands."""

import importlib.util

from mindscale.config import REPO_ROOT, reference_markdown
from tests.unit.test_planner import readme_table

spec = importlib.util.spec_from_file_location("update_docs", REPO_ROOT / "scripts" / "update_docs.py")
update_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(update_docs)


def test_readme_table_is_generated():
    readme = (REPO_ROOT / "README.md").read_text()
    assert update_docs.with_table(readme, readme_table()) == readme, "run `make docs`"


def test_every_shipped_config_saves_at_the_planners_goodput_optimum():
    stale = {
        path.stem: update_docs.best_save_interval(path)
        for path in update_docs.shipped_configs()
        if update_docs.with_save_interval(path.read_text(), update_docs.best_save_interval(path)) != path.read_text()
    }
    assert not stale, f"run `make docs`: {stale}"


def test_layouts_quote_the_planners_figures_today():
    layouts = (REPO_ROOT / "docs" / "layouts.md").read_text()
    figures = {path.stem: update_docs.layout_figures(path) for path in update_docs.shipped_configs()}
    assert update_docs.with_layout_figures(layouts, figures) == layouts, "run `make docs`"


def test_config_reference_is_generated():
    assert (REPO_ROOT / "docs" / "config.md").read_text() == reference_markdown() + "\n", "run `make docs`"


def test_readme_first_screen_has_the_two_commands():
    first_screen = "\n".join((REPO_ROOT / "README.md").read_text().splitlines()[:25])
    assert "make demo" in first_screen and "make test" in first_screen


def requirement_pins(name):
    """Package -> pinned version of a requirements file and the files it includes (`-r`)."""
    pins = {}
    for line in (REPO_ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            pins.update(requirement_pins(line[3:].strip()))
        elif "==" in line:
            package, version = line.split("==")
            pins[package.strip().lower()] = version.strip()
    return pins


def test_commands_the_docs_give_users_are_installed_by_a_target_they_name():
    """`tensorboard --logdir` and reloading an export in transformers (torch) are what a user runs beside
    training: `make extras` installs them (requirements-extras.txt), torch pinned to the CPU wheel."""
    extras = requirement_pins("requirements-extras.txt")
    assert extras["tensorboard"] and extras["torch"] == "2.13.0"
    assert "tensorboard" not in requirement_pins("requirements.txt")
    assert set(extras.items()) <= set(requirement_pins("requirements-dev.txt").items())
    assert "\nextras: $(VENV)/.extras" in (REPO_ROOT / "Makefile").read_text()
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        if "tensorboard --logdir" in text:
            assert "make extras" in text, f"{page.name} runs tensorboard without saying `make extras` installs it"
