"""The planner states what dropless as capacity T costs: E/top_k times the expert slots (so FLOPs and buffers)
of a capacity factor of 1, the top_k x T routed tokens a GroupedMatmul dropless would compute."""

from __future__ import annotations

import pytest

from mindscale.config import REPO_ROOT, load_config
from mindscale.perf import planner
from mindscale.perf.planner.activations import expert_slots

CONFIGS = {
    "mixtral": REPO_ROOT / "configs" / "mixtral" / "mixtral_8x7b.yaml",
    "deepseek_v3": REPO_ROOT / "configs" / "deepseek_v3" / "deepseek_v3_671b.yaml",
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_planner_states_the_cost_of_dropless_as_capacity_t(name):
    dropless = load_config(CONFIGS[name], ["model.moe.capacity_factor=null"])
    factor_one = load_config(CONFIGS[name], ["model.moe.capacity_factor=1.0"])
    moe = dropless.model.moe
    ratio = moe.num_experts / moe.top_k
    assert expert_slots(dropless) == pytest.approx(ratio * expert_slots(factor_one))
    said = [a for a in planner.predict(dropless, 313)["assumptions"] if a.startswith("dropless as capacity T")]
    assert len(said) == 1 and f"{ratio:g}x (E/top_k)" in said[0]
    assert not [a for a in planner.predict(factor_one, 313)["assumptions"] if a.startswith("dropless")]
    grouped = load_config(CONFIGS[name], ["model.moe.capacity_factor=null", "model.moe.dispatch=grouped"])
    said = [a for a in planner.predict(grouped, 313)["assumptions"] if a.startswith("dropless by grouped")]
    assert len(said) == 1 and f"{ratio:g}x (E/top_k)" in said[0]
