"""Generation: KV-cache decoding of converted tiny random Hugging Face models against transformers: LLaMA,
LLaMA-3.1 RoPE scaling (positions past the original context), Qwen2 with tied embeddings, Qwen3
(qk-norm, heads wider than hidden/heads), the mixtures of experts Mixtral and Qwen3-MoE, and DeepSeek-V3
(multi-head latent attention: its rotary part alone rotated, its narrower values padded in the cache)."""

import json
import shutil
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
import torch
from transformers import (
    DeepseekV3ForCausalLM,
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
from models.generation import KVCacheDecoder, Sampler, generate
from mindscale.config import REPO_ROOT, load_config
from tests.models.tiny_hf_configs import deepseek_v3_config
from tests.modes import cpu_mode

TINY = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")
PROMPT = [1, 5, 9, 33, 40, 7]
NEW = 20


SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 14,
}


# the decoder as a graph, as on Ascend (tools/generate.py on CPU runs it in PyNative: its CLI tests below): the
# two compiles cost less than PyNative's steps here (this module's in-process tests: 50 CPU-s, 110 in PyNative)
graph_mode = cpu_mode("graph")


def save_hf_model(kind: str, tmp_path_factory):
    """(folder, model): a random model (GQA, 2 layers) saved as safetensors; a wide init so logits are not
    near-ties."""
    torch.manual_seed(0)
    dims = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "qwen2":  # q/k/v biases start at zero in transformers: make them count
        model = Qwen2ForCausalLM(Qwen2Config(**dims, rope_theta=1e6, tie_word_embeddings=True)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    elif kind == "qwen3":  # the head norms start at one in transformers: make them count
        model = Qwen3ForCausalLM(Qwen3Config(**dims, head_dim=24, rope_theta=1e6)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    p.normal_(1, 0.2)
    elif kind == "mixtral":
        model = MixtralForCausalLM(
            MixtralConfig(**dims, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)
        ).eval()
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **dims,
                head_dim=24,
                num_experts=8,
                num_experts_per_tok=3,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                rope_theta=1e6,
            )
        ).eval()
    elif kind == "deepseek_v3":
        model = DeepseekV3ForCausalLM(deepseek_v3_config(**dims)).eval()
    else:
        scaling = SCALING if kind == "llama31" else None
        model = LlamaForCausalLM(LlamaConfig(**dims, rope_theta=500.0, rope_scaling=scaling)).eval()
    folder = tmp_path_factory.mktemp("hf") / kind
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@pytest.fixture(scope="module", params=["llama", "llama31", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"])
def hf_folder(tmp_path_factory, request):
    return save_hf_model(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory)


def build_decoder(folder):
    weights, cfg = models.load_inference_weights(folder, load_config(TINY))
    model = models.build_model(cfg)
    models.load_weights_into(model, weights)
    return KVCacheDecoder(model, cfg, len(PROMPT) + NEW), model


@pytest.fixture(scope="module")
def decoder(hf_folder):
    """Of every architecture: for the tests of what the architectures change (attention, positions)."""
    return build_decoder(hf_folder[0])


@pytest.fixture(scope="module")
def llama_decoder(llama_folder):
    return build_decoder(llama_folder[0])


def hf_greedy(model, prompt, new):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def test_dims_come_from_the_hf_config(llama_decoder):
    model = llama_decoder[1]
    assert len(model.layers) == 2 and model.vocab_size == 96
    assert model.layers[0].attention.num_kv_heads == 2


def test_greedy_matches_transformers_exactly(hf_folder, decoder):
    ours = generate(decoder[0], PROMPT, NEW, Sampler(greedy=True))
    assert ours == hf_greedy(hf_folder[1], PROMPT, NEW)


def test_cached_steps_equal_the_full_forward(decoder):
    """Each incremental step's logits equal the full (uncached) model's logits at that position."""
    step_decoder, model = decoder
    ids = PROMPT + [11, 12, 13]
    full = model(ms.Tensor(np.array([ids], np.int32))).asnumpy()[0]
    k, v = step_decoder.empty_cache(1)
    logits, k, v = step_decoder(
        ms.Tensor(np.array([PROMPT], np.int32)), ms.Tensor(np.arange(len(PROMPT), dtype=np.int32)), k, v
    )
    np.testing.assert_allclose(logits.asnumpy()[0], full[len(PROMPT) - 1], atol=1e-4)
    for pos in range(len(PROMPT), len(ids)):
        logits, k, v = step_decoder(
            ms.Tensor(np.array([[ids[pos]]], np.int32)), ms.Tensor(np.array([pos], np.int32)), k, v
        )
        np.testing.assert_allclose(logits.asnumpy()[0], full[pos], atol=1e-4)


def test_sampling_is_seeded_and_top_k_1_is_greedy(llama_decoder):
    dec = llama_decoder[0]
    a = generate(dec, PROMPT, 4, Sampler(greedy=False, temperature=1.5, top_p=0.9, seed=3))
    b = generate(dec, PROMPT, 4, Sampler(greedy=False, temperature=1.5, top_p=0.9, seed=3))
    other = generate(dec, PROMPT, 4, Sampler(greedy=False, temperature=1.5, top_p=0.9, seed=4))
    assert a == b and other != a
    assert generate(dec, PROMPT, 4, Sampler(greedy=False, top_k=1, seed=5)) == generate(dec, PROMPT, 4, Sampler())


def test_sampler_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    top2 = Sampler(greedy=False, top_k=2, seed=0).chooser()
    assert {top2(logits) for _ in range(200)} == {0, 1}
    nucleus = Sampler(greedy=False, top_p=0.7, seed=0).chooser()  # 0.5 < 0.7 <= 0.8: tokens 0 and 1
    assert {nucleus(logits) for _ in range(200)} == {0, 1}
    with pytest.raises(ValueError, match="temperature"):
        Sampler(greedy=False, temperature=0)


def test_any_stop_id_ends_generation(llama_decoder):
    first = generate(llama_decoder[0], PROMPT, NEW, Sampler())
    stopped = generate(llama_decoder[0], PROMPT, NEW, Sampler(), stop_ids={first[5], first[3]})
    assert stopped == first[: first.index(first[3]) + 1]


def sentencepiece_model(path, vocab_size):
    """(file, pieces): a character SentencePiece model of at most `vocab_size` pieces (special ids as
    tools/train_tokenizer.py numbers them)."""
    import sentencepiece

    text = ["def main(argv): return sorted(set(argv))", "for line in open(path): print(line.strip())"] * 50
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_prefix=str(path),
        vocab_size=vocab_size,
        model_type="char",
        pad_id=0,
        unk_id=1,
        eos_id=2,
        bos_id=3,
        minloglevel=2,
        hard_vocab_limit=False,
    )
    model = path.with_suffix(".model")
    return model, sentencepiece.SentencePieceProcessor(model_file=str(model)).vocab_size()


def test_a_padded_vocabulary_and_an_eos_list_generate_as_transformers_would(
    llama_decoder, llama_folder, tmp_path, capsys
):
    """A folder whose model vocabulary (96) is padded past its SentencePiece tokenizer's and whose
    generation_config.json lists two EOS ids (as LLaMA-3's does): tools/generate.py chooses only ids the
    tokenizer has (SentencePiece refuses to decode the others) and stops after either EOS."""
    folder = tmp_path / "hf"
    shutil.copytree(llama_folder[0], folder)
    model, pieces = sentencepiece_model(tmp_path / "sp", 30)
    shutil.copy(model, folder / "tokenizer.model")
    assert max(generate(llama_decoder[0], PROMPT, NEW, Sampler())) >= pieces  # the whole vocabulary goes past
    ours = generate(llama_decoder[0], PROMPT, NEW, Sampler(), vocab=pieces)
    stop = next(t for t in ours[3:] if t != 2)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, stop]}))
    result = generate_in_process(folder, NEW, capsys)
    end = min(ours.index(t) for t in (2, stop) if t in ours)
    assert result["ids"] == ours[: end + 1] and isinstance(result["text"], str)


def greedy_args(folder, new):
    prompt = ",".join(map(str, PROMPT))
    return [
        "--load_checkpoint",
        str(folder),
        "--prompt-ids",
        prompt,
        "--max_new_tokens",
        str(new),
        "--greedy",
        "--json",
    ]


def generate_in_process(folder, new, capsys) -> dict:
    """tools/generate.py's JSON for PROMPT, greedy, in this process (PyNative, as its CLI runs on CPU; graph mode
    is set back for the module)."""
    from tools import generate as tool

    try:
        assert tool.main(greedy_args(folder, new)) == 0
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    return json.loads(capsys.readouterr().out)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "tools/generate.py", "--config", TINY, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.integration
def test_cli_on_an_hf_folder_prints_the_transformers_ids(llama_folder):
    proc = run_cli(*greedy_args(llama_folder[0], 6))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    expected = hf_greedy(llama_folder[1], PROMPT, 6)
    if 2 in expected:  # the HF config's eos_token_id stops our generation (kept, as transformers does)
        expected = expected[: expected.index(2) + 1]
    assert result["ids"] == expected and result["text"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,999"], "--prompt-ids"),
        (["--prompt", "hello"], "tokenizer"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "--top-p"),
    ],
)
@pytest.mark.integration
def test_cli_bad_input_is_one_line_exit_2(llama_folder, args, message):
    proc = run_cli("--load_checkpoint", str(llama_folder[0]), "--max_new_tokens", "2", *args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-1500:]


def test_without_config_an_hf_folder_brings_its_model_and_a_bare_file_asks_for_one(llama_folder, capsys):
    from tools import generate as tool

    expected = hf_greedy(llama_folder[1], PROMPT, 6)
    if 2 in expected:  # the HF config's eos_token_id stops our generation (kept, as transformers does)
        expected = expected[: expected.index(2) + 1]
    assert generate_in_process(llama_folder[0], 6, capsys)["ids"] == expected
    bare = llama_folder[0] / "model.safetensors"
    with pytest.raises(SystemExit) as refused:
        tool.main(["--load_checkpoint", str(bare), "--prompt-ids", "1"])
    assert refused.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"error: {bare} has no config.yaml beside its weights (a step folder keeps the config it was trained with); "
        "pass --config with that config"
    ]
