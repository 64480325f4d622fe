"""mindscale/devices.py: the one decision of which accelerator a host has (launcher and workers); and the
device count a layout needs, as the launcher fits it and a worker checks it."""

import pytest

from mindscale.devices import count_devices, detect_device


@pytest.mark.parametrize("visible, expected", [("0,1", 2), ("3", 1), (" 0 , 2 ,", 2), ("-1", 0), ("NoDevFiles", 0)])
def test_visible_devices_list_counts_only_real_entries(visible, expected):
    assert count_devices("GPU", {"CUDA_VISIBLE_DEVICES": visible}) == expected
    assert count_devices("Ascend", {"ASCEND_RT_VISIBLE_DEVICES": visible}) == expected


def test_an_explicit_device_target_is_taken_as_given():
    assert detect_device("Ascend", {}) == "Ascend"
    assert detect_device("CPU", {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}) == "CPU"
    assert detect_device("auto", {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}) == "Ascend"


def test_a_profile_for_another_chip_than_the_hosts_is_refused_in_one_line():
    """train/loop/runtime.py asks MindSpore which chip this host has (get_ascend_soc_version) before anything is
    built; a 910A host under the 910B profile would take its bf16, peak and overflow rules (no float status)."""
    from mindscale.config import REPO_ROOT, ConfigError, load_config
    from mindscale.train.loop.runtime import check_chip

    tiny = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"
    b = load_config(tiny, ["hardware=ascend910b"])
    check_chip(b, "ascend910b")
    check_chip(b, "")  # the dry run reports no chip
    with pytest.raises(
        ConfigError,
        match=r"this host's NPUs are ascend910 \(MindSpore\) but hardware='ascend910b' "
        r"describes ascend910b; use --set hardware=ascend910a",
    ) as refused:
        check_chip(b, "ascend910")
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="a hardware profile with soc_version: ascend910_93"):
        check_chip(load_config(tiny, ["hardware=ascend910a"]), "ascend910_93")


@pytest.mark.parametrize(
    "config, world, message",
    [
        (
            "configs/tiny/llama_tiny.yaml",
            1,
            "the config needs 2 devices (data_parallel=2 x model_parallel=1 x "
            "pipeline_stage=1) but 1 worker(s) were started; launch 2 workers or --set parallel.data_parallel=1",
        ),
        # context parallel counts in the devices and in the data-parallel degree a worker count allows
        (
            "configs/llama3_1/llama3_1_8b_128k.yaml",
            128,
            "the config needs 256 devices (data_parallel=8 x "
            "model_parallel=8 x context_parallel=4 x pipeline_stage=1) but 128 worker(s) were started; launch 256 "
            "workers or --set parallel.data_parallel=4",
        ),
        (
            "configs/llama3_1/llama3_1_8b_128k.yaml",
            100,
            "launch 256 workers or a multiple of 32 workers for another data_parallel",
        ),
    ],
)
def test_a_worker_count_the_layout_cannot_use_is_refused_naming_the_degrees(config, world, message):
    from mindscale.config import REPO_ROOT, ConfigError, load_config
    from mindscale.train.loop.runtime import check_runnable

    cfg = load_config(REPO_ROOT / config, ["parallel.data_parallel=2"] if "tiny" in config else [])
    with pytest.raises(ConfigError) as refused:
        check_runnable(cfg, cfg.hardware.device_target, world)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_launcher_fits_data_parallel_to_the_world_counting_context_parallel():
    """scripts/run_distribute.sh CONFIG N sets data_parallel = N / (t x c x p) (mindscale/launch/msrun.py)."""
    from mindscale.config import REPO_ROOT, load_config
    from mindscale.launch.msrun import LaunchError, fit_data_parallel

    cfg = load_config(REPO_ROOT / "configs/llama3_1/llama3_1_8b_128k.yaml")  # dp8 x tp8 x cp4
    assert fit_data_parallel(cfg, 256) is None
    assert fit_data_parallel(cfg, 128) == "parallel.data_parallel=4"
    with pytest.raises(
        LaunchError,
        match=r"^80 device\(s\) cannot hold parallel.model_parallel=8 x "
        r"parallel.context_parallel=4 x parallel.pipeline_stage=1 = 32; use a "
        r"multiple of 32 devices$",
    ):
        fit_data_parallel(cfg, 80)
