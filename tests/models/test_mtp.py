"""Multi-token prediction (models/mtp.py, model.mtp_depth) against a plain torch reference written from the
DeepSeek-V3 report's equations 21-25, on a tiny random DeepSeek-V3 with D = 2 modules, and its checkpoint
layout both ways.

The reference (ReferenceMTP below) follows the report, not our code: module k runs on the truncated sequence of
length T - k of each document alone (transformers' decoder and block, a causal mask of that length), so the
last positions, the packed examples and the loss mask are handled by construction there, and by shifts and
masks in ours. It writes to and is read from a real safetensors Hugging Face folder, as the released
checkpoint stores the modules (model.layers.{L + k}.*, with copies of the embedding and head).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mindspore import ParameterTuple, Tensor, value_and_grad
from safetensors.torch import save_file
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

import models
from mindscale.config import config_from_tree
from models.hf_convert import HFConversionError, hf_to_mindscale, mindscale_to_hf, read_hf_folder
from mindscale.train.loop.evaluate import HeldOutLoss
from models.build import standalone_layout
from models.transformer import CausalLMLoss
from tools import convert_checkpoint
from tests.models.tiny_hf_configs import deepseek_v3_config
from tests.modes import cpu_mode

pynative_mode = cpu_mode("pynative")

VOCAB, SEQ, BATCH, LAYERS, DEPTH, WEIGHT = 128, 12, 2, 2, 2, 0.3


class ReferenceMTP(DeepseekV3DecoderLayer):
    """Module k (report eq. 21-23) as the checkpoint stores it, decoder layer L + k with four more tensors:
    h'_i = eh_proj [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)], then the block, then shared_head.norm before the head."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        width, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = DeepseekV3RMSNorm(width, eps), DeepseekV3RMSNorm(width, eps)
        self.eh_proj = torch.nn.Linear(2 * width, width, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(width, eps)

    def predict(self, rotary, previous, ahead_embeddings):
        """h^k [n, h] of the n = T - k positions from h^{k-1} there and the embeddings of t_{i+k}."""
        n = ahead_embeddings.shape[0]
        joined = self.eh_proj(torch.cat([self.enorm(ahead_embeddings), self.hnorm(previous[:n])], -1))[None]
        positions = torch.arange(n)[None]
        causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        return self(joined, causal, positions, position_embeddings=rotary(joined, positions))[0]


def reference_models():
    """A tiny DeepSeek-V3 (2 layers, the first dense) and D = 2 reference modules, every tensor random."""
    torch.manual_seed(0)
    config = deepseek_v3_config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        num_nextn_predict_layers=DEPTH,
    )
    main = DeepseekV3ForCausalLM(config)
    modules = torch.nn.ModuleList([ReferenceMTP(config, LAYERS + k) for k in range(DEPTH)])
    modules.apply(main._init_weights)  # built outside the model's post_init: the router weight is torch.empty
    with torch.no_grad():
        for p in [*main.parameters(), *modules.parameters()]:
            p.add_(torch.randn_like(p) * 0.05)
        for layer in [*main.model.layers[1:], *modules]:  # the router's correction bias too (a buffer)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return main.train(), modules.train()


def checkpoint_state(main, modules) -> dict:
    """The HF tensors as the released checkpoint stores them: the model's, then module k as layer L + k with its
    own copies of the shared embedding and head."""
    state = {name: t.detach().clone() for name, t in main.state_dict().items()}
    for k, module in enumerate(modules):
        prefix = f"model.layers.{LAYERS + k}."
        state |= {prefix + name: t.detach().clone() for name, t in module.state_dict().items()}
        state[prefix + "embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
        state[prefix + "shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    return state


def documents(segments: np.ndarray):
    """(row, start, end) of every packed example."""
    for row, ids in enumerate(segments):
        starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
        yield from ((row, a, b) for a, b in zip(starts, starts[1:]))


def reference_loss(main, modules, ids, labels, mask, segments) -> torch.Tensor:
    """Main cross entropy + lambda / D x sum_k CE_k (eq. 24-25), every example alone: module k predicts
    t_{i+k+1} (labels[i + k]) at the positions i < T - k of its example, each weighted by the mask of that
    label; CE_k is the mean over the positions it weighs (the main loss's normalisation; the report's 1/T counts
    the T - k positions of a module over T)."""
    ids, labels, mask = torch.tensor(ids), torch.tensor(labels, dtype=torch.long), torch.tensor(mask)
    main_sum = torch.zeros(())
    depth_sums, depth_weights = torch.zeros(DEPTH), torch.zeros(DEPTH)
    for row, a, b in documents(segments):
        hidden = main.model(ids[row, a:b][None]).last_hidden_state[0]  # h^0: after the final norm
        ce = F.cross_entropy(main.lm_head(hidden), labels[row, a:b], reduction="none")
        main_sum = main_sum + (ce * mask[row, a:b]).sum()
        for k, module in enumerate(modules, 1):
            if b - a - k <= 0:
                break
            hidden = module.predict(main.model.rotary_emb, hidden, main.model.embed_tokens(ids[row, a + k : b]))
            logits = main.lm_head(module.shared_head.norm(hidden))
            weight = mask[row, a + k : b]
            ce = F.cross_entropy(logits, labels[row, a + k : b], reduction="none")
            depth_sums = depth_sums.index_add(0, torch.tensor([k - 1]), (ce * weight).sum()[None])
            depth_weights[k - 1] += weight.sum()
    depth_ce = depth_sums / depth_weights.clamp(min=1)
    return main_sum / mask.sum().clamp(min=1) + WEIGHT / DEPTH * depth_ce.sum()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The reference, its checkpoint folder (safetensors), and our model loaded from that folder."""
    main, modules = reference_models()
    folder = tmp_path_factory.mktemp("hf_deepseek_v3_mtp")
    main.config.save_pretrained(folder)
    state = checkpoint_state(main, modules)
    save_file({name: t.contiguous() for name, t in state.items()}, str(folder / "model.safetensors"))
    hf_state, hf_config = read_hf_folder(folder)
    model_keys, weights = hf_to_mindscale(hf_state, hf_config)
    assert model_keys["mtp_depth"] == DEPTH
    cfg = config_from_tree(
        {
            "model": {
                **model_keys,
                "seq_length": SEQ,
                "mtp_loss_weight": WEIGHT,
                "moe": {**model_keys["moe"], "aux_loss_coeff": 0.0, "seq_aux_loss_coeff": 0.0},
            }
        }
    )
    model = models.build_model(cfg)
    models.load_weights_into(model, models.load_pretrained(folder, cfg))  # as a fine-tuning run loads it
    return main, modules, folder, hf_state, cfg, model, weights


def batch(packed: bool):
    """ids, labels (ids shifted), a loss mask with a quarter of the labels untrained, segment ids (packed: 3
    examples in the first row, 2 in the second, one of 1 token) or one example a row."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    mask = (rng.random((BATCH, SEQ)) > 0.25).astype(np.float32)
    segments = np.zeros((BATCH, SEQ), np.int32)
    if packed:
        segments[0, 5:] = 1
        segments[0, 9:] = 2
        segments[1, 1:] = 1
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32), mask, segments


@pytest.mark.parametrize("packed", [False, True])
def test_loss_and_gradients_equal_the_reports_equations(converted, packed):
    main, modules, _, _, cfg, model, _ = converted
    ids, labels, mask, segments = batch(packed)
    main.zero_grad()
    modules.zero_grad()
    expected = reference_loss(main, modules, ids, labels, mask, segments)
    expected.backward()

    network = CausalLMLoss(model)
    weights = ParameterTuple(network.trainable_params())
    inputs = [Tensor(ids), Tensor(labels), Tensor(mask), Tensor(segments) if packed else None]
    loss, grads = value_and_grad(network, None, weights)(*inputs)
    assert float(loss.asnumpy()) == pytest.approx(expected.item(), abs=1e-5)

    # a held-out pass reports the next-token loss alone (its perplexity is the model's), without the
    # multi-token-prediction term or a sequence-wise balance loss training would add
    model.sequence_balance_coeff = 0.5
    try:
        held_out = HeldOutLoss(model, standalone_layout(cfg))
        tokens = Tensor(np.concatenate([ids, labels[:, -1:]], axis=1))
        total, count = held_out(tokens, *inputs[2:]).asnumpy()
    finally:
        model.sequence_balance_coeff = 0.0
    next_token = reference_loss(main, [], ids, labels, mask, segments).item()
    assert total / count == pytest.approx(next_token, abs=1e-5) and next_token < loss.asnumpy() - 1e-3
    # and the training loss notes the term it added, for the metrics' mtp_loss
    assert float(network.mtp_loss.asnumpy()[0]) == pytest.approx(expected.item() - next_token, abs=1e-5)

    # ours by the checkpoint's names, through the same conversion as the weights (transposes, expert stacks);
    # the router's correction bias is not trained (zeros here), the modules' embedding and head are the model's
    ours = {p.name: g.asnumpy() for p, g in zip(weights, grads)}
    frozen = {p.name: np.zeros(p.shape, np.float32) for p in model.get_parameters() if p.name not in ours}
    hf_grads, _ = mindscale_to_hf({**frozen, **ours}, cfg.model)
    theirs = {f"model.layers.{LAYERS + k}.{n}": p.grad for k, m in enumerate(modules) for n, p in m.named_parameters()}
    theirs |= {n: p.grad for n, p in main.named_parameters()}
    copies = {
        f"model.layers.{LAYERS + k}.{n}"
        for k in range(DEPTH)
        for n in ("embed_tokens.weight", "shared_head.head.weight")
    }
    assert set(theirs) == {n for n in hf_grads if not n.endswith("e_score_correction_bias")} - copies
    # a routed expert that no trained token chose has no gradient (None in torch); every other tensor has one
    idle = {name for name, grad in theirs.items() if grad is None or not grad.any()}
    assert all(".mlp.experts." in name for name in idle) and len(idle) < len(theirs) // 4, sorted(idle)
    for name, grad in theirs.items():
        expected = np.zeros(hf_grads[name].shape, np.float32) if grad is None else grad.numpy()
        np.testing.assert_allclose(hf_grads[name], expected, rtol=0, atol=1e-5, err_msg=name)


def test_the_checkpoint_layout_round_trips_through_the_cli_and_a_deeper_config_is_refused(converted, tmp_path):
    _, _, folder, hf_state, cfg, _, weights = converted
    back, back_config = mindscale_to_hf(weights, cfg.model)
    assert set(back) == set(hf_state) and back_config["num_nextn_predict_layers"] == DEPTH
    for name, value in hf_state.items():  # the copies of the embedding and head written back as stored
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    # tools/convert_checkpoint.py both ways, the modules' count from config.json
    step = tmp_path / "ckpt" / "step_00000000"
    assert (
        convert_checkpoint.main(["--direction", "hf2ms", "--input", str(folder), "--output", str(tmp_path / "ckpt")])
        == 0
    )
    assert (
        convert_checkpoint.main(["--direction", "ms2hf", "--input", str(step), "--output", str(tmp_path / "hf")]) == 0
    )
    again, again_config = read_hf_folder(tmp_path / "hf")
    assert set(again) == set(hf_state) and again_config["num_nextn_predict_layers"] == DEPTH
    assert all(np.array_equal(again[name], value) for name, value in hf_state.items())

    hf_config = {**back_config, "model_type": "deepseek_v3"}
    _, first = hf_to_mindscale(hf_state, hf_config, mtp_depth=1)  # the second module is left unread
    assert sorted({n.split(".")[1] for n in first if n.startswith("mtp.")}) == ["0"]
    _, none = hf_to_mindscale(hf_state, hf_config, mtp_depth=0)
    assert not any(n.startswith("mtp.") for n in none) and none.keys() <= weights.keys()
    with pytest.raises(HFConversionError) as refused:
        hf_to_mindscale(hf_state, hf_config, mtp_depth=3)
    assert str(refused.value) == (
        "model.mtp_depth=3 but the checkpoint stores 2 multi-token-prediction modules (num_nextn_predict_layers); "
        "set model.mtp_depth to at most 2"
    )
