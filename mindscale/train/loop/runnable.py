"""What a device and a worker count can run, decided from the config alone, without MindSpore: the
launcher refuses with it before msrun starts anything (mindscale/launch/msrun.py), and every worker
again before it builds anything (runtime.py), for runs started without the launcher."""

from __future__ import annotations

from mindscale.config import Config, ConfigError


def semi_auto_keys(cfg: Config) -> dict[str, tuple[str, str]]:
    """The parallel keys of `cfg` that need semi-auto parallel: {key: (its value, the value CPU runs)}."""
    parallel = cfg.parallel
    found = {}
    if parallel.model_parallel > 1:
        found["parallel.model_parallel"] = (str(parallel.model_parallel), "1")
    if parallel.pipeline_stage > 1:
        found["parallel.pipeline_stage"] = (str(parallel.pipeline_stage), "1")
    if parallel.optimizer_shard:
        found["parallel.optimizer_shard"] = ("true", "false")
    return found


def check_device(cfg: Config, device: str) -> None:
    """Refuse what `device` cannot run at all: on CPU, a layout that compiles only under semi-auto
    parallel (MindSpore refuses it there) or a hardware profile of an accelerator (its peak would be
    the MFU's)."""
    if device != "CPU":
        return
    keys = semi_auto_keys(cfg)
    if keys:
        given = " and ".join(f"{key}={value}" for key, (value, _) in keys.items())
        fix = " and ".join(f"{key}={cpu}" for key, (_, cpu) in keys.items())
        raise ConfigError(
            f"{given} {'needs' if len(keys) == 1 else 'need'} Ascend or GPU: MindSpore has no semi-auto "
            f"parallel on CPU; on CPU set {fix}"
        )
    if cfg.hardware.device_target != "CPU":
        raise ConfigError(
            f"hardware={cfg.hardware.name!r} describes {cfg.hardware.device_target} but this host runs "
            "on CPU; add --set hardware=cpu (MFU needs the right peak)"
        )


def check_workers(cfg: Config, world: int) -> None:
    """Refuse a worker count other than the devices the config's layout needs, naming the fix."""
    parallel = cfg.parallel
    if cfg.devices == world:
        return
    dp = parallel.data_parallel_for(world)
    fix = (
        f"--set parallel.data_parallel={dp}"
        if dp
        else f"a multiple of {parallel.replica_devices} workers for another data_parallel"
    )
    raise ConfigError(
        f"the config needs {cfg.devices} devices (data_parallel={parallel.data_parallel} x "
        f"{parallel.replica_product()}) but {world} worker(s) were started; "
        f"launch {cfg.devices} workers or {fix}"
    )


def check_runnable(cfg: Config, device: str, world: int) -> None:
    """Refuse, before compiling, what this device and worker count cannot run (ConfigError)."""
    check_device(cfg, device)
    check_workers(cfg, world)
