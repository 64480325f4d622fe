"""A checkpoint step from one layout to another (tools/reshard.py).

The source is a whole step folder (a data-parallel run's, or a converted one) or any rank's folder of
a sharded run's step, whose slices are merged (models.read_step_tensors). The target is a config: an
unsharded one gets one whole folder; a sharded one gets `rank_<r>/step_X` for every rank, each cut by
the layouts MindSpore's dry run compiles for the first rank of every stage (the ranks of a stage
share them). Either way the step is committed (`COMMITTED`). The step, loss scale, seed and data
position carry over, and the data order does not depend on the layout, so a run of the target
config resumes from the output as from its own checkpoint. The whole model is held in host memory
once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from mindscale.config import Config, Layout
from mindscale.io import CheckpointError
from mindscale.progress import Progress, quiet
from mindscale.train.checkpoints.folder import (
    CONFIG,
    OPTIMIZER,
    STATE,
    WEIGHTS,
    layout_record,
    save_checkpoint,
    step_dir_name,
)
from mindscale.train.checkpoints.batch import check_global_batch
from mindscale.train.checkpoints.commit import record_steps
from models.weights import read_step_tensors, saved_layout, take_slice


def read_step(folder: Path) -> tuple[dict, dict, dict]:
    """(weights, optimizer state, trainer state) of a step, whole."""
    folder = Path(folder)
    if not (folder / STATE).is_file():
        raise CheckpointError(
            f"{folder} is not a checkpoint step folder (no {STATE}); point --input at a step_* "
            "folder, for a sharded run at any rank_<r>/step_* folder"
        )
    state = json.loads((folder / STATE).read_text())
    state.pop("layouts", None)
    return read_step_tensors(folder, WEIGHTS), read_step_tensors(folder, OPTIMIZER), state


def _rank_part(tensors: dict, layouts: dict, everywhere: set, rank: int) -> dict:
    """What `rank` holds of `tensors`: its slice of each tensor its stage holds, and the tensors no stage
    has a layout for (optimizer counters)."""
    return {
        n: take_slice(v, layouts[n], rank) if n in layouts else v
        for n, v in tensors.items()
        if n in layouts or n in everywhere
    }


def reshard(
    source: Path,
    cfg: Config,
    output: Path,
    rank_layouts: Callable[[Progress], dict[int, dict]],
    progress: Progress | None = None,
) -> dict:
    """Write the step of `source` under `output` (a run's checkpoints folder) for `cfg`'s layout, its stages
    reported to `progress` (mindscale/progress.py). A sharded target is cut by `rank_layouts(progress)`:
    every rank's compiled layout of each tensor it holds (mindscale.launch.dryrun_ranks.rank_layouts)."""
    progress = progress or quiet()
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise CheckpointError(f"--output {output} is not empty; name a new folder (a run's checkpoints/ to be)")
    began = time.perf_counter()
    with progress.single(f"reading {source}", "folder"):
        weights, optimizer, state = read_step(source)
    step = int(state["step"])
    check_global_batch(source, state, cfg, cfg.hardware.device_target, cfg.devices, None, "resharding")
    layout = Layout.of(cfg, cfg.hardware.device_target)
    state = {**state, "layout": layout_record(cfg, layout)}
    compile_s = 0.0
    if not layout.sharded:
        with progress.single(f"writing {output}", "folder"):
            save_checkpoint(output, step, weights, optimizer, state, cfg.to_yaml())
        folders = [output / step_dir_name(step)]
    else:
        compiling = time.perf_counter()
        by_rank = rank_layouts(progress)
        compile_s = time.perf_counter() - compiling
        laid_out = {n for layouts in by_rank.values() for n in layouts}
        everywhere = {n for n in [*weights, *optimizer] if n not in laid_out}
        folders = []
        for rank, layouts in progress.track(sorted(by_rank.items()), f"writing {output}", len(by_rank), "rank folder"):
            part_weights = _rank_part(weights, layouts, everywhere, rank)
            part_optimizer = _rank_part(optimizer, layouts, everywhere, rank)
            held = {n: saved_layout(layouts[n]) for n in [*part_weights, *part_optimizer] if n in layouts}
            folders.append(
                save_checkpoint(
                    output / f"rank_{rank}",
                    step,
                    part_weights,
                    part_optimizer,
                    {**state, "layouts": held},
                    cfg.to_yaml(),
                )
            )
    record_steps(output, [step])
    seconds = time.perf_counter() - began
    full_bytes = sum(v.nbytes for v in [*weights.values(), *optimizer.values()])
    # gb_per_s: the step's full bytes over the time spent reading, cutting and writing (not compiling)
    return {
        "output": str(output),
        "step": step,
        "ranks": len(folders),
        "bytes": int(full_bytes),
        "seconds": round(seconds, 2),
        "compile_s": round(compile_s, 2),
        "gb_per_s": full_bytes / 1e9 / (seconds - compile_s),
        "config": str(folders[0] / CONFIG),
    }
