"""MindSpore's own device-memory plan of the shipped configs' ranks, as recorded (bench/compiled_memory.json).

`python bench/compiled_memory.py --config C` compiles a config's first and last pipeline stage under MindSpore's
level-1 dry run (tools/dryrun.py --memory) and records, per rank, what MindSpore's plan holds: `used` (the tensors
live at the plan's busiest step plus the persistent ones) and `peak` (its whole block, fragments included, plus the
persistent ones), both inside MindSpore's pool, next to the planner's figure for the same rank. The README's table
shows the busiest rank's `peak`; this module reads the records for it.

A record belongs to a config's layout: `fingerprint` hashes the keys that size device memory (model, parallel,
recompute, offload, communication, the micro batch, the hardware profile's memory and device keys) where they
differ from their defaults. When the config changes, its record stops being shown (`current` returns None) until
the config is compiled again. A change of code that moves memory (the loss, a
layer) is not in the fingerprint: each record names the commit it was compiled at.

These are MindSpore's plans for an Ascend rank, made on a host without one: no kernel workspaces (level 1 sizes
none), no HCCL buffers or driver memory (outside the pool). Not a measurement on a device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from mindscale.config import REPO_ROOT, Config, load_config
from mindscale.perf.planner.memory import stage_memory

RECORDS = REPO_ROOT / "bench" / "compiled_memory.json"
MIB = 2**20
SPARE_GIB = 3.0  # what a shipped layout leaves free in the pool by MindSpore's figure: kernel workspaces live there


def fingerprint(cfg: Config) -> str:
    """A short hash of the keys that decide a rank's device memory, those set away from their defaults only (a key
    added later at its default leaves every record standing)."""
    sections = {
        "model": cfg.model,
        "parallel": cfg.parallel,
        "recompute": cfg.recompute,
        "offload": cfg.offload,
        "hardware": cfg.hardware,
    }
    keys = {name: _set_keys(section) for name, section in sections.items()}
    if communication := _set_keys(cfg.communication):  # a section added later: only when set, as a key would be
        keys["communication"] = communication
    keys["micro_batch_size"] = cfg.train.micro_batch_size
    for unrelated in ("name", "source", "failures_per_device_hour", "storage_gbps", "requeue_s", "relaunch_s"):
        keys["hardware"].pop(unrelated, None)
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _set_keys(section) -> dict:
    """{key: value} of a config dataclass's fields that differ from its defaults, nested sections flattened."""
    default = type(section)()
    out = {}
    for field in dataclasses.fields(section):
        value, base = getattr(section, field.name), getattr(default, field.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{field.name}.{k}": v for k, v in _set_keys(value).items()})
        elif value != base:
            out[field.name] = value
    return out


def load(path: Path = RECORDS) -> dict:
    """{config path relative to the repository: record}; {} before anything was recorded."""
    return json.loads(path.read_text()) if path.is_file() else {}


def save(records: dict, path: Path = RECORDS) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n")
    tmp.replace(path)


def key_of(config_path: Path) -> str:
    return str(Path(config_path).resolve().relative_to(REPO_ROOT))


def current(records: dict, config_path: Path, cfg: Config) -> dict | None:
    """The config's record if it was compiled with the layout the config has now and each rank's plan is the whole
    step's (`whole_step`), else None."""
    record = records.get(key_of(config_path))
    return record if record and record["fingerprint"] == fingerprint(cfg) and whole_step(record) else None


def whole_step(record: dict) -> bool:
    """Whether every recorded rank compiled into one kernel graph. Where MindSpore 2.9 does not inline the reused
    layer graph (it logs "Set no inline because cell reuse micro num is greater than 64" where a step calls it more
    than 64 times, micro batches x chunks), a rank is hundreds of kernel graphs, each with its own SOMAS block; the
    reading adds up their parameters and takes the largest block, which leaves out the activations passed between
    graphs (docs/dryrun.md, "Device memory"). Records older than the `graphs` field were all one graph: each agreed
    with the planner."""
    return all(rank.get("graphs", 1) == 1 for rank in record["ranks"])


def on_device_mib(rank: dict, figure: str) -> int:
    """A recorded rank's `figure` ("used_mib" or "peak_mib", fragments included) less the offload's host copies,
    which MindSpore 2.9's level-1 plan places in the device block although a device holds them in host memory
    (docs/dryrun.md, "Device memory"; records without `host_copy_mib` are of layouts that offload nothing)."""
    return rank[figure] - rank.get("host_copy_mib", 0)


def shipped_extra_mib(config_path: Path, record: dict, stage: int) -> float:
    """The planner's bytes of the shipped step on `stage` beyond those of the step the record compiled (its
    `overrides`): the chunk forwards a cut below 2p + m mod p micro batches leaves out of the first interleaved
    stages, and the views MindSpore's many kernel graphs keep where the shipped step calls the layer graph more
    than the compiled one-graph step may (memory._split_views_bytes; bench/compiled_memory.py)."""
    shipped = stage_memory(load_config(config_path), stage)["total"]
    return (shipped - stage_memory(load_config(config_path, record["overrides"]), stage)["total"]) / MIB


def shipped_mib(config_path: Path, record: dict, rank: dict, figure: str) -> float:
    """A recorded rank's `figure` on the device for the shipped step: MindSpore's plan of the compiled step plus
    what the planner counts beyond it (shipped_extra_mib)."""
    return on_device_mib(rank, figure) + shipped_extra_mib(config_path, record, rank["stage"])


def busiest(config_path: Path, record: dict) -> dict:
    """The recorded rank whose shipped step on the device, fragments included, is the largest."""
    return max(record["ranks"], key=lambda r: shipped_mib(config_path, record, r, "peak_mib"))


def spare_gib(config_path: Path, record: dict) -> float:
    """What the shipped step of the busiest rank leaves free in the pool on the device, GiB."""
    rank = busiest(config_path, record)
    return (rank["pool_mib"] - shipped_mib(config_path, record, rank, "peak_mib")) / 1024


def planner_mib(config_path: Path, record: dict, stage: int) -> float:
    """The planner's device memory of `stage` inside the pool today (its total less what it reserves outside the
    pool), for the overrides the record was compiled with; the record keeps the figure it had then."""
    memory = stage_memory(load_config(config_path, record["overrides"]), stage)
    return (memory["total"] - memory["reserve"]) / MIB
