"""Hugging Face tokenizer folders (tokenizer.json + tokenizer_config.json): ids equal the tokenizers
library's, `--template hf` equals transformers' apply_chat_template with an exact answer mask,
preprocessing writes MindRecord the trainer reads and trains on, generation decodes with the folder,
and bad folders are refused in one line (exit 2, nothing written).

The tokenizer is a byte-level BPE trained here (a few hundred ids, so everything takes seconds).
"""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from mindscale.config import REPO_ROOT, config_from_tree
from mindscale.io import DataError
from mindscale.train.data.dataset import build_dataset, read_manifest
from mindscale.train.data.chat_template import get_template
from mindscale.train.data.templates import RecordError, encode_examples, encode_prompt
from mindscale.train.data.tokenizers import load_tokenizer

SPECIALS = ["<|pad|>", "<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = (
    "naïve café — 日本語の文章 ✓ 🙂\n\tdef area(r):\n        return 3.14159 * r ** 2  # π r²\n\n\n"
    "x  =  [1,2,   3]\t\t\r\n    trailing   spaces   "
)
CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2 + 2?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and 3 * 3?"},
        {"role": "assistant", "content": "nine, in code: print(3 * 3)"},
    ]
}
ALPACA = {"instruction": "name a colour", "input": "", "output": "blue"}
SEQ = 127
SMALL_LLAMA = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    f"model.seq_length={SEQ}",
    "train.micro_batch_size=2",
    "parallel.data_parallel=1",
    "train.warmup_steps=0",
    "train.log_interval=1",
    "checkpoint.save_interval=0",
    "checkpoint.save_at_end=false",
    "checkpoint.load_path=null",
    "finetune.template=null",
]
TINY = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")


def run_tool(tool, *args):
    """A tool as a subprocess (the way users run it): (exit code, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / tool), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    return proc.returncode, proc.stdout, proc.stderr


def write_folder(folder, tokenizer, chat_template=CHATML, special_map=True):
    """tokenizer.json, a tokenizer_config.json (BOS, EOS <|end|>, pad, chat_template) and a
    special_tokens_map.json that overrides EOS with <|im_end|>, as transformers' precedence has it."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin|>",
        "eos_token": {"content": "<|end|>", "special": True},
        "pad_token": "<|pad|>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map:
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    return folder


@pytest.fixture(scope="module")
def trained():
    """A byte-level BPE (vocab 400) whose post-processor adds BOS, as LLaMA-3's tokenizer.json does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [TEXT, "what is two plus two? four. name a colour: blue. be brief.", "def f(x):\n    return x * x"]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", tokenizer.token_to_id("<|begin|>"))]
    )
    return tokenizer


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_tokenizer")


@pytest.fixture(scope="module")
def folder(work, trained):
    return write_folder(work / "tok", trained)


@pytest.fixture(scope="module")
def ours(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return AutoTokenizer.from_pretrained(str(folder))


def test_ids_and_special_tokens_equal_the_libraries(trained, ours, hf):
    library = trained.encode(TEXT, add_special_tokens=False).ids
    assert ours.encode([TEXT])[0] == library == hf.encode(TEXT, add_special_tokens=False)
    assert ours.encode([TEXT, "x"], num_threads=2) == [library, trained.encode("x", add_special_tokens=False).ids]
    assert trained.encode(TEXT).ids == [ours.bos_id] + library  # BOS is MindScale's to place, not the library's
    assert ours.decode(library) == TEXT
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert ours.eos_id == trained.token_to_id("<|im_end|>") and ours.vocab_size == len(hf)


def test_hf_template_ids_equal_apply_chat_template_and_the_mask_is_the_answers(ours, hf):
    template = get_template("hf", ours)
    records = [CHAT, ALPACA]
    for record, (ids, mask) in zip(records, encode_examples(records, template, ours)):
        messages = record.get("messages") or [
            {"role": "user", "content": record["instruction"]},
            {"role": "assistant", "content": record["output"]},
        ]
        assert ids == hf.apply_chat_template(messages, tokenize=True)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [t for t, m in zip(ids, mask) if m] == [
            t for a in answers for t in hf.encode(f"{a}<|im_end|>\n", add_special_tokens=False)
        ]
        prompt = messages[: next(k for k, m in enumerate(messages) if m["role"] == "assistant")]
        expected = hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        assert encode_prompt(prompt, template, ours) == expected == ids[: mask.index(1)]


def test_a_token_across_the_answer_start_is_split_so_the_mask_stays_exact(work, trained):
    """This template's generation prompt ends with a space: the whole string tokenizes " four" as one token."""
    spaced = (
        "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}"
        "Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    )
    folder = write_folder(work / "spaced", trained, spaced)
    tokenizer, hf = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "what is 2 + 2?"}, {"role": "assistant", "content": "four"}]
    ids, mask = encode_examples([{"messages": messages}], get_template("hf", tokenizer), tokenizer)[0]
    assert ids != hf.apply_chat_template(messages, tokenize=True)  # the whole string merges across the boundary
    assert [t for t, m in zip(ids, mask) if m] == tokenizer.encode(["four<|im_end|>\n"])[0]
    assert ids[: mask.index(1)] == hf.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)


@pytest.mark.parametrize(
    "chat_template, message",
    [
        (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}..."
            "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "cannot be split at assistant turn 2",
        ),
        (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
            "does not render assistant turn 2 as its content after the generation prompt",
        ),
        ("{{ raise_exception('only two roles') }}", "refused the conversation: only two roles"),
    ],
    ids=["rewrites_earlier_answers", "no_generation_prompt", "raises"],
)
def test_templates_that_cannot_be_masked_exactly_are_refused(tmp_path, trained, chat_template, message):
    """One that rewrites earlier answers, one without a generation prompt (it would train the header),
    one that raises."""
    folder = write_folder(tmp_path / "tok", trained, chat_template)
    tokenizer = load_tokenizer(folder)
    with pytest.raises(RecordError) as info:
        encode_examples([CHAT], get_template("hf", tokenizer), tokenizer)
    assert message in str(info.value) and "\n" not in str(info.value)


def make_cfg(path, tokenizer, **data):
    return config_from_tree(
        {
            "model": {
                "vocab_size": 400,
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "ffn_hidden_size": 64,
                "seq_length": SEQ,
            },
            "train": {"micro_batch_size": 2},
            "data": {"path": str(path), "shuffle": False, "tokenizer": str(tokenizer), **data},
        }
    )


def stored(folder):
    from mindspore.mindrecord import FileReader

    rows = []
    for shard in read_manifest(folder)["shards"]:
        reader = FileReader(str(folder / shard["file"]))
        rows += [{k: np.asarray(v) for k, v in row.items()} for row in reader.get_next()]
        reader.close()
    return rows


def test_pretraining_data_holds_the_library_ids_and_the_trainer_checks_the_folder(work, folder, trained, ours):
    documents = [TEXT, "name a colour: blue " * 8, "def f(x):\n    return x * x\n" * 4]
    (work / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    out = work / "pre"
    code, _, err = run_tool(
        "tools/preprocess_data.py",
        "--input",
        work / "docs.jsonl",
        "--tokenizer",
        folder,
        "--seq-length",
        SEQ,
        "--output",
        out,
        "--workers",
        2,
    )  # the folder loads in the workers
    assert code == 0, err
    stream = [t for d in documents for t in trained.encode(d, add_special_tokens=False).ids + [ours.eos_id]]
    rows = stored(out)
    assert (
        np.concatenate([rows[0]["input_ids"]] + [r["input_ids"][1:] for r in rows[1:]]).tolist()
        == stream[: len(rows) * SEQ + 1]
    )
    manifest = read_manifest(out)
    assert manifest["tokenizer"]["sha256"] == ours.sha256 and manifest["eos_id"] == ours.eos_id
    batch = next(iter(build_dataset(make_cfg(out, folder, eos_id=ours.eos_id))))
    np.testing.assert_array_equal(batch["tokens"][0], rows[0]["input_ids"])
    changed = shutil.copytree(folder, work / "changed_template")
    config = json.loads((changed / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
    with pytest.raises(DataError, match="is not the tokenizer"):
        build_dataset(make_cfg(out, changed, eos_id=ours.eos_id))


def test_sft_data_from_the_chat_template_trains(work, folder, ours):
    (work / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [CHAT, ALPACA] * 4))
    out = work / "sft"
    code, _, err = run_tool(
        "tools/preprocess_data.py",
        "--mode",
        "sft",
        "--template",
        "hf",
        "--input",
        work / "sft.jsonl",
        "--tokenizer",
        folder,
        "--seq-length",
        SEQ,
        "--output",
        out,
    )
    assert code == 0, err
    encoded = encode_examples([CHAT, ALPACA], get_template("hf", ours), ours)
    for row, (ids, mask) in zip(stored(out), encoded * 4):
        assert row["input_ids"][: len(ids)].tolist() == ids and row["loss_mask"][: len(ids)].tolist() == mask
    ids_flags = [f"data.eos_id={ours.eos_id}", f"data.pad_id={ours.pad_id}", "model.vocab_size=400"]
    sets = [
        arg
        for o in (
            *SMALL_LLAMA,
            *ids_flags,
            f"run.output_dir={work}",
            "run.name=sft",
            "train.steps=2",
            f"data.path={out}",
            f"data.tokenizer={folder}",
        )
        for arg in ("--set", o)
    ]
    code, _, err = run_tool("run_train.py", "--config", TINY, *sets)
    assert code == 0, err[-2000:]
    losses = [json.loads(line)["loss"] for line in (work / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_generation_encodes_and_decodes_with_the_checkpoint_folders_tokenizer(work, trained, ours):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        bos_token_id=ours.bos_id,
        eos_token_id=ours.eos_id,
    )
    model_folder = work / "hf_model"
    LlamaForCausalLM(config).save_pretrained(model_folder, safe_serialization=True)
    write_folder(model_folder, trained)  # a Hugging Face model folder ships its tokenizer beside the weights
    # tools/generate.py in its own process: it sets the MindSpore device, which a process that ran
    # kernels in earlier tests cannot change
    code, out, err = run_tool(
        "tools/generate.py",
        "--config",
        TINY,
        "--load_checkpoint",
        model_folder,
        "--prompt",
        "def area(r):",
        "--max_new_tokens",
        8,
        "--greedy",
        "--json",
    )
    assert code == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["prompt_ids"] == [ours.bos_id] + trained.encode("def area(r):", add_special_tokens=False).ids
    assert result["text"] == trained.decode(result["ids"], skip_special_tokens=True) and result["ids"]


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_tokenizer_json", "is a folder without tokenizer.json"),
        ("corrupt", "tokenizer.json cannot be read by the tokenizers library"),
        ("no_chat_template", "has no chat_template"),
    ],
)
def test_bad_tokenizer_folders_exit_2_with_one_line_and_write_nothing(work, trained, case, message):
    bad = work / case
    if case == "no_tokenizer_json":
        bad.mkdir()
        (bad / "tokenizer_config.json").write_text("{}")
    elif case == "corrupt":
        write_folder(bad, trained)
        (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    else:
        write_folder(bad, trained, chat_template=None)
    (work / "one.jsonl").write_text(json.dumps(ALPACA) + "\n")
    out = work / f"out_{case}"
    code, _, err = run_tool(
        "tools/preprocess_data.py",
        "--mode",
        "sft",
        "--template",
        "hf",
        "--input",
        work / "one.jsonl",
        "--tokenizer",
        bad,
        "--seq-length",
        SEQ,
        "--output",
        out,
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not out.exists() and not list(work.glob(f".out_{case}.partial-*"))
