"""Regenerate the generated parts of the docs and configs (`make docs`): the config key reference, the README's
scale-config table, the planner's figures in each "* Layout:" line of docs/layouts.md, and each shipped scale
config's `checkpoint.save_interval`, the planner's goodput optimum (docs/planner.md, "Goodput").
tests/unit/test_docs.py fails when they are stale."""

import re
import subprocess
import sys
from pathlib import Path

from mindscale.config import load_config, reference_markdown
from mindscale.perf.planner import plan
from mindscale.perf.planner.text import shipped_configs

ROOT = Path(__file__).resolve().parent.parent

BEGIN, END = "<!-- generated: python tools/plan.py --readme-table -->", "<!-- end generated -->"


def readme_table() -> str:
    out = subprocess.run(
        [sys.executable, "tools/plan.py", "--readme-table"], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def with_table(readme: str, table: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    return pattern.sub(lambda _: f"{BEGIN}\n{table}\n{END}", readme)


SAVE_HEADER = "# Checkpoints: save_interval is the planner's goodput optimum (tools/plan.py; `make docs` writes it)."
SAVE_LINE = re.compile(r"^(checkpoint:\n(?:  .*\n)*?  save_interval: )\d+", re.M)


def best_save_interval(path: Path) -> int:
    return plan(load_config(path))["goodput"]["save_interval"]


def with_save_interval(text: str, steps: int) -> str:
    """A config file's text with `checkpoint.save_interval: steps` (replaced, or added to its checkpoint section
    or at its end) and SAVE_HEADER as the last line of its header comment."""
    if SAVE_LINE.search(text):
        text = SAVE_LINE.sub(lambda m: f"{m.group(1)}{steps}", text)
    elif re.search(r"^checkpoint:\n", text, re.M):
        text = re.sub(r"^checkpoint:\n", f"checkpoint:\n  save_interval: {steps}\n", text, flags=re.M)
    else:
        text = text.rstrip("\n") + f"\ncheckpoint:\n  save_interval: {steps}\n"
    if SAVE_HEADER not in text:
        lines = text.split("\n")
        header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
        text = "\n".join([*lines[:header], SAVE_HEADER, *lines[header:]])
    return text


LAYOUT_MEMORY = re.compile(r"\d+\.\d of \d+\.\d GiB")
LAYOUT_MFU = re.compile(r"predicted MFU \d+\.\d%")


def layout_figures(path: Path) -> tuple[str, str]:
    """("M of B GiB", "predicted MFU X%") of a config: the planner's busiest stage against its budget."""
    result = plan(load_config(path))
    memory = f"{result['memory_gib']['total']:.1f} of {result['memory_budget_gib']:.1f} GiB"
    return memory, f"predicted MFU {100 * result['predicted']['mfu']:.1f}%"


def with_layout_figures(text: str, figures: dict[str, tuple[str, str]]) -> str:
    """docs/layouts.md with the first memory and MFU figure of each config section's "* Layout:" bullet (a section
    `### <config stem>`) replaced by `figures[stem]`; the prose around them is the author's."""
    sections = text.split("\n### ")
    for i, section in enumerate(sections[1:], 1):
        stem = section.split("\n", 1)[0].strip()
        start = section.find("\n* Layout:")
        if stem not in figures or start == -1:
            continue
        end = min(
            (j for j in (section.find("\n* ", start + 1), section.find("\n\n", start)) if j != -1), default=len(section)
        )
        memory, mfu = figures[stem]
        bullet = LAYOUT_MFU.sub(mfu, LAYOUT_MEMORY.sub(memory, section[start:end], count=1), count=1)
        sections[i] = section[:start] + bullet + section[end:]
    return "\n### ".join(sections)


def main() -> None:
    (ROOT / "docs" / "config.md").write_text(reference_markdown() + "\n")
    for path in shipped_configs():
        path.write_text(with_save_interval(path.read_text(), best_save_interval(path)))
    layouts = ROOT / "docs" / "layouts.md"
    figures = {path.stem: layout_figures(path) for path in shipped_configs()}
    layouts.write_text(with_layout_figures(layouts.read_text(), figures))
    readme = ROOT / "README.md"
    readme.write_text(with_table(readme.read_text(), readme_table()))


if __name__ == "__main__":
    main()
