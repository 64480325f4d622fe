"""The global batch a checkpoint was trained at, which a resume and tools/reshard.py keep.

A checkpoint's data position is `step x global batch` samples (state.json "samples_consumed"): the
loader of the run that resumes skips `step x` its own global batch, and the learning-rate schedule
goes by steps. A run whose global batch differs (launched on another device count: the launcher fits
parallel.data_parallel to it) would read from another sample than the checkpoint reached and move the
schedule's position in samples. So it is refused in one line naming what keeps the batch: the same
micro batches accumulated more (or fewer) times, which keeps each device's memory, where that still
resumes the checkpoint's layout; else a larger (smaller) micro batch; or the device count that gives
the batch back. The global batch is never changed behind the config's back: the config says what
runs (Config.samples_per_step = micro_batch_size x data_parallel x micro_batch_num x
gradient_accumulation_steps).
"""

from __future__ import annotations

from pathlib import Path

from mindscale.config import Config, ConfigError, Layout, apply_override, config_from_tree
from mindscale.io import CheckpointError
from mindscale.train.checkpoints.folder import layout_record, same_layout


def trained_batch(state: dict) -> int | None:
    """The global batch a checkpoint's steps were trained at (its state.json); None when it does not say."""
    consumed, step = state.get("samples_consumed"), int(state.get("step", 0))
    return consumed // step if consumed is not None and step > 0 else None


def batch_product(cfg: Config) -> str:
    """What cfg's global batch is made of, in its keys."""
    parallel = cfg.parallel
    keys = [
        f"train.micro_batch_size={cfg.train.micro_batch_size}",
        f"parallel.data_parallel={parallel.data_parallel}",
        *([f"parallel.micro_batch_num={parallel.micro_batch_num}"] if parallel.pipeline_stage > 1 else []),
        f"parallel.gradient_accumulation_steps={parallel.gradient_accumulation_steps}",
    ]
    return " x ".join(keys)


def _resumes(cfg: Config, overrides: list[str], device: str, world: int, saved_layout: dict | None) -> bool:
    """Whether cfg with `overrides` is a valid config that compiles, on `world` devices, the layout
    `saved_layout` (None: any layout)."""
    tree = cfg.to_dict()
    for assignment in overrides:
        apply_override(tree, assignment)
    try:
        changed = config_from_tree(tree)
    except ConfigError:
        return False
    return saved_layout is None or same_layout(saved_layout, layout_record(changed, Layout.of(changed, device, world)))


def keeping_overrides(cfg: Config, wanted: int, device: str, world: int, saved_layout: dict | None) -> list[str]:
    """The `--set` overrides that give cfg the global batch `wanted` on `world` devices and still resume
    `saved_layout`: the accumulation steps (micro batches of a pipeline) scaled, else the micro batch
    scaled; [] when neither does."""
    parallel, have = cfg.parallel, cfg.samples_per_step
    accumulation = (
        ("parallel.micro_batch_num", parallel.micro_batch_num)
        if parallel.pipeline_stage > 1
        else ("parallel.gradient_accumulation_steps", parallel.gradient_accumulation_steps)
    )
    explicit = [f"train.global_batch_size={wanted}"] if cfg.train.global_batch_size is not None else []
    for key, value in (accumulation, ("train.micro_batch_size", cfg.train.micro_batch_size)):
        if (value * wanted) % have == 0:
            overrides = [f"{key}={value * wanted // have}", *explicit]
            if _resumes(cfg, overrides, device, world, saved_layout):
                return overrides
    return []


def data_parallel_for(cfg: Config, wanted: int) -> int | None:
    """The data_parallel at which cfg's micro batches make the global batch `wanted`, if one does."""
    per_replica = cfg.samples_per_step // cfg.parallel.data_parallel
    return wanted // per_replica if wanted % per_replica == 0 else None


def check_global_batch(
    source: Path, state: dict, cfg: Config, device: str, world: int, saved_layout: dict | None, doing: str = "resuming"
) -> None:
    """Raise CheckpointError (one line, with the fix) unless cfg trains at the global batch the checkpoint
    `source` (its state.json `state`) was trained at. `device`, `world`: what cfg runs on; `saved_layout`:
    the layout a fix must keep (None: any)."""
    wanted = trained_batch(state)
    if wanted is None or wanted == cfg.samples_per_step:
        return
    overrides = keeping_overrides(cfg, wanted, device, world, saved_layout)
    dp = data_parallel_for(cfg, wanted)
    fixes = ([" ".join(f"--set {o}" for o in overrides)] if overrides else []) + (
        [f"{dp * cfg.parallel.replica_devices} device(s) (parallel.data_parallel={dp})"] if dp else []
    )
    fix = ", or ".join(fixes) or f"micro batch, accumulation and device count whose product is {wanted}"
    raise CheckpointError(
        f"{source} was trained at a global batch of {wanted}, this run's is {cfg.samples_per_step} "
        f"({batch_product(cfg)}): {doing} would move its data position (step x global batch) and "
        f"learning-rate schedule; keep the batch with {fix}"
    )
