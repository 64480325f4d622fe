"""Re-planning: a config with `--set` overrides applied, or its layout on another number of devices."""

from __future__ import annotations

from mindscale.config import Config, ConfigError, UserError, apply_override, config_from_tree
from mindscale.perf.planner.caches import _per_config


class PlanError(UserError):
    """A plan that cannot be made (bad --devices, no fitting layout): one line with the fix."""


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with `--set`-style overrides applied and re-validated (raises ConfigError)."""
    tree = _copied(_per_config("tree", cfg, Config.to_dict))
    for assignment in overrides:
        apply_override(tree, assignment)
    return config_from_tree(tree)


def _copied(node):
    """A config tree's copy, new containers throughout (nothing shared between the configs made from it). A
    search makes thousands of configs from a few: dataclasses.asdict, which deep-copies every leaf, was a fifth
    of its time."""
    if isinstance(node, dict):
        return {key: _copied(value) for key, value in node.items()}
    return [_copied(value) for value in node] if isinstance(node, list) else node


def _batch_overrides(cfg: Config, dp: int, pp: int, mbs: int) -> list[str] | None:
    """micro_batch_num / gradient accumulation that keep the global batch, or None if impossible."""
    g = cfg.samples_per_step
    per_step = mbs * dp
    if g % per_step:
        return None
    micro = g // per_step
    if pp > 1:
        if micro < pp:
            return None
        return [f"parallel.micro_batch_num={micro}", "parallel.gradient_accumulation_steps=1"]
    return ["parallel.micro_batch_num=1", f"parallel.gradient_accumulation_steps={micro}"]


def replan_devices(cfg: Config, devices: int) -> Config:
    """Same model/context/pipeline parallel and global batch on `devices` cards: data_parallel changes."""
    parallel = cfg.parallel
    dp = parallel.data_parallel_for(devices)
    if dp is None:
        raise PlanError(
            f"--devices {devices} is not a multiple of model_parallel x context_parallel x pipeline_stage "
            f"= {parallel.model_parallel} x {parallel.context_parallel} x {parallel.pipeline_stage} = "
            f"{parallel.replica_devices}; "
            "pick a multiple or change them with --set"
        )
    batch = _batch_overrides(cfg, dp, parallel.pipeline_stage, cfg.train.micro_batch_size)
    if batch is None:
        raise PlanError(
            f"global batch {cfg.samples_per_step} cannot be split over data_parallel={dp} x "
            f"micro_batch_size={cfg.train.micro_batch_size} (x >= {parallel.pipeline_stage} micro "
            "batches); "
            "set train.global_batch_size or train.micro_batch_size with --set"
        )
    try:
        sharded = parallel.optimizer_shard and dp > 1
        micro = any(o.split("=")[1] != "1" for o in batch)  # micro_batch_num or accumulation steps > 1
        return with_overrides(
            cfg,
            [
                f"parallel.data_parallel={dp}",
                *batch,
                f"parallel.optimizer_shard={str(sharded).lower()}",
                f"parallel.gradient_accumulation_shard="
                f"{str(sharded and micro and parallel.gradient_accumulation_shard).lower()}",
                f"train.global_batch_size={cfg.samples_per_step}",
            ],
        )
    except ConfigError as exc:
        raise PlanError(f"--devices {devices}: {exc}")
