"""The train step's numerics on CPU in graph mode: what decides overflow."""
import pytest

from mindscale.config import Layout, load_config
from mindscale.train.step import SATURATION_MODE, saturates_fp16

TINY = "configs/tiny/llama_tiny.yaml"


@pytest.mark.parametrize("hardware, device, mode, reads", [
    ("ascend910a", "Ascend", None, True),                  # the 910A saturates fp16: always
    ("ascend910b", "Ascend", None, False),                 # inf/nan mode: the norm test sees overflow
    ("ascend910b", "Ascend", SATURATION_MODE, True),       # a 910B told to saturate
    ("ascend910b", "Ascend", "INFNAN_MODE", False),
    ("ascend910a", "CPU", SATURATION_MODE, False),         # no float status off Ascend
])
def test_the_float_status_is_read_where_fp16_saturates(hardware, device, mode, reads):
    cfg = load_config(TINY, [f"hardware={hardware}", "model.compute_dtype=float16"])
    environ = {} if mode is None else {"MS_ASCEND_CHECK_OVERFLOW_MODE": mode}
    assert saturates_fp16(cfg, Layout.of(cfg, device), environ) is reads
