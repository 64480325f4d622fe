"""Resolve and validate a config, or print the key reference (docs/config.md).

python tools/config.py --config configs/tiny/llama_tiny.yaml [--set k=v ...]   # the resolved YAML
python tools/config.py --doc                                                  # the key reference
"""

from __future__ import annotations

import argparse
import sys

from mindscale.cli import add_config_arguments, config_from_args, fail
from mindscale.config import reference_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/config.py", description="Resolve and validate a MindScale config."
    )
    add_config_arguments(parser, required=False)
    parser.add_argument("--doc", action="store_true", help="print the key reference as Markdown")
    args = parser.parse_args(argv)
    if args.doc:
        print(reference_markdown())
        return 0
    if not args.config:
        fail("--config is required (or --doc); e.g. --config configs/tiny/llama_tiny.yaml")
    print(config_from_args(args).to_yaml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
