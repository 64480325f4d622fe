"""Progress of the long CLIs (mindscale/progress.py) as users see it: tools/preprocess_data.py,
tools/reshard.py and tools/convert_checkpoint.py as processes, their stderr a pipe (plain lines, no
carriage returns) or a real pty (a tqdm bar), stdout still the one JSON answer."""

import json
import os
import pty
import re
import subprocess
import sys

import numpy as np
import pytest

from mindscale.config import REPO_ROOT, load_config
from mindscale.progress import EVERY_ENV
from mindscale.train.checkpoints.folder import save_checkpoint
from mindscale.train.checkpoints.commit import record_steps
from tests.integration.test_data import TRAIN_TOKENIZER, make_documents
from tests.run_folder import TINY
from tests.unit.test_progress import read_all, terminal_size

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def text_and_tokenizer(tmp_path_factory):
    """(text file, SentencePiece model) for preprocess_data."""
    work = tmp_path_factory.mktemp("progress")
    text = work / "corpus.txt"
    text.write_text("\n".join(make_documents(count=400)) + "\n")
    TRAIN_TOKENIZER.main(["--input", str(text), "--vocab-size", "512", "--output", str(work / "tok")])
    return text, work / "tok.model"


def tool(name, *args, every="0", stderr=subprocess.PIPE):
    """The tool as a process: (exit code, stdout, stderr or None when it went elsewhere)."""
    proc = subprocess.run(
        [sys.executable, f"tools/{name}.py", *map(str, args)],
        cwd=REPO_ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=stderr,
        timeout=300,
        env={**os.environ, EVERY_ENV: every},
    )
    return proc.returncode, proc.stdout, proc.stderr


def preprocess_args(corpus, output):
    text, tokenizer = corpus
    return [
        "--input",
        text,
        "--tokenizer",
        tokenizer,
        "--seq-length",
        16,
        "--text-unit",
        "line",
        "--output",
        output,
        "--json",
    ]


def test_preprocess_prints_plain_lines_when_stderr_is_not_a_terminal(text_and_tokenizer, tmp_path):
    code, out, err = tool("preprocess_data", *preprocess_args(text_and_tokenizer, tmp_path / "mr"))
    assert code == 0, err
    samples = json.loads(out)["num_samples"]
    assert "\r" not in err and samples > 100
    lines = err.splitlines()  # EVERY=0: a line per sample, then the end of the stage
    assert len(lines) == samples + 1 and re.fullmatch(
        r"preprocess: writing samples: 1 samples \([\d.,]+/s\) elapsed \S+", lines[0]
    ), lines[0]
    assert re.fullmatch(rf"preprocess: writing samples: {samples:,} samples \([\d.,]+/s\) in 0:00:\d\d", lines[-1])


def test_preprocess_draws_a_bar_on_a_terminal(text_and_tokenizer, tmp_path):
    master, slave = pty.openpty()
    terminal_size(slave)
    code, out, _ = tool("preprocess_data", *preprocess_args(text_and_tokenizer, tmp_path / "mr"), stderr=slave)
    os.close(slave)
    shown = read_all(master)
    assert code == 0, shown
    samples = json.loads(out)["num_samples"]
    assert "\r" in shown and re.search(rf"preprocess: writing samples: {samples} samples? \[", shown), shown[-500:]


def test_reshard_and_convert_name_their_stages(tmp_path):
    cfg = load_config(TINY)
    source = save_checkpoint(
        tmp_path / "src",
        2,
        {"w": np.ones((4, 4), np.float32)},
        {"w.m": np.zeros((4, 4), np.float32)},
        {"samples_consumed": 2 * cfg.samples_per_step},
    )
    record_steps(tmp_path / "src", [2])
    code, out, err = tool("reshard", "--input", source, "--config", TINY, "--output", tmp_path / "out", "--json")
    assert code == 0, err
    assert json.loads(out)["step"] == 2
    assert err.splitlines() == [
        f"reshard: reading {source}: done in 0:00:00",
        f"reshard: writing {tmp_path / 'out'}: done in 0:00:00",
    ]

    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "hf"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48)
    ).save_pretrained(hf, safe_serialization=True)
    code, out, err = tool(
        "convert_checkpoint", "--direction", "hf2ms", "--input", hf, "--output", tmp_path / "ms", "--json"
    )
    assert code == 0, err
    tensors = json.loads(out)["tensors"]
    lines = err.splitlines()
    assert re.fullmatch(
        rf"hf2ms: reading {hf}: {tensors}/{tensors} tensors \(100%, [\d.,]+/s\) in 0:00:\d\d", lines[-3]
    ), lines
    assert lines[-2:] == [
        "hf2ms: converting: done in 0:00:0" + lines[-2][-1],
        f"hf2ms: writing {tmp_path / 'ms'}: done in 0:00:0" + lines[-1][-1],
    ]
