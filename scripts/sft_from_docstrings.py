"""Alpaca-style SFT records from the Python standard library's docstrings (no download), for
`make finetune-demo`: "What does module.function do?" -> the docstring's first sentence."""

import argparse
import importlib
import inspect
import json

MODULES = [
    "os",
    "os.path",
    "shutil",
    "json",
    "re",
    "string",
    "textwrap",
    "math",
    "statistics",
    "random",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "glob",
    "fnmatch",
    "tempfile",
    "datetime",
    "calendar",
    "base64",
    "hashlib",
    "zlib",
    "gzip",
    "csv",
    "pathlib",
    "copy",
    "pprint",
]


def records():
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            if 20 <= len(first) <= 200:
                yield {"instruction": f"What does {module_name}.{name} do?", "input": "", "output": first}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    with open(args.output, "w") as handle:
        count = sum(handle.write(json.dumps(r) + "\n") > 0 for r in records())
    print(f"{count} SFT records -> {args.output}")


if __name__ == "__main__":
    main()
