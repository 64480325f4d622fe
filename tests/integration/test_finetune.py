"""Fine-tuning end to end on CPU: pretrained start, prompt masking, LoRA checkpoints and resume, HF export.

A module-scoped "pretrained" tiny LLaMA is trained for 40 steps on a small corpus; the SFT data
(Alpaca records) uses the same words, so starting from it must beat starting from scratch.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mindspore import Tensor, ops
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import models
from mindscale.train.checkpoints import folder as ckpt
from mindscale.config import REPO_ROOT, load_config
from mindscale.train.data.dataset import build_dataset
from mindscale.train.data.tokenizers import load_tokenizer
from tests.integration import tiny_runs
from tests.modes import cpu_mode

TINY = str(REPO_ROOT / "configs" / "finetune" / "tiny_sft.yaml")
SMALL = [
    *tiny_runs.SMALL,
    "model.vocab_size=512",
    "model.seq_length=64",
    "train.warmup_steps=0",
    "train.micro_batch_size=4",
]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jokes".split()


pynative_mode = cpu_mode("pynative")


def run(*args, tool="run_train.py", check=True, env=None):
    proc = subprocess.run(
        [sys.executable, tool, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def sets(*overrides):
    return [arg for o in (*SMALL, *overrides) for arg in ("--set", o)]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """tokenizer, pretraining data, SFT data and a 40-step pretrained checkpoint."""
    root = tmp_path_factory.mktemp("finetune")
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(rng.choice(WORDS, 12)) + "." for _ in range(300))
    (root / "text.txt").write_text(text)
    run(
        "--input",
        str(root / "text.txt"),
        "--vocab-size",
        "400",
        "--output",
        str(root / "tok"),
        tool="tools/train_tokenizer.py",
    )
    tok = str(root / "tok.model")
    run(
        "--input",
        str(root / "text.txt"),
        "--tokenizer",
        tok,
        "--seq-length",
        "64",
        "--output",
        str(root / "pre"),
        tool="tools/preprocess_data.py",
    )
    records = [
        {"instruction": " ".join(rng.choice(WORDS, 4)), "output": " ".join(rng.choice(WORDS, 8)) + "."}
        for _ in range(64)
    ]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run(
        "--mode",
        "sft",
        "--template",
        "llama2",
        "--input",
        str(root / "sft.jsonl"),
        "--tokenizer",
        tok,
        "--seq-length",
        "64",
        "--output",
        str(root / "sft"),
        tool="tools/preprocess_data.py",
    )
    run(
        "--config",
        TINY,
        *sets(
            f"run.output_dir={root}",
            "run.name=pre",
            f"data.path={root / 'pre'}",
            f"data.tokenizer={tok}",
            "checkpoint.load_path=null",
            "finetune.template=null",
            "train.steps=40",
            "train.lr=0.01",
            "train.min_lr=0.001",
        ),
    )
    return {"root": root, "tok": tok, "sft": root / "sft", "pretrained": root / "pre" / "checkpoints" / "step_00000040"}


def finetune(work, name, *overrides, check=True, env=None):
    return run(
        "--config",
        TINY,
        *sets(
            f"run.output_dir={work['root']}",
            f"run.name={name}",
            f"data.path={work['sft']}",
            f"data.tokenizer={work['tok']}",
            f"checkpoint.load_path={work['pretrained']}",
            *overrides,
        ),
        check=check,
        env=env,
    )


def test_finetuning_from_pretrained_starts_lower_than_from_scratch(work):
    finetune(work, "from_pretrained", "train.steps=1")
    finetune(work, "from_scratch", "train.steps=1", "checkpoint.load_path=null")
    pretrained, scratch = (
        tiny_runs.losses(work["root"] / "from_pretrained"),
        tiny_runs.losses(work["root"] / "from_scratch"),
    )
    assert pretrained[1] < scratch[1] - 1.0, (pretrained, scratch)


def test_prompt_tokens_do_not_contribute_to_loss_or_grads(work):
    cfg = load_config(
        TINY, [*SMALL, f"data.path={work['sft']}", f"data.tokenizer={work['tok']}", "checkpoint.load_path=null"]
    )
    batch = next(iter(build_dataset(cfg, 0, 1, 0)))
    mask = batch["loss_mask"]
    assert 0 < mask.mean() < 1  # prompts masked, answers kept
    network = models.build_train_network(cfg).loss  # the model's loss of given inputs and labels
    grad_fn = ops.value_and_grad(network, None, network.trainable_params())
    ids, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    changed = np.where(mask == 0, (labels + 7) % 400, labels).astype(np.int32)
    results = [grad_fn(Tensor(ids), Tensor(targets), Tensor(mask)) for targets in (labels, changed)]
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert float(loss_a.asnumpy()) == float(loss_b.asnumpy())
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(grads_a, grads_b))


LORA = [
    "finetune.lora.rank=4",
    "finetune.lora.alpha=8",
    "finetune.lora.target_modules=[wq,wv,wo,w1,w2,w3]",
    "train.lr=0.01",
    "train.min_lr=0.001",
]


@pytest.fixture(scope="module")
def lora_run(work):
    finetune(work, "lora", *LORA, "train.steps=4", "checkpoint.save_interval=2")
    return work["root"] / "lora"


def test_lora_saves_only_adapters_and_resume_matches(work, lora_run):
    saved = ckpt.load_weights(lora_run / "checkpoints" / "step_00000004")
    assert saved and all(name.endswith((".lora_a", ".lora_b")) for name in saved)
    assert any(np.abs(v).max() > 0 for name, v in saved.items() if name.endswith("lora_b"))  # B trained
    common = (*LORA, "train.steps=4", "checkpoint.save_interval=2")
    killed = finetune(work, "lora_resumed", *common, check=False, env={"MINDSCALE_FAULT": "checkpoint_write:4"})
    assert killed.returncode == -9
    resumed = finetune(work, "lora_resumed", *common)
    assert "resumed from" in resumed.stdout
    straight, again = tiny_runs.losses(lora_run), tiny_runs.losses(work["root"] / "lora_resumed")
    np.testing.assert_allclose([again[s] for s in (1, 2, 3, 4)], [straight[s] for s in (1, 2, 3, 4)], rtol=1e-5)


def test_lora_checkpoint_exports_merged_to_transformers_and_back(work, lora_run, tmp_path):
    step = lora_run / "checkpoints" / "step_00000004"
    run(
        "--direction",
        "ms2hf",
        "--input",
        str(step),
        "--output",
        str(tmp_path / "hf"),
        tool="tools/convert_checkpoint.py",
    )
    cfg = load_config(step / ckpt.CONFIG)
    weights, plain_cfg = models.load_inference_weights(step, cfg)
    ours = models.build_model(plain_cfg)
    models.load_weights_into(ours, weights)
    ids = np.random.default_rng(3).integers(0, 400, (2, 16))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours(Tensor(ids.astype(np.int32))).asnumpy(), atol=1e-4)
    base = ckpt.load_weights(work["pretrained"])
    assert any(not np.array_equal(base[k], weights[k]) for k in base)  # the adapters were merged in
    # the run's SentencePiece tokenizer goes along, and transformers encodes with it as we do (BOS first)
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == Path(work["tok"]).read_bytes()
    ours_tok = load_tokenizer(work["tok"])
    text = "the lazy dog jumps over 7 wizards"
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"]
    assert theirs == [ours_tok.bos_id, *ours_tok.encode([text])[0]]
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (3, 2, 0)
    run(
        "--direction",
        "hf2ms",
        "--input",
        str(tmp_path / "hf"),
        "--output",
        str(tmp_path / "back"),
        tool="tools/convert_checkpoint.py",
    )
    back = ckpt.load_weights(tmp_path / "back" / "step_00000000")
    assert sorted(back) == sorted(weights) and all(np.array_equal(back[k], weights[k]) for k in back)


@pytest.fixture(scope="module")
def mixtral_folder(work, tmp_path_factory):
    """A tiny random transformers Mixtral (4 experts, top-2) over the corpus's vocabulary, as a pretrained start,
    as the Hub has them: a context (256) longer than the runs' 64, its special tokens, a generation config and the
    tokenizer (the corpus's SentencePiece model, saved by transformers)."""
    from transformers import GenerationConfig, LlamaTokenizer, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    ids = dict(bos_token_id=3, eos_token_id=2, pad_token_id=0)  # tools/train_tokenizer.py's
    model = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=256,
            **ids,
        )
    ).eval()
    model.generation_config = GenerationConfig(**ids, do_sample=False, max_new_tokens=12)
    folder = tmp_path_factory.mktemp("mixtral") / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    LlamaTokenizer(work["tok"], legacy=True, pad_token="<pad>").save_pretrained(folder)
    return folder


def finetuned_moe(work, mixtral_folder, kind) -> Path:
    """The last step of a 6-step SFT or LoRA run from the Hugging Face Mixtral, dims from its config.json (run
    once a module)."""
    step = work["root"] / f"moe_{kind}" / "checkpoints" / "step_00000006"
    if not step.is_dir():
        lora = (
            ["finetune.lora.rank=4", "finetune.lora.alpha=8", "finetune.lora.target_modules=[wq,wk,wv,wo]"]
            if kind == "lora"
            else []
        )
        finetune(
            work,
            f"moe_{kind}",
            f"checkpoint.load_path={mixtral_folder}",
            "finetune.hf_dims=true",
            *lora,
            "train.steps=6",
            "train.lr=0.01",
            "train.min_lr=0.001",
        )
    return step


@pytest.mark.parametrize("kind", ["sft", "lora"])
def test_mixture_of_experts_finetunes_and_exports_to_transformers(work, mixtral_folder, kind, tmp_path):
    """SFT (every weight, the experts too) and LoRA (attention; LoRA on the experts is refused, validate.py)
    from a Hugging Face Mixtral, dims from its config.json; the loss falls, and the checkpoint exported (LoRA
    merged) gives transformers' MixtralForCausalLM our logits."""
    from transformers import MixtralForCausalLM

    step = finetuned_moe(work, mixtral_folder, kind)
    values = tiny_runs.losses(step.parent.parent)
    assert values[6] < values[1], values
    run(
        "--direction",
        "ms2hf",
        "--input",
        str(step),
        "--output",
        str(tmp_path / "hf"),
        tool="tools/convert_checkpoint.py",
    )
    weights, cfg = models.load_inference_weights(step, load_config(step / ckpt.CONFIG))
    assert cfg.model.arch == "mixtral" and cfg.model.moe.num_experts == 4
    ours = models.build_model(cfg)
    models.load_weights_into(ours, weights)
    ids = np.random.default_rng(3).integers(0, 400, (2, 16))
    with torch.no_grad():
        theirs = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours(Tensor(ids.astype(np.int32))).asnumpy(), atol=1e-4)


CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def test_the_export_generates_in_transformers_as_tools_generate_does_from_the_step(
    work, mixtral_folder, tmp_path, capsys
):
    """The SFT run's export keeps its starting folder's token ids, context, generation config and tokenizer;
    transformers, from the export alone, generates what tools/generate.py generates from the step without
    --config (the step's config.yaml), and with the run's --config and --set finetune.hf_dims=true. A --config
    of other dims is one line naming the step's config.yaml, in both tools."""
    from tools import convert_checkpoint, generate

    step = finetuned_moe(work, mixtral_folder, "sft")
    export = tmp_path / "hf"
    run("--direction", "ms2hf", "--input", str(step), "--output", str(export), tool="tools/convert_checkpoint.py")
    source, exported = (json.loads((folder / "config.json").read_text()) for folder in (mixtral_folder, export))
    assert {key: exported[key] for key in CARRIED} == {key: source[key] for key in CARRIED}
    for name in ("generation_config.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        assert (export / name).read_bytes() == (mixtral_folder / name).read_bytes(), name

    prompt = "the quick brown fox"
    tokenizer = AutoTokenizer.from_pretrained(export)
    with torch.no_grad():  # the generation config's choices: greedy, 12 new tokens, stop at EOS
        encoded = tokenizer(prompt, return_tensors="pt")
        theirs = AutoModelForCausalLM.from_pretrained(export).eval().generate(**encoded)[0].tolist()
    no_config = run(
        "--load_checkpoint",
        str(step),
        "--prompt",
        prompt,
        "--greedy",
        "--max_new_tokens",
        "12",
        "--set",
        "finetune.template=null",
        "--json",
        tool="tools/generate.py",
    )
    ours = json.loads(no_config.stdout)
    assert ours["prompt_ids"] + ours["ids"] == theirs, (ours, theirs)

    run_config = [
        "--config",
        TINY,
        *sets(
            f"checkpoint.load_path={mixtral_folder}",
            "finetune.hf_dims=true",
            f"data.tokenizer={work['tok']}",
            "finetune.template=null",
        ),
    ]
    ask = ["--load_checkpoint", str(step), "--prompt", prompt, "--greedy", "--max_new_tokens", "12", "--json"]
    assert generate.main([*run_config, *ask]) == 0  # in-process: PyNative, as the module's tests run
    assert json.loads(capsys.readouterr().out)["ids"] == ours["ids"]

    other = ["--config", TINY]  # the tiny LLaMA's dims, not the Mixtral's the step was trained with
    for tool, args in (
        (generate, [*other, *ask]),
        (
            convert_checkpoint,
            ["--direction", "ms2hf", "--input", str(step), "--output", str(tmp_path / "other"), *other],
        ),
    ):
        with pytest.raises(SystemExit) as refused:
            tool.main(args)
        error = capsys.readouterr().err.splitlines()
        assert refused.value.code == 2 and len(error) == 1, error
        assert error[0].startswith(
            f"error: {step} was trained with {step / ckpt.CONFIG} (model.arch='mixtral' "
            "(--config: 'llama'), model.vocab_size=512 (--config: 2048), model.hidden_size=64 "
            f"(--config: 128) ...), not --config {TINY}: leave out --config to use it (the "
            "tensors: missing 12: layers.0.feed_forward.w1.weight"
        ), error
    assert not (tmp_path / "other").exists()
