"""Atomic, self-describing checkpoints.

A checkpoint is a folder `<root>/step_XXXXXXXX/` holding
  model.safetensors      weights by MindScale parameter name (fp32 master copies)
  optimizer.safetensors  optimizer state (AdamW moments, step counters), when saved
  state.json             step, loss scale, data position, RNG state, anything the trainer needs
  config.yaml            the resolved config of the run that wrote it
  COMPLETE               written last: the sha256 and size of every file above

It is committed whole (mindscale.io.commit_folder): a process killed at any moment leaves either the
previous complete checkpoint or the new complete one, and a folder without a valid COMPLETE marker
(a kill, a truncated copy) is never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from mindscale.io import MARKER, CheckpointError, commit_folder, read_tensors, verify_folder
from mindscale.train.checkpoints.committed import step_dir_name
from models.weights import WEIGHTS, assign, load_weights

__all__ = [
    "MARKER",
    "WEIGHTS",
    "OPTIMIZER",
    "STATE",
    "CONFIG",
    "CheckpointError",
    "assign",
    "load_weights",
    "save_checkpoint",
    "BackgroundSave",
    "layout_record",
    "same_layout",
    "describe_layout",
    "reshard_refusal",
    "read_state",
    "complete_checkpoints",
    "latest_checkpoint",
    "checkpoint_step",
    "load_checkpoint",
    "step_dir_name",
]

OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
CONFIG = "config.yaml"


def layout_record(cfg, layout) -> dict:
    """What a rank's checkpoint slices depend on (state.json "layout"): compared on resume (same_layout); {}
    unsharded. stages_of_layers is which stage holds each decoder layer, which pipeline_interleave and
    stage_offset change under the same pipeline_stage."""
    parallel = cfg.parallel
    return (
        {
            "devices": layout.devices,
            "data_parallel": parallel.data_parallel,
            "model_parallel": parallel.model_parallel,
            "pipeline_stage": parallel.pipeline_stage,
            "optimizer_shard": layout.optimizer_shard,
            "vocab_parallel": layout.vocab_parallel,
            "expert_parallel": parallel.expert_parallel,
            "stages_of_layers": list(layout.stages_of_layers),
            # 1D, 2D or 3D: the same model_parallel cuts a projection into equal shapes of other contents
            "tensor_split": list(layout.tensor_split),
        }
        if layout.sharded
        else {}
    )


RECORD_ADDED = ("expert_parallel", "stages_of_layers", "tensor_split")  # keys the record gained (same_layout)


def same_layout(saved: dict, ours: dict) -> bool:
    """Whether a checkpoint whose state.json holds the layout record `saved` resumes under `ours`. A record
    written before a key of RECORD_ADDED was kept lacks it and is compared on the others: such a checkpoint
    resumes as it did before."""
    if saved:
        ours = {key: value for key, value in ours.items() if key in saved or key not in RECORD_ADDED}
    return saved == ours


def describe_layout(record: dict) -> str:
    """A layout record (layout_record) for a one-line message."""
    if not record:
        return "unsharded (rank 0 writes whole tensors)"
    degrees = ", ".join(
        f"{key} {record[key]}"
        for key in ("data_parallel", "model_parallel", "pipeline_stage", "expert_parallel", "optimizer_shard")
        if key in record
    )
    return f"sharded over {record.get('devices')} devices ({degrees})"


def reshard_refusal(folder: Path, saved: dict, ours: dict | None) -> CheckpointError:
    """The one-line refusal of a step written under the layout `saved` by a run whose layout is `ours`
    (None: sharded, record not known): its slices would load into the wrong places, tools/reshard.py
    converts it."""
    this = describe_layout(ours) if ours is not None else "sharded"
    if ours and saved and describe_layout(ours) == describe_layout(saved):
        this += f" but with other {', '.join(key for key in ours if saved.get(key) != ours[key])}"
    return CheckpointError(
        f"{folder} was written {describe_layout(saved)}, this run is {this}: its tensors do not "
        f"load here; reshard it: python tools/reshard.py --input {folder} --config <this run's "
        "config> --output <a new run>/checkpoints, then resume with that run.name"
    )


def _fault_point(name: str, step: int) -> None:
    """Fault injection for the crash-safety tests: MINDSCALE_FAULT=checkpoint_write:STEP makes this
    process SIGKILL itself halfway through writing that step's checkpoint (weights written, no marker)."""
    if os.environ.get("MINDSCALE_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _contiguous(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(value) for name, value in tensors.items()}


def save_checkpoint(
    root: str | Path,
    step: int,
    weights: dict[str, np.ndarray],
    optimizer: dict[str, np.ndarray] | None = None,
    state: dict | None = None,
    config: str | None = None,
) -> Path:
    """Write `<root>/step_XXXXXXXX/` atomically (pruning old ones is the run-level commit's job,
    mindscale/train/checkpoints/commit.py). `config` is the resolved config as YAML text. Returns the final folder.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    # a save killed mid-write (a restart, the hang watch, kill -9) left its .tmp folder behind: this
    # folder has one writer (the run lock), so every one of them is stale
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    save_file(_contiguous(weights), str(tmp / WEIGHTS))
    _fault_point("checkpoint_write", step)
    if optimizer:
        save_file(_contiguous(optimizer), str(tmp / OPTIMIZER))
    (tmp / STATE).write_text(json.dumps({"step": step, **(state or {})}, indent=1))
    if config is not None:
        (tmp / CONFIG).write_text(config)
    commit_folder(tmp, final)
    return final


class BackgroundSave:
    """save_checkpoint(*args) on a thread (checkpoint.async_save): training goes on while the folder is
    written; join() waits for it and re-raises what it raised. The tensors must be copies that training
    does not change. The commit (mindscale/train/checkpoints/commit.py) stays on the training thread, after join."""

    def __init__(self, *args):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=args, name="checkpoint-save", daemon=True)
        self.thread.start()

    def _run(self, *args) -> None:
        try:
            save_checkpoint(*args)
        except BaseException as exc:  # re-raised on the training thread by join()
            self.error = exc

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete step folders under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.glob("step_*")):
        try:
            verify_folder(child)
        except CheckpointError:
            continue
        found.append(child)
    return found


def latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a complete checkpoint folder was saved at (its state.json)."""
    return int(read_state(path)["step"])


def read_state(path: str | Path) -> dict:
    """A checkpoint folder's state.json."""
    return json.loads((Path(path) / STATE).read_text())


def load_checkpoint(
    path: str | Path, verified: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(weights, optimizer state, trainer state) of a complete checkpoint folder, checksums verified
    (unless the caller just did: `verified`)."""
    path = Path(path)
    if not verified:
        verify_folder(path, deep=True)
    weights = read_tensors(path / WEIGHTS)
    optimizer = read_tensors(path / OPTIMIZER) if (path / OPTIMIZER).is_file() else {}
    return weights, optimizer, read_state(path)
