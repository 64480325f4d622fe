"""Which accelerator this host has, decided one way for the launcher and for every worker: the
*_VISIBLE_DEVICES list, else the device files. Pure Python (no MindSpore import), so the launcher
stays fast; a worker then checks that MindSpore's backend for it is installed (train/loop/runtime.py)."""

from __future__ import annotations

import glob

VISIBLE = {
    "Ascend": ("ASCEND_RT_VISIBLE_DEVICES", "/dev/davinci[0-9]*"),
    "GPU": ("CUDA_VISIBLE_DEVICES", "/dev/nvidia[0-9]*"),
}


def count_devices(device: str, env: dict) -> int:
    """Accelerators of one kind visible here: the *_VISIBLE_DEVICES list, else the device files. A list
    that hides every device (CUDA_VISIBLE_DEVICES=-1, Slurm's NoDevFiles) counts none."""
    variable, pattern = VISIBLE[device]
    if env.get(variable, "").strip():
        listed = [d.strip() for d in env[variable].split(",")]
        return len([d for d in listed if d and not d.startswith("-") and d != "NoDevFiles"])
    return len(glob.glob(pattern))


def detect_device(device_target: str, env: dict) -> str:
    """run.device_target when it names a backend, else Ascend, then GPU, then CPU."""
    if device_target != "auto":
        return device_target
    for device in ("Ascend", "GPU"):
        if count_devices(device, env):
            return device
    return "CPU"
