"""DeepSeek-V3's router (DeepSeek-AI 2024, DeepSeek-V3 §2.1.2): sigmoid scores, a per-expert correction bias
that steers the choice but not the weights, and group-limited routing.

    scores    s = sigmoid(logits) [N, E], fp32
    choice    on s + b (b = router_bias [E]): with G groups of E/G experts, a group is scored by the sum of its
              two best biased scores, the topk_groups best groups kept, the other groups' experts excluded
              (their scores set to -1e9: DeepSeek's reference code masks them with -inf; Hugging Face's fills 0,
              the same choice while every biased score is positive), then the top_k experts
    weights   the unbiased s of the chosen, divided by their sum (+1e-20) when norm_topk_prob, times
              routed_scaling_factor

router_bias is a parameter that is not trained by gradients (requires_grad=False; Hugging Face's
e_score_correction_bias buffer). DeepSeek-V3 moves it after each step, b_e += u x sign(mean load - load_e)
(auxiliary-loss-free balancing, model.moe.bias_update_rate = u): the training step does it
(mindscale/train/loop/step.py, ExpertBalance) from the tokens models/moe.py counts per expert; with u = 0 it
stays what the checkpoint holds (0 from scratch).

For the load-balancing statistics the router also returns s normalised per token (summing to 1 like a
softmax), which models/moe.py's Switch-form aux loss reads as its probabilities.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero, initializer

EXCLUDED = -1e9  # added to the biased scores of the experts outside a token's chosen groups


class SigmoidRouting(nn.Cell):
    """construct(logits [N, E] fp32) -> (weights [N, k] fp32, experts [N, k] int32, normalised scores [N, E])."""

    def __init__(
        self, num_experts: int, top_k: int, groups: int, topk_groups: int, norm_topk_prob: bool, scaling: float
    ):
        super().__init__()
        self.num_experts, self.top_k, self.groups, self.topk_groups = num_experts, top_k, groups, topk_groups
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        self.router_bias = Parameter(
            initializer(Zero(), (num_experts,), ms.float32), name="router_bias", requires_grad=False
        )
        self.sigmoid = ops.Sigmoid()
        self.add_bias = ops.Add()
        self.group_best = ops.TopK(sorted=True)  # [N, G, 2]: each group's two best biased scores
        self.group_score = ops.ReduceSum()
        self.pick_groups = ops.TopK(sorted=True)  # [N, topk_groups]
        self.group_onehot = ops.OneHot()  # [N, topk_groups, G]
        self.group_kept = ops.ReduceSum()  # [N, G]: 1 for a kept group
        self.exclude_sub = ops.Sub()
        self.exclude_scale = ops.Mul()
        self.exclude_add = ops.Add()
        self.topk = ops.TopK(sorted=True)
        self.gather_scores = ops.GatherD()
        self.topk_sum = ops.ReduceSum(keep_dims=True)
        self.topk_eps = ops.Add()
        self.topk_norm = ops.RealDiv()
        self.scale = ops.Mul()
        self.score_sum = ops.ReduceSum(keep_dims=True)
        self.score_norm = ops.RealDiv()
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, logits):
        n, e, g = logits.shape[0], self.num_experts, self.groups
        scores = self.sigmoid(logits)
        biased = self.add_bias(scores, self.router_bias)
        if g > 1:
            grouped = biased.reshape(n, g, e // g)
            best, _ = self.group_best(grouped, 2)
            _, groups = self.pick_groups(self.group_score(best, -1), self.topk_groups)
            kept = self.group_kept(self.group_onehot(groups, g, self.on, self.off), 1).reshape(n, g, 1)
            biased = self.exclude_add(grouped, self.exclude_scale(self.exclude_sub(kept, 1.0), -EXCLUDED)).reshape(n, e)
        _, experts = self.topk(biased, self.top_k)
        weights = self.gather_scores(scores, 1, experts)
        if self.norm_topk_prob:
            weights = self.topk_norm(weights, self.topk_eps(self.topk_sum(weights, -1), 1e-20))
        weights = self.scale(weights, self.scaling)
        return weights, experts, self.score_norm(scores, self.score_sum(scores, -1))

    PARAMETER_INPUTS = {"router_bias": ("add_bias", 1)}

    def shard_strategies(self, style: str, layout) -> dict:
        """Every op splits the tokens (the data x context-parallel rows); the bias is whole on every rank."""
        tokens, grouped = (layout.token_rows, 1), (layout.token_rows, 1, 1)
        return {
            "sigmoid": ((tokens,), None),
            "add_bias": ((tokens, (1,)), None),
            "group_best": ((grouped,), None),
            "group_score": ((grouped,), None),
            "pick_groups": ((tokens,), None),
            "group_onehot": ((grouped, (), ()), None),
            "group_kept": ((grouped,), None),
            "exclude_sub": ((grouped, ()), None),
            "exclude_scale": ((grouped, ()), None),
            "exclude_add": ((grouped, grouped), None),
            "topk": ((tokens,), None),
            "gather_scores": ((tokens, tokens), None),
            "topk_sum": ((tokens,), None),
            "topk_eps": ((tokens, ()), None),
            "topk_norm": ((tokens, tokens), None),
            "scale": ((tokens, ()), None),
            "score_sum": ((tokens,), None),
            "score_norm": ((tokens, tokens), None),
        }
