"""Reading run folders (docs/design.md): the resolved config.yaml and metrics.jsonl.

Shared by mindscale/perf/{linearity,compare,report,mfu}.py. Every problem with the
input raises `RunDataError` (a ValueError) whose message is one line naming the file and the fix;
the tools turn it into exit status 2.

Steady state: the first record a training process logs holds its graph-compile step, so each
*segment* of metrics.jsonl (a fresh start or a resume appends a new one) begins with `warmup`
records that are dropped before measuring; records of profiled steps (profile.enable) are
left out too, since the profiler slows them down. What is measured over the records kept is
mindscale/perf/mfu.py's `of_run` (docs/mfu.md: their tokens over their time).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from mindscale.config import Config, ConfigError, UserError, config_from_tree, parse_yaml

REQUIRED_KEYS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "samples_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "hfu",
    "memory_gib",
    "devices",
)
DEFAULT_WARMUP = 1


class RunDataError(UserError):
    """A run folder or metrics file that cannot be used. One line: what, where, the fix."""


@dataclass
class Metrics:
    records: list[dict]
    truncated: bool  # the last line was cut off (a run still writing, or killed mid-write)


@dataclass
class Run:
    path: Path
    config: Config
    tree: dict  # config.yaml as written (for diffs between runs)
    metrics: Metrics

    @property
    def name(self) -> str:
        return self.path.name


def read_metrics(path: str | Path) -> Metrics:
    """Parse metrics.jsonl. A partial last line is a truncation (kept out, flagged); a bad line
    elsewhere, a file without one complete record or a record lacking the run folder's keys (docs/design.md) is an error."""
    path = Path(path)
    if not path.is_file():
        raise RunDataError(f"{path} does not exist; point at a run folder written by run_train.py")
    text = path.read_text()
    lines = text.split("\n")
    ends_cleanly = text.endswith("\n")
    records, truncated = [], False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        last = number == len(lines) and not ends_cleanly
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if last:
                truncated = True
                break
            raise RunDataError(f"{path} line {number} is not JSON; the file is corrupt, re-run or remove that line")
        if not isinstance(record, dict):
            raise RunDataError(f"{path} line {number} is not a JSON object; the file is corrupt")
        missing = [key for key in REQUIRED_KEYS if key not in record]
        if missing:
            raise RunDataError(
                f"{path} line {number} lacks {', '.join(missing)}; it was not written by MindScale's trainer"
            )
        records.append(record)
    if not records:
        what = "only a truncated line" if truncated else "no records"
        raise RunDataError(f"{path} has {what}; let the run log at least one step (train.log_interval) and try again")
    return Metrics(records, truncated)


def load_run(path: str | Path) -> Run:
    """A run folder: config.yaml (resolved and re-validated) and metrics.jsonl."""
    path = Path(path)
    if not path.is_dir():
        raise RunDataError(f"run folder {path} does not exist; pass <run.output_dir>/<run.name>")
    config_path = path / "config.yaml"
    if not config_path.is_file():
        raise RunDataError(f"{config_path} is missing; {path} is not a MindScale run folder")
    try:
        tree = parse_yaml(config_path.read_text())
        if not isinstance(tree, dict):
            raise RunDataError(f"{config_path} is not a mapping of config sections; the file is corrupt")
        config = config_from_tree(tree)
    except yaml.YAMLError as exc:
        raise RunDataError(f"{config_path} is not valid YAML ({exc.__class__.__name__}); the file is corrupt")
    except ConfigError as exc:
        raise RunDataError(f"{config_path}: {exc}")
    return Run(path, config, tree, read_metrics(path / "metrics.jsonl"))


def warn_if_truncated(run: Run) -> None:
    if run.metrics.truncated:
        print(
            f"warning: {run.path / 'metrics.jsonl'} ends in a truncated line (run still writing or killed); "
            "using the complete lines",
            file=sys.stderr,
        )


def segments(records: list[dict]) -> list[list[dict]]:
    """Split records into training processes: a new one starts where the step number does not grow
    or the elapsed-time counter restarts. A resumed segment replaces the steps it repeats."""
    out: list[list[dict]] = []
    for record in records:
        previous = out[-1][-1] if out else None
        restarted = previous is not None and (
            record["step"] <= previous["step"]
            or record.get("elapsed_s", float("inf")) < previous.get("elapsed_s", float("-inf"))
        )
        if previous is None or restarted:
            for segment in out:
                segment[:] = [r for r in segment if r["step"] < record["step"]]
            out = [s for s in out if s]
            out.append([])
        out[-1].append(record)
    return out


def steps_in(record: dict) -> int:
    """The optimizer steps a record covers: its step_time_s and data_wait_s are their means."""
    return int(record.get("steps_in_window", 1))


def profiled(record: dict, window: tuple[int, int] | None) -> bool:
    """Whether the steps a record averages overlap the profiled steps (1-based, inclusive)."""
    if window is None:
        return False
    last = record["step"]
    first = last - steps_in(record) + 1
    return first <= window[1] and last >= window[0]


def profile_window(cfg: Config) -> tuple[int, int] | None:
    """Logged step numbers the profiler ran in (profiling slows them down), or None."""
    p = cfg.profile
    return (p.start_step + 1, p.stop_step) if p.enable else None


def steady_records(
    records: list[dict], warmup: int = DEFAULT_WARMUP, skip_window: tuple[int, int] | None = None
) -> tuple[list[dict], bool]:
    """Records after the first `warmup` of every segment, without those overlapping `skip_window`
    (the profiled steps) unless nothing else is left. When that leaves nothing, the last record
    is used and the second value is False (no steady-state measurement)."""
    if warmup < 0:
        raise RunDataError(f"--warmup {warmup}: must be >= 0")
    kept = [r for segment in segments(records) for r in segment[warmup:]]
    unprofiled = [r for r in kept if not profiled(r, skip_window)]
    if unprofiled or kept:
        return unprofiled or kept, True
    return [records[-1]], False


def per_step_mean(records: list[dict], key: str) -> float:
    """`key` (a per-step mean of each record's window) over all the steps the records cover: for
    step_time_s, their total time over their number of steps."""
    steps = sum(steps_in(r) for r in records)
    return sum(float(r[key]) * steps_in(r) for r in records) / steps


def spread(records: list[dict], key: str, center: float) -> dict:
    """Min and max of `key` over the records, and (max - min) / `center`, for reports."""
    values = [float(r[key]) for r in records]
    return {
        "min": min(values),
        "max": max(values),
        "rel_spread": (max(values) - min(values)) / center if center else 0.0,
        "n": len(values),
    }


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def config_differences(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys whose resolved values differ, except those in `ignore`."""
    flat_a, flat_b = flatten(a.to_dict()), flatten(b.to_dict())
    keys = sorted(set(flat_a) | set(flat_b))
    return [k for k in keys if k not in ignore and flat_a.get(k) != flat_b.get(k)]


def add_warmup_argument(parser) -> None:
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        metavar="N",
        help=f"logged records dropped at the start of each training process (compile step); default {DEFAULT_WARMUP}",
    )
