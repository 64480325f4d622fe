"""What every MindScale command line shares: config arguments, one-line errors, exit status 2, --json.

A tool is argument parsing plus output over library functions; it catches the one base class of the
errors a user can fix, mindscale.config.UserError, and reports it with `fail`: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

from mindscale.config import Config, UserError, load_config


def fail(message: str, code: int = 2) -> typing.NoReturn:
    """Print one line to stderr and exit (2 = bad input)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad arguments in one line with exit 2 (argparse prints usage and more)."""

    def error(self, message):
        fail(f"{message}; usage: {' '.join(self.format_usage().split()[1:])}")


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required, help="YAML config (see docs/config.md)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, YAML-typed (repeatable), e.g. --set train.steps=10",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the config named on the command line; bad input exits 2 with one line."""
    try:
        return load_config(args.config, args.overrides)
    except UserError as exc:
        fail(str(exc))


def emit(result: dict, as_json: bool, line: str) -> None:
    """A command-line tool's answer: `result` as one JSON object (--json), else the human `line`."""
    print(json.dumps(result) if as_json else line)
