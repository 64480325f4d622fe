"""mindscale/devices.py: the one decision of which accelerator a host has (launcher and workers)."""
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
    with pytest.raises(ConfigError, match=r"this host's NPUs are ascend910 \(MindSpore\) but hardware='ascend910b' "
                                          r"describes ascend910b; use --set hardware=ascend910a") as refused:
        check_chip(b, "ascend910")
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="a hardware profile with soc_version: ascend910_93"):
        check_chip(load_config(tiny, ["hardware=ascend910a"]), "ascend910_93")
