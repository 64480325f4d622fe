"""Mixture-of-experts SFT with padding: every parameter's gradient, the pad token's embedding row included,
equals transformers' for tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 models (torch, CPU), within 1e-5 of
the parameter's gradient norm.

The batch is SFT data as the trainer feeds it (mindscale/train/data/dataset.py, make_batch): a full row and a
row padded with the pad id, prompts untrained, the loss mask aligned with the labels. transformers' side is
its model's forward on the same weights and its own pieces of the loss: the cross entropy of the trained
labels (its loss_function), plus the model's router_aux_loss_coef x the load-balancing loss averaged over
the layers with experts, each layer's computed by its load_balancing_loss_func given the loss mask
(models/moe.py says why the loss mask, and docs/models.md why per layer). DeepSeek-V3's modeling in
transformers has no balance loss; MindScale's Switch-form stand-in (E sum_e f_e P_e over the scores
normalised per token) is written here in torch on transformers' router inputs and choices.

The pad row is zero, as Hugging Face checkpoints hold it (the embedding's padding_idx), and the models are
built without padding_idx, so that transformers computes that row's gradient instead of freezing it.
Counted over every token, padding included, the balance loss gave that row a gradient scaled by the norm's
1/sqrt(eps) (the zero row), which the gradient norm and its clipping then carried.
"""

import tempfile

import numpy as np
import pytest
import torch
from mindspore import Tensor, nn, ops
from transformers import DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import models
from mindscale.config import config_from_tree
from models.hf_convert import hf_to_mindscale, mindscale_to_hf, read_hf_folder
from tests.modes import cpu_mode
from tests.models.tiny_hf_configs import deepseek_v3_config

pynative_mode = cpu_mode("pynative")  # one step's gradients: faster than compiling the graph

VOCAB, SEQ, PAD = 128, 16, 0
EXAMPLES = [(4, SEQ + 1), (3, 9)]  # (prompt tokens, example tokens) per row: a full row, a row padded by 8
TOLERANCE = 1e-5  # |ours - transformers'| / |transformers'| per parameter (norms), the pad row against the embedding's


def hf_model(arch: str):
    """A tiny random model at initializer_range 0.25 (routing decided by clear margins), its pad row zeroed."""
    torch.manual_seed(0)
    dims = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        initializer_range=0.25,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":  # 4 experts, top-2
        model = MixtralForCausalLM(
            MixtralConfig(
                **dims, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, router_aux_loss_coef=0.02
            )
        )
    elif arch == "qwen3_moe":  # 8 experts, top-2 renormalised
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **dims,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                rms_norm_eps=1e-6,
                router_aux_loss_coef=0.02,
            )
        )
    else:  # a dense first layer and two with 8 experts in 4 groups (2 kept), top-3, shared experts
        model = DeepseekV3ForCausalLM(deepseek_v3_config(**{**dims, "num_hidden_layers": 3}))
    with torch.no_grad():
        model.model.embed_tokens.weight[PAD].zero_()
    return model.train()


def sft_batch():
    """(tokens [B, S+1] as stored, loss mask [B, S] of the labels): answers trained, prompts and padding not."""
    rng = np.random.default_rng(0)
    tokens = np.full((len(EXAMPLES), SEQ + 1), PAD, np.int64)
    answer = np.zeros(tokens.shape, np.float32)
    for row, (prompt, length) in enumerate(EXAMPLES):
        tokens[row, :length] = rng.integers(1, VOCAB, length)
        answer[row, prompt:length] = 1
    return tokens, answer[:, 1:]


class Grads(nn.Cell):
    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network, self.weights = network, network.trainable_params()
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, *inputs):
        return self.network(*inputs), self.grad(self.network, self.weights)(*inputs)


def mindscale_step(hf, tokens, mask):
    """(loss, [aux loss, max load] logged, gradients by Hugging Face name, model.moe.aux_loss_coeff) of
    MindScale's SFT loss network on the converted weights, the model keys from the checkpoint's config.json."""
    folder = tempfile.mkdtemp()
    hf.save_pretrained(folder, safe_serialization=True)
    model_keys, weights = hf_to_mindscale(*read_hf_folder(folder))
    cfg = config_from_tree({"model": {**model_keys, "seq_length": SEQ}})
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    network = models.build_train_network(cfg, model)
    loss, grads = Grads(network)(Tensor(tokens.astype(np.int32)), Tensor(mask))
    by_name = {p.name: g.asnumpy() for p, g in zip(network.trainable_params(), grads)}
    untrained = {p.name: np.zeros(p.shape, np.float32) for p in model.get_parameters() if p.name not in by_name}
    hf_grads, _ = mindscale_to_hf({**by_name, **untrained}, cfg.model)
    return float(loss.asnumpy()), network.loss.moe_stats.asnumpy(), hf_grads, cfg.model.moe.aux_loss_coeff


def routed_layers(hf, arch: str, ids) -> tuple:
    """(the forward's output, per layer with experts (router probabilities [N, E], chosen experts [N, k]), with
    grad): the softmax of the router logits; DeepSeek-V3's sigmoid scores normalised per token and its router's
    choice."""
    if arch != "deepseek_v3":
        out = hf(ids, output_router_logits=True)
        k = hf.num_experts_per_tok
        return out, [(torch.softmax(r, -1), torch.topk(r, k, -1).indices) for r in out.router_logits]
    seen = []
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda gate, inputs, out: seen.append((gate, inputs[0], out[0]))) for g in gates]
    out = hf(ids)
    for hook in hooks:
        hook.remove()
    routed = []
    for gate, x, chosen in seen:
        scores = torch.sigmoid(x.reshape(-1, x.shape[-1]) @ gate.weight.T)
        routed.append((scores / scores.sum(-1, keepdim=True), chosen))
    return out, routed


def balance(probs, chosen, mask):
    """E sum_e f_e P_e and max_e f_e / mean_e f_e over the tokens `mask` [N] marks (the Switch form)."""
    experts = probs.shape[-1]
    picked = torch.zeros_like(probs).scatter_(1, chosen, 1.0)
    fraction = (picked * mask[:, None]).sum(0) / mask.sum()
    prob = (probs * mask[:, None]).sum(0) / mask.sum()
    return experts * (fraction * prob).sum(), fraction.max() / fraction.mean()


def transformers_step(hf, arch: str, coeff: float, tokens, mask):
    """(loss, [aux loss, max load], gradients by name) of transformers' model on the same batch."""
    hf.zero_grad()
    ids = torch.tensor(tokens[:, :-1])
    out, routed = routed_layers(hf, arch, ids)
    trained = torch.tensor(mask)
    labels = torch.tensor(np.where(mask > 0, tokens[:, 1:], -100))  # shifted as our labels are
    cross_entropy = hf.loss_function(out.logits, None, VOCAB, shift_labels=labels)
    stats = [balance(probs, chosen, trained.reshape(-1)) for probs, chosen in routed]
    if arch == "deepseek_v3":
        aux = torch.stack([s[0] for s in stats]).mean()
    else:  # transformers' own function per layer, given the loss mask
        experts = out.router_logits[0].shape[-1]
        aux = torch.stack(
            [load_balancing_loss_func((r,), experts, hf.num_experts_per_tok, trained) for r in out.router_logits]
        ).mean()
    loss = cross_entropy + coeff * aux
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in hf.named_parameters()}
    logged = [float(aux.detach()), max(float(s[1].detach()) for s in stats)]
    return float(loss.detach()), logged, grads


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_sft_gradients_with_padding_match_transformers_parameter_by_parameter(arch):
    hf = hf_model(arch)
    tokens, mask = sft_batch()
    loss, logged, ours, coeff = mindscale_step(hf, tokens, mask)
    if arch != "deepseek_v3":  # its config.json's coefficient (DeepSeek-V3's has none: MindScale's default)
        assert coeff == pytest.approx(hf.config.router_aux_loss_coef)
    want_loss, want_logged, theirs = transformers_step(hf, arch, coeff, tokens, mask)
    buffers = {name for name, _ in hf.named_buffers()}  # DeepSeek-V3's correction bias: not trained by either
    assert set(ours) - buffers == set(theirs)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(logged[:2], want_logged, rtol=1e-5)  # [2]: the sequence-wise loss
    embedding = "model.embed_tokens.weight"
    pad_row = np.linalg.norm(ours[embedding][PAD] - theirs[embedding][PAD]) / np.linalg.norm(theirs[embedding])
    assert pad_row <= TOLERANCE, f"the pad row's gradient is {pad_row:.3g} of the embedding's"
    off = {name: float(np.linalg.norm(ours[name] - g) / np.linalg.norm(g)) for name, g in theirs.items()}
    assert max(off.values()) <= TOLERANCE, sorted(off.items(), key=lambda item: -item[1])[:3]
    norm, want_norm = (
        np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values())) for grads in (ours, theirs)
    )
    assert norm == pytest.approx(want_norm, rel=TOLERANCE)
