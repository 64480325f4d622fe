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
