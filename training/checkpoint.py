"""Atomic, self-describing checkpoints.

A checkpoint is a folder `<root>/step_XXXXXXXX/` holding
  model.safetensors      weights by MindScale parameter name (fp32 master copies)
  optimizer.safetensors  optimizer state (AdamW moments, step counters), when saved
  state.json             step, loss scale, data position, RNG state, anything the trainer needs
  config.yaml            the resolved config of the run that wrote it
  COMPLETE               written last: the sha256 and size of every file above

It is written into a hidden temporary folder, fsynced, and renamed into place, so a process
killed at any moment leaves either the previous complete checkpoint or the new complete one.
A folder without a valid COMPLETE marker (a kill, a truncated copy) is never loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

MARKER = "COMPLETE"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
CONFIG = "config.yaml"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not match. The message is one line."""



def publish_folder(partial: Path, output: Path) -> None:
    """Swap a finished folder in at `output`: what was there is moved aside first and removed only
    afterwards, so a kill leaves the old output or the new one, never a mix of both."""
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        os.rename(output, old)
    os.rename(partial, output)
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)

def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault_point(name: str, step: int) -> None:
    """Fault injection for the crash-safety tests: MINDSCALE_FAULT=checkpoint_write:STEP makes this
    process SIGKILL itself halfway through writing that step's checkpoint (weights written, no marker)."""
    if os.environ.get("MINDSCALE_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _contiguous(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(value) for name, value in tensors.items()}


def save_checkpoint(root: str | Path, step: int, weights: dict[str, np.ndarray],
                    optimizer: dict[str, np.ndarray] | None = None, state: dict | None = None,
                    config: str | None = None, keep_last: int | None = None) -> Path:
    """Write `<root>/step_XXXXXXXX/` atomically and prune to the newest `keep_last` complete ones.

    `config` is the resolved config as YAML text. Returns the final folder.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(_contiguous(weights), str(tmp / WEIGHTS))
    _fault_point("checkpoint_write", step)
    if optimizer:
        save_file(_contiguous(optimizer), str(tmp / OPTIMIZER))
    (tmp / STATE).write_text(json.dumps({"step": step, **(state or {})}, indent=1))
    if config is not None:
        (tmp / CONFIG).write_text(config)
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        _fsync_file(tmp / name)
    marker = {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in files}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    _fsync_file(tmp / MARKER)
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. a resumed run ending where it started)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    if keep_last:
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path: str | Path, deep: bool = False) -> None:
    """Raise CheckpointError unless `path` is a complete checkpoint folder.

    The marker's sizes are always checked; `deep` also re-hashes every file.
    """
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker: interrupted write "
                              "or not a MindScale checkpoint); point to a step_* folder that has one")
    try:
        entries = json.loads(marker.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"{marker} is corrupt; use an older checkpoint")
    for name, meta in entries.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{file} is missing or truncated (expected {meta['bytes']} bytes); "
                                  "use an older checkpoint")
        if deep and _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"{file} does not match its checksum; use an older checkpoint")


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete step folders under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.glob("step_*")):
        try:
            verify(child)
        except CheckpointError:
            continue
        found.append(child)
    return found


def latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def assign(params, values: dict[str, np.ndarray], what: str, layouts: dict | None = None, rank: int = 0) -> None:
    """Copy `values` into `params` by name; every parameter must be present with its shape. A value may
    be the parameter's own slice (a rank's checkpoint), or the full tensor of a sharded parameter, of
    which `rank`'s slice is taken by the compiled layout (`layouts`: the step's parameter_layout_dict)."""
    from mindspore import Tensor
    from training.slicing import take_slice

    layouts = layouts or {}
    by_name = {p.name: p for p in params}
    missing = sorted(set(by_name) - set(values))
    if missing:
        raise CheckpointError(f"{what} lacks {len(missing)} tensors (first: {missing[:3]}); "
                              "it was written by a different model or optimizer")
    for name, param in by_name.items():
        value, shape = values[name], tuple(param.shape)
        if value.size == 1 and param.size == 1:  # safetensors stores 0-d scalars as shape (1,)
            value = value.reshape(shape)
        layout = layouts.get(name)
        if tuple(value.shape) != shape and layout is not None and tuple(value.shape) == tuple(layout[6]):
            value = take_slice(value, layout, rank)
        if tuple(value.shape) != shape:
            raise CheckpointError(f"{what}: {name} has shape {tuple(value.shape)}, the model needs "
                                  f"{tuple(layout[6]) if layout else shape}; check the model config")
        param.set_data(Tensor(value, dtype=param.dtype))


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a complete checkpoint folder was saved at (its state.json)."""
    return int(json.loads((Path(path) / STATE).read_text())["step"])


def _load_tensors(file: Path) -> dict[str, np.ndarray]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read ({str(exc).splitlines()[0]}); "
                              "it is truncated or not safetensors")


def load_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Weights from a checkpoint folder (verified) or a bare .safetensors file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; check checkpoint.load_path")
    if path.is_file():
        return _load_tensors(path)
    verify(path)
    return _load_tensors(path / WEIGHTS)


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(weights, optimizer state, trainer state) of a complete checkpoint folder, checksums verified."""
    path = Path(path)
    verify(path, deep=True)
    weights = _load_tensors(path / WEIGHTS)
    optimizer = _load_tensors(path / OPTIMIZER) if (path / OPTIMIZER).is_file() else {}
    state = json.loads((path / STATE).read_text())
    return weights, optimizer, state
