"""model.moe.dispatch grouped against the capacity path at capacity T on CPU, where both run: the same weights
give the same outputs and gradients. On CPU the grouped experts are a loop over the experts on the tokens sorted
by expert (MindSpore has no CPU GroupedMatmul), so this checks the sort, the per-expert counts and the unsort
back to each token's k choices; GroupedMatmul itself and the AlltoAllV exchange only compile here (the dry run,
docs/evidence/dryrun.md)."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindscale.config import REPO_ROOT, ConfigError, load_config
from models.moe import GroupedExperts, MoE
from tests.modes import cpu_mode

graph_mode = cpu_mode("graph")

H, F, E, K = 8, 12, 4, 2


def layers():
    ms.set_seed(0)
    capacity = MoE(H, F, E, K, True, None, 1, 1, 0, 0.5, 0.5, ms.float32, ms.float32)
    experts = GroupedExperts(E, K, H, F, 0.5, 0.5, ms.float32, ms.float32, False, 1, None, False)
    grouped = MoE(H, F, E, K, True, None, 1, 1, 0, 0.5, 0.5, ms.float32, ms.float32, grouped=experts)
    ours = dict(grouped.parameters_and_names())
    for name, param in capacity.parameters_and_names():
        ours[name].set_data(Tensor(param.asnumpy()))
    return capacity, grouped


def gradients(layer, x):
    def loss(tokens):
        return layer(tokens)[0].square().sum()

    return ms.value_and_grad(loss, None, layer.trainable_params())(x)[1]


def test_grouped_dispatch_equals_the_capacity_path_at_capacity_t():
    capacity, grouped = layers()
    x = Tensor(np.random.default_rng(1).normal(size=(24, H)).astype(np.float32))
    want, got = capacity(x), grouped(x)
    np.testing.assert_allclose(got[0].asnumpy(), want[0].asnumpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1].asnumpy(), want[1].asnumpy())

    for a, b in zip(gradients(capacity, x), gradients(grouped, x)):
        np.testing.assert_allclose(b.asnumpy(), a.asnumpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (["model.moe.capacity_factor=1.25"], "drops no token"),
        (["model.moe.capacity_factor=null", "parallel.model_parallel=2"], "expert_parallel only"),
    ],
)
def test_grouped_dispatch_refusals_name_the_fix(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(REPO_ROOT / "configs/mixtral/mixtral_8x7b.yaml", ["model.moe.dispatch=grouped", *overrides])
