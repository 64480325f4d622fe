"""Reading a config: YAML with `base:` inheritance, hardware profiles, `--set` overrides, typed sections.

`load_config(path, overrides)` returns a validated `Config` (mindscale/config/schema.py); any problem
raises `ConfigError` whose message is one line naming the key(s), the value(s) and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from mindscale.config.errors import ConfigError
from mindscale.config.schema import Config
from mindscale.config.validate import validate

REPO_ROOT = Path(__file__).resolve().parents[2]
HARDWARE_DIR = REPO_ROOT / "configs" / "hardware"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `3e-4` as a float (YAML 1.2), not as a string (PyYAML's YAML 1.1)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+][0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str):
    """The YAML value of `text`, a fresh copy each time (callers merge into it)."""
    return copy.deepcopy(_parse_yaml(text))


@functools.lru_cache(maxsize=4096)
def _parse_yaml(text: str):
    # PyYAML is pure Python: the planner's search re-reads the same hardware profile and --set values
    # thousands of times
    return yaml.load(text, Loader=_Loader)


# ----------------------------------------------------------------------------------------------
# Loading: base inheritance, overrides


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file")
    try:
        data = parse_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)}); fix the syntax")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_yaml_tree(path: str | Path, _chain: tuple = ()) -> dict:
    """Read `path` and deep-merge its `base:` file(s) under it, depth first, detecting cycles."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, path))
        raise ConfigError(f"base: cycle {cycle}; remove one of the base references")
    data = _read_yaml(path)
    if "hardware" in data:
        data["hardware"] = _hardware_tree(data["hardware"])
    bases = data.pop("base", None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path.name}: base: must be a path or a list of paths, got {bases!r}")
    merged: dict = {}
    for b in bases:
        merged = _deep_merge(merged, load_yaml_tree(path.parent / b, (*_chain, path)))
    return _deep_merge(merged, data)


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to a raw config tree."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected dotted.key=value, e.g. --set train.steps=10")
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or (isinstance(child, str) and part == "hardware"):
            child = _hardware_tree(child) if part == "hardware" else {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is {child!r}, not a section")
        node = child
    node[parts[-1]] = value


def _hardware_tree(value: Any) -> dict:
    """`hardware:` may be a profile name; expand it to the profile's mapping."""
    if value is None:
        value = "cpu"
    if isinstance(value, dict):
        if (HARDWARE_DIR / f"{value.get('name')}.yaml").is_file():
            return _deep_merge(_hardware_tree(value["name"]), value)
        return {"name": "inline", **value}
    if not isinstance(value, str):
        raise ConfigError(f"hardware: must be a profile name or a mapping, got {value!r}")
    path = HARDWARE_DIR / f"{value}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
        raise ConfigError(f"hardware: {value!r} is not a profile; use one of {known} or an inline mapping")
    return {"name": value, **_read_yaml(path)}


# ----------------------------------------------------------------------------------------------
# Typing: raw tree -> dataclasses, with unknown-key and type errors


def _close_match(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _suggest(word: str, choices) -> str:
    choices = list(choices)
    return _close_match(word, choices) or f"; known keys: {', '.join(choices)}"


def _check_type(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Union:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        listed = [a for a in args if typing.get_origin(a) is list]
        if isinstance(value, list) and listed:  # a list's own errors (an entry's unknown key) say more
            return _check_type(key, value, listed[0])
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(key, value, arg)
            except ConfigError as exc:
                errors.append(exc)
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{key}: expected {names}, got {value!r}; fix the value")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(
                f"{key}: {value!r} is not one of {list(choices)}; pick one{_close_match(value, [str(c) for c in choices]) if isinstance(value, str) else ''}"
            )
        return value
    if origin is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of mappings, got {value!r}")
        return [_build(typing.get_args(hint)[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint in (str, list, dict):
        if not isinstance(value, hint):
            raise ConfigError(f"{key}: expected a {hint.__name__}, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {hint!r} for {key}")


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is list:
        fields = ", ".join(f.name for f in dataclasses.fields(typing.get_args(hint)[0]))
        return f"list of {{{fields}}}"
    if typing.get_origin(hint) is Literal:
        return "one of " + str(list(typing.get_args(hint)))
    return getattr(hint, "__name__", str(hint))


@functools.lru_cache(maxsize=None)
def _fields(cls) -> tuple[dict, list]:
    """A section's type hints and key names (get_type_hints evaluates every annotation anew)."""
    return typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]


def _build(cls, tree: Any, prefix: str):
    if not isinstance(tree, dict):
        raise ConfigError(f"{prefix}: must be a mapping, got {tree!r}")
    hints, names = _fields(cls)
    for key in tree:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"unknown key {where}{_suggest(str(key), names)}")
    kwargs = {}
    for name in names:
        if name not in tree:
            continue
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, tree[name], key)
        else:
            kwargs[name] = _check_type(key, tree[name], hint)
    return cls(**kwargs)


def config_from_tree(tree: dict) -> Config:
    tree = dict(tree)
    tree.pop("base", None)
    tree["hardware"] = _hardware_tree(tree.get("hardware"))
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple = ()) -> Config:
    """Resolve `path` (with bases), apply `--set` overrides, type and validate."""
    tree = load_yaml_tree(path)
    for assignment in overrides:
        apply_override(tree, assignment)
    return config_from_tree(tree)


def _reference_rows(section, prefix: str) -> list[str]:
    """One table row per key of `section`; a nested section (model.moe, finetune.lora) key by key."""
    rows, hints = [], typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += _reference_rows(hints[f.name], f"{prefix}.{f.name}")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        type_name = (
            " or ".join(_type_name(a) for a in typing.get_args(hints[f.name]))
            if typing.get_origin(hints[f.name]) is Union
            else _type_name(hints[f.name])
        )
        rows.append(f"| `{prefix}.{f.name}` | {type_name} | `{default!r}` | {f.metadata['doc']} |")
    return rows


def reference_markdown() -> str:
    """The key reference, generated from the dataclasses (docs/config.md)."""
    lines = [
        "# Config key reference",
        "",
        "Generated by `python tools/config.py --doc`; edit the dataclasses in "
        "`mindscale/config/schema.py`, not this file. `python tools/config.py --config C [--set k=v ...]` "
        "prints a config resolved (`base:` files merged, overrides applied) and validated, or its one-line "
        "error with exit status 2.",
        "",
    ]
    for top in dataclasses.fields(Config):
        lines += [f"## `{top.name}`", "", top.metadata["doc"], ""]
        hint = typing.get_type_hints(Config)[top.name]
        if not dataclasses.is_dataclass(hint):
            continue
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += _reference_rows(hint, top.name)
        lines.append("")
    return "\n".join(lines)
