"""Hugging Face interop: tiny random HF LLaMA (plain and with LLaMA-3.1 RoPE scaling), Qwen2 (tied and
untied), Qwen3 (qk-norm, heads wider than hidden/heads), GPT-2, Mixtral, Qwen3-MoE and DeepSeek-V3 (with and
without the query's low rank, interleaved rotary weights or not) models (torch, CPU) against ours.

Converted weights must give the same fp32 logits (1e-4) and loss, and converting back must
reproduce the HF tensors bit for bit, through the library and through tools/convert_checkpoint.py.
"""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mindspore import Tensor
from safetensors.torch import save_file as torch_save_file
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers import (
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import models
from models.transformer import CausalLMLoss
from models.hf_convert import HFConversionError, hf_to_mindscale, mindscale_to_hf, read_hf_folder, write_hf_folder
from models.tensor_file import open_tensors
from tools import convert_checkpoint
from mindscale.config import config_from_tree
from tests.models.test_moe_sft_parity import balance, routed_layers
from tests.slices import LAYOUTS, assert_every_slice_matches
from tests.models.tiny_hf_configs import deepseek_v3_config
from tests.modes import cpu_mode


VOCAB, SEQ, BATCH = 128, 16, 2
ROOT = Path(__file__).resolve().parents[2]


# LLaMA-3.1 scaling with all three bands at head_dim 16, theta 100: wavelength 6.3 is kept (< 14/2), 11.2
# blended, the rest divided by the factor; SEQ = 16 positions reach past the original 14.
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 14,
}
ARCHS = [
    "llama",
    "llama31",
    "qwen2",
    "qwen2_tied",
    "qwen3",
    "gpt",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v3_plain",
]
HF_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gpt": GPT2LMHeadModel,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}


graph_mode = cpu_mode("graph")


def hf_model(arch: str):
    """A tiny HF model whose every tensor (norms and biases too) is random, so nothing hides."""
    torch.manual_seed(0)
    dims = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**dims, rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False))
    elif arch == "llama31":
        model = LlamaForCausalLM(
            LlamaConfig(
                **dims, rope_theta=100.0, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_scaling=LLAMA31_SCALING
            )
        )
    elif arch.startswith("qwen2"):
        model = Qwen2ForCausalLM(
            Qwen2Config(**dims, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=arch == "qwen2_tied")
        )
    elif arch == "qwen3":  # 4 heads of 24 on a width of 64, as Qwen3 32B's 64 heads of 128 on 5120
        model = Qwen3ForCausalLM(
            Qwen3Config(**dims, head_dim=24, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
        )
    elif arch == "mixtral":  # 4 experts, top-2, renormalised
        model = MixtralForCausalLM(
            MixtralConfig(
                **dims,
                num_local_experts=4,
                num_experts_per_tok=2,
                rope_theta=1e6,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
            )
        )
    elif arch == "qwen3_moe":  # 8 fine-grained experts of 32, top-3 not renormalised, heads of 24
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **dims,
                head_dim=24,
                num_experts=8,
                num_experts_per_tok=3,
                moe_intermediate_size=32,
                norm_topk_prob=False,
                rope_theta=1e6,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            )
        )
    elif arch.startswith("deepseek_v3"):
        model = DeepseekV3ForCausalLM(deepseek_v3_config(arch.endswith("plain"), **dims))
        with torch.no_grad():  # the correction bias, a buffer: small enough that every biased score stays > 0
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.uniform_(-0.05, 0.05)
    else:
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=SEQ,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory):
    arch = request.param
    hf = hf_model(arch)
    folder = tmp_path_factory.mktemp(f"hf_{arch}")
    hf.save_pretrained(folder, safe_serialization=True)
    hf_state, hf_config = read_hf_folder(folder)
    model_keys, weights = hf_to_mindscale(hf_state, hf_config)
    cfg = config_from_tree({"model": {**model_keys, "seq_length": SEQ}})
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    return arch, hf, folder, hf_state, cfg, model, weights


def test_logits_and_loss_match_hugging_face(converted):
    _, hf, _, _, cfg, model, _ = converted
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ))
    ignored = rng.random((BATCH, SEQ)) < 0.25
    hf_labels = np.where(ignored, -100, ids)
    with torch.no_grad():
        out = hf(torch.tensor(ids), labels=torch.tensor(hf_labels))
    np.testing.assert_allclose(model(Tensor(ids.astype(np.int32))).asnumpy(), out.logits.numpy(), atol=1e-5)
    # HF shifts labels inside; ours are given shifted, with the mask carrying HF's -100.
    labels = np.roll(ids, -1, axis=1).astype(np.int32)
    mask = np.ones((BATCH, SEQ), np.float32)
    mask[:, -1] = 0
    mask[:, :-1] *= ~ignored[:, 1:]
    network = CausalLMLoss(model)  # the cross entropy alone: transformers adds no router loss by default
    loss = network(Tensor(ids.astype(np.int32)), Tensor(labels), Tensor(mask))
    assert float(loss.asnumpy()) == pytest.approx(float(out.loss), abs=1e-5)
    # the load-balancing loss over the trained tokens (the loss mask), averaged over the layers with experts
    if cfg.model.spec.moe and cfg.model.moe.router == "softmax":  # transformers' per layer, given the mask
        with torch.no_grad():
            routers = hf(torch.tensor(ids), output_router_logits=True).router_logits
        moe = cfg.model.moe
        per_layer = [
            float(load_balancing_loss_func((r,), moe.num_experts, moe.top_k, torch.tensor(mask))) for r in routers
        ]
        assert float(network.moe_stats.asnumpy()[0]) == pytest.approx(np.mean(per_layer), rel=1e-5)
    elif cfg.model.spec.moe:  # the sigmoid router's: its scores normalised per token
        assert float(network.moe_stats.asnumpy()[0]) == pytest.approx(sigmoid_aux_loss(hf, ids, mask), rel=1e-5)


def sigmoid_aux_loss(hf, ids, mask) -> float:
    """E x sum_e f_e P_e over the tokens `mask` marks of each DeepseekV3TopkRouter (its chosen experts, its
    scores over their sum), averaged over the layers that have one (not the dense first layers)."""
    with torch.no_grad():
        _, routed = routed_layers(hf, "deepseek_v3", torch.tensor(ids))
    return float(
        np.mean([float(balance(probs, chosen, torch.tensor(mask).reshape(-1))[0]) for probs, chosen in routed])
    )


def test_mindscale_to_hf_reproduces_the_tensors_and_transformers_loads_them(converted, tmp_path):
    arch, hf, _, hf_state, cfg, _, weights = converted
    back, back_config = mindscale_to_hf(weights, cfg.model)
    assert set(back) == set(hf_state)
    for name, value in hf_state.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    write_hf_folder(tmp_path, back, back_config)
    reloaded = HF_CLASSES[cfg.model.arch].from_pretrained(tmp_path).eval()
    loaded = reloaded.state_dict()  # transformers put every tensor where it came from, bit for bit
    assert set(loaded) == set(hf.state_dict())
    assert all(torch.equal(loaded[name], value) for name, value in hf.state_dict().items())
    # and it runs them: torch's CPU kernels can differ in the last bit between two calls on a busy host
    # (qwen3_moe in CI: 2.7e-7 with every tensor equal), so the logits agree to 1e-6, not bit for bit
    ids = torch.tensor(np.arange(SEQ).reshape(1, SEQ) % VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.integration
def test_cli_round_trip_and_bad_input_exit_2(converted, tmp_path, capsys):
    arch, _, folder, hf_state, cfg, _, _ = converted
    assert (
        convert_checkpoint.main(
            ["--direction", "hf2ms", "--input", str(folder), "--output", str(tmp_path / "ckpt"), "--json"]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["arch"] == cfg.model.arch and result["parameters"] == models.count_parameters(cfg)
    assert result["parameters"] == sum(v.size for k, v in hf_state.items())  # HF's count (tied: one copy)
    step_dir = tmp_path / "ckpt" / "step_00000000"
    assert result["output"] == str(step_dir) and (step_dir / "COMPLETE").is_file()
    assert models.load_pretrained(step_dir, cfg).keys() == models.load_pretrained(folder, cfg).keys()
    assert (
        convert_checkpoint.main(["--direction", "ms2hf", "--input", str(step_dir), "--output", str(tmp_path / "hf")])
        == 0
    )
    again, _ = read_hf_folder(tmp_path / "hf")
    assert set(again) == set(hf_state)
    assert all(np.array_equal(again[k], hf_state[k]) for k in hf_state)
    if arch != "llama":
        return
    # ms2hf into the Hugging Face folder it came from: one line, exit 2, nothing touched; with --overwrite it
    # replaces its own files and keeps the tokenizer and generation config it did not write
    source = tmp_path / "source"
    shutil.copytree(folder, source)
    (source / "tokenizer.model").write_bytes(b"a tokenizer")
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    export = ["--direction", "ms2hf", "--input", str(step_dir), "--output", str(source)]
    with pytest.raises(SystemExit) as refused:
        convert_checkpoint.main(export)
    assert refused.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"error: --output {source} is not empty (config.json, generation_config.json, model.safetensors and 1 more); "
        "pass --overwrite to replace the files the export writes there and keep the others, or choose another folder"
    ]
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    assert convert_checkpoint.main([*export, "--overwrite"]) == 0
    assert sorted(p.name for p in source.iterdir()) == sorted(before)
    assert all((source / name).read_bytes() == before[name] for name in ("tokenizer.model", "generation_config.json"))
    again, _ = read_hf_folder(source)
    assert all(np.array_equal(again[k], hf_state[k]) for k in hf_state)
    # A config whose dims differ from the checkpoint: one line, exit 2, nothing written.
    run = subprocess.run(
        [
            sys.executable,
            "tools/convert_checkpoint.py",
            "--direction",
            "hf2ms",
            "--input",
            str(folder),
            "--output",
            str(tmp_path / "bad"),
            "--config",
            "configs/tiny/llama_tiny.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 2
    error = run.stderr.strip().splitlines()
    assert len(error) == 1 and "model.vocab_size=128 (config has 2048)" in error[0]
    assert not (tmp_path / "bad").exists()


def test_load_pretrained_refuses_an_hf_model_that_differs_from_the_config(converted):
    _, _, folder, _, cfg, _, _ = converted
    other = config_from_tree({"model": {**dataclasses.asdict(cfg.model), "hidden_size": 32}})
    with pytest.raises(models.WeightsMismatch, match="model.hidden_size=64 \\(config has 32\\)") as refused:
        models.load_pretrained(folder, other)
    assert str(refused.value).endswith(
        "; set finetune.hf_dims=true to take the model dims from its config.json, or set those model keys"
    )


def test_sharded_index_and_bf16_tensors_are_read(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    tensors, _ = read_hf_folder(tmp_path / "sharded")
    expected = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(tensors) == set(expected) and all(np.array_equal(tensors[k], expected[k]) for k in expected)
    values = torch.randn(3, 5)
    torch_save_file({"w": values.to(torch.bfloat16)}, str(tmp_path / "bf16.safetensors"))
    np.testing.assert_array_equal(
        open_tensors(tmp_path / "bf16.safetensors")["w"][...], values.to(torch.bfloat16).float().numpy()
    )


def test_a_sharded_rank_reads_its_slices_of_a_bf16_hf_folder(converted, tmp_path):
    """load_pretrained(..., sliced=True) of an HF folder (a sharded run's checkpoint.load_path): every
    rank's slice, read through the renames, Conv1D transposes and c_attn split from the mapped BF16
    file, equals the same slice of the whole conversion, for splits of each dimension, with and without
    the optimizer shard."""
    import copy

    _, hf, _, _, cfg, _, _ = converted
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    whole = models.load_pretrained(tmp_path, cfg)
    lazy = models.load_pretrained(tmp_path, cfg, sliced=True)
    assert isinstance(lazy, models.weights.SlicedWeights) and lazy.keys() == whole.keys()
    widened = {k: v.to(torch.bfloat16).float().numpy() for k, v in hf.state_dict().items()}
    _, reference = hf_to_mindscale(widened, hf.config.to_dict())
    assert all(np.array_equal(whole[k], reference[k]) for k in reference)
    assert assert_every_slice_matches(lazy, whole) == 8 * sum(len(LAYOUTS[v.ndim]) for v in whole.values())


def test_unsupported_and_incomplete_checkpoints_are_refused():
    config = hf_model("llama").config.to_dict()
    state = {k: v.numpy() for k, v in hf_model("llama").state_dict().items()}
    with pytest.raises(HFConversionError, match="rope_scaling"):
        hf_to_mindscale(state, {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(HFConversionError, match="sliding window"):
        hf_to_mindscale(state, {**config, "model_type": "qwen2", "use_sliding_window": True})
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(HFConversionError, match="missing 1: model.layers.1.mlp.up_proj.weight"):
        hf_to_mindscale(state, config)
    with pytest.raises(HFConversionError, match="model_type='bert'"):
        hf_to_mindscale({}, {"model_type": "bert"})


def test_export_refuses_a_folder_with_files_and_overwrite_replaces_only_its_own(tmp_path):
    """Pointed at a Hugging Face folder, the export refuses (nothing touched) unless told to overwrite; then it
    replaces its own files and keeps the others (a tokenizer, an earlier sharded checkpoint: transformers' order,
    which read_hf_folder follows, reads the new model.safetensors before the index)."""
    out = tmp_path / "hf"
    out.mkdir()
    torch_save_file({"w": torch.zeros(2, 2)}, str(out / "model-00001-of-00001.safetensors"))
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "old": True}))
    (out / "tokenizer.model").write_bytes(b"a tokenizer")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(HFConversionError) as refused:
        write_hf_folder(out, {"w": np.ones((2, 2), np.float32)}, {"model_type": "llama"})
    assert str(refused.value) == (
        f"--output {out} is not empty (config.json, model-00001-of-00001.safetensors, "
        "model.safetensors.index.json and 1 more); pass --overwrite to replace the files the "
        "export writes there and keep the others, or choose another folder"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    write_hf_folder(
        out,
        {"w": np.ones((2, 2), np.float32)},
        {"model_type": "llama"},
        {"generation_config.json": b"{}"},
        overwrite=True,
    )
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted([*before, "model.safetensors", "generation_config.json"])  # no partial file left
    assert all(after[name] == before[name] for name in before if name != "config.json")
    tensors, config = read_hf_folder(out)
    assert config == {"model_type": "llama"} and list(tensors) == ["w"] and tensors["w"].tolist() == [[1, 1], [1, 1]]
    with pytest.raises(HFConversionError, match="is a file; pass a folder path"):
        write_hf_folder(out / "tokenizer.model", {}, {}, overwrite=True)
    write_hf_folder(tmp_path / "new" / "hf", {"w": np.ones(1, np.float32)}, {"model_type": "llama"})  # made
    assert sorted(p.name for p in (tmp_path / "new" / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_a_mixture_of_experts_checkpoint_into_a_dense_config_is_one_line_naming_both(tmp_path):
    hf_model("mixtral").save_pretrained(tmp_path, safe_serialization=True)
    dense = config_from_tree(
        {
            "model": {
                "arch": "llama",
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "num_layers": 2,
                "num_heads": 4,
                "num_kv_heads": 2,
                "ffn_hidden_size": 96,
            }
        }
    )
    with pytest.raises(models.WeightsMismatch) as refused:
        models.load_pretrained(tmp_path, dense)
    message = str(refused.value)
    assert "\n" not in message and "model.arch='mixtral', a mixture of experts (config has 'llama', dense)" in message


def test_deepseek_v3_mtp_layers_a_config_does_not_build_are_ignored_and_what_is_not_built_is_refused():
    hf = hf_model("deepseek_v3")
    hf_state, config = {k: v.numpy() for k, v in hf.state_dict().items()}, hf.config.to_dict()
    _, weights = hf_to_mindscale(hf_state, config)
    # the multi-token-prediction layer after the 2 decoder layers, as the released checkpoint stores it (part of
    # it: unread, as a config with model.mtp_depth 0 leaves it; tests/models/test_mtp.py reads a whole one)
    mtp = {
        "model.layers.2.eh_proj.weight": np.ones((64, 128), np.float32),
        "model.layers.2.embed_tokens.weight": np.ones((VOCAB, 64), np.float32),
    }
    _, loaded = hf_to_mindscale({**hf_state, **mtp}, {**config, "num_nextn_predict_layers": 1}, mtp_depth=0)
    assert loaded.keys() == weights.keys()
    with pytest.raises(HFConversionError, match="unexpected 2: model.layers.2.eh_proj.weight"):
        hf_to_mindscale({**hf_state, **mtp}, config)  # without the key they are not the MTP module's
    for key, value, message in [
        ("rope_scaling", {"type": "yarn", "factor": 40.0}, "YaRN context extension"),
        ("scoring_func", "softmax", "sigmoid router"),
        ("moe_layer_freq", 2, "dense layers among the MoE"),
        ("num_key_value_heads", 2, "a key and value per head"),
    ]:
        with pytest.raises(HFConversionError, match=message) as refused:
            hf_to_mindscale(hf_state, {**config, key: value})
        assert "\n" not in str(refused.value)


def test_a_softmax_family_refuses_to_export_deepseek_routing_in_one_line():
    from models.hf_convert import hf_config_from_model

    mixtral = config_from_tree(
        {
            "model": {
                "arch": "mixtral",
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "num_layers": 2,
                "num_heads": 4,
                "num_kv_heads": 2,
                "ffn_hidden_size": 96,
                "moe": {"num_experts": 4, "router": "sigmoid", "dense_layers": 1},
            }
        }
    )
    with pytest.raises(HFConversionError, match="model.moe.router=sigmoid, dense_layers=1: mixtral's Hugging Face"):
        hf_config_from_model(mixtral.model)


def test_an_export_carries_what_transformers_generates_with_from_the_folder_a_run_started_from(tmp_path):
    """export_extras of a run fine-tuned from a Hugging Face folder (longer context than the run's, its special
    tokens, a generation config, a tokenizer): those, as they are; a path that is gone is one line naming the fix."""
    from tokenizers import Tokenizer, models as vocabularies
    from mindscale.io import CheckpointError
    from mindscale.config import ConfigError
    from mindscale.train.inference import export_extras

    source = tmp_path / "hf"
    hf = hf_model("llama")
    hf.config.update({"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0})
    hf.generation_config.update(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, do_sample=True, top_p=0.9)
    hf.save_pretrained(source, safe_serialization=True)
    Tokenizer(vocabularies.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>")).save(
        str(source / "tokenizer.json")
    )
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    model = {
        "arch": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 96,
        "seq_length": SEQ,
    }
    cfg = config_from_tree({"model": model, "checkpoint": {"load_path": str(source)}})
    extras = export_extras(cfg)
    assert extras.config == {
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "pad_token_id": 0,
        "max_position_embeddings": 64,
    }  # not the run's seq_length, 16
    assert extras.files == {
        name: (source / name).read_bytes()
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
    }
    assert (extras.tokenizer, extras.generation_config) == (str(source), str(source / "generation_config.json"))
    assert export_extras(config_from_tree({"model": model})) == type(extras)({}, {}, None, None)
    gone = config_from_tree({"model": model, "checkpoint": {"load_path": str(tmp_path / "moved")}})
    with pytest.raises(
        CheckpointError,
        match=f"checkpoint.load_path={tmp_path / 'moved'} does not exist: .*--set checkpoint.load_path=PATH$",
    ):
        export_extras(gone)
    with pytest.raises(ConfigError, match="data.tokenizer=nowhere.model does not exist: .*--set data.tokenizer=null$"):
        export_extras(config_from_tree({"model": model, "data": {"tokenizer": "nowhere.model"}}))
