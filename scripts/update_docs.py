"""Regenerate the generated parts of the docs (`make docs`): the config key reference and the README's
scale-config table. tests/unit/test_docs.py fails when they are stale."""

import re
import subprocess
import sys
from pathlib import Path

from mindscale.config import reference_markdown

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


def main() -> None:
    (ROOT / "docs" / "config.md").write_text(reference_markdown() + "\n")
    readme = ROOT / "README.md"
    readme.write_text(with_table(readme.read_text(), readme_table()))


if __name__ == "__main__":
    main()
