"""MindSpore's execution mode per test module: set when the module's first test runs, not at import
(pytest imports every test module before running any, and an xdist worker runs modules in any order).

    pynative_mode = cpu_mode("pynative")   # at module level: an autouse, module-scoped fixture
"""

import mindspore as ms
import pytest

MODES = {"graph": ms.GRAPH_MODE, "pynative": ms.PYNATIVE_MODE}


def cpu_mode(name: str):
    @pytest.fixture(scope="module", autouse=True)
    def mode():
        ms.set_context(device_target="CPU", mode=MODES[name])
        yield
        ms.set_context(mode=ms.GRAPH_MODE)

    return mode
