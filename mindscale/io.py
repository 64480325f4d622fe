"""Files that are whole or absent: atomic writes, folders swapped in whole, folders committed with a
checksum marker, safetensors read with one-line errors.

A committed folder holds a `COMPLETE` marker, written last, with the sha256 and size of every other
file; the folder is written under a hidden temporary name, fsynced and renamed into place, so a
process killed at any moment leaves either the previous folder or the new one, and a folder without
a valid marker (a kill, a truncated copy) is never read (mindscale/train/checkpoints/folder.py, docs/checkpoints.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from mindscale.config import UserError

MARKER = "COMPLETE"


class CheckpointError(UserError):
    """A checkpoint or weights file is missing, incomplete or does not match. The message is one line."""


class DataError(UserError):
    """Training data that cannot be used; the message is one line naming the problem and the fix."""


def write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and rename: a kill mid-write leaves the old file whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


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


def sha256(path: Path) -> str:
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


def commit_folder(tmp: Path, final: Path) -> None:
    """Fsync every file of `tmp`, write the marker last, and rename `tmp` to `final` (replacing a
    folder of the same name, e.g. a resumed run saving the step it started from)."""
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        _fsync_file(tmp / name)
    marker = {name: {"sha256": sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in files}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    _fsync_file(tmp / MARKER)
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def verify_folder(path: str | Path, deep: bool = False) -> None:
    """Raise CheckpointError unless `path` is a committed folder whose files match their marker: the
    sizes always, the checksums too when `deep`."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MARKER} marker: interrupted write "
            "or not a MindScale checkpoint); point to a step_* folder that has one"
        )
    try:
        entries = json.loads(marker.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"{marker} is corrupt; use an older checkpoint")
    for name, meta in entries.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"{file} is missing or truncated (expected {meta['bytes']} bytes); use an older checkpoint"
            )
        if deep and sha256(file) != meta["sha256"]:
            raise CheckpointError(f"{file} does not match its checksum; use an older checkpoint")


def read_tensors(file: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors; a truncated or foreign file is a CheckpointError."""
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read ({str(exc).splitlines()[0]}); it is truncated or not safetensors")
