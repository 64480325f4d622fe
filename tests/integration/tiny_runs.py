"""The tiny training runs the integration tests share: the config and its small overrides, run_train.py as
one device, the run folder's metrics, a real corpus and one worker's uninterrupted run (each built once a
session), and the process and log probes of the multi-worker tests."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mindscale.config import REPO_ROOT
from tests import shared
from tests.cores import one_core

TINY = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")
DEEPSEEK_V3_TINY = str(REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml")
# its two-worker run (tests/integration/test_moe_training.py): a dense layer and an expert layer, 2 micro batches
# of 2 rows a worker, auxiliary-loss-free balancing at 0.01, a checkpoint every step (the last 4 kept)
TWO_WORKER_DEEPSEEK = [
    "run.name=moe",
    "model.num_layers=2",
    "model.num_kv_heads=null",
    "model.vocab_size=512",
    "model.moe.bias_update_rate=0.01",
    "model.moe.seq_aux_loss_coeff=0.001",
    "train.micro_batch_size=2",
    "parallel.gradient_accumulation_steps=2",
    "train.steps=20",
    "train.lr=0.01",
    "train.min_lr=0.001",
    "checkpoint.save_interval=1",
    "checkpoint.keep_last=4",
]
SMALL = [
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
    "model.seq_length=32",
    "train.log_interval=1",
    "train.warmup_steps=2",
    "checkpoint.save_interval=0",
]


def sets(*overrides):
    return [arg for o in (*SMALL, *overrides) for arg in ("--set", o)]


def train(tmp_path, name, *overrides, env=None, check=True, config=TINY):
    """run_train.py on `config` with SMALL and `overrides`, as one device: pinned to one core, as
    scripts/run_standalone.sh does."""
    args = [
        sys.executable,
        "run_train.py",
        "--config",
        str(config),
        *sets(f"run.output_dir={tmp_path}", f"run.name={name}", "parallel.data_parallel=1", *overrides),
    ]
    proc = subprocess.run(
        args,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        preexec_fn=one_core,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def corpus(documents: int = 300, held_out: float = 0.0) -> Path:
    """A small real corpus of one-line documents, built once a session for each (documents, held_out)
    (tests/shared.py): text -> SentencePiece (400 pieces) -> MindRecord of 33-token samples in `mr/` (with
    `held_out` of the documents in `mr/valid/`), the tokenizer in `tok.model`."""

    def build():
        root = Path(tempfile.mkdtemp(dir=shared.ROOT, prefix="corpus-"))
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jokes".split()
        rng = np.random.default_rng(0)
        text = "\n".join(" ".join(rng.choice(words, 12)) + "." for _ in range(documents))
        (root / "text.txt").write_text(text)
        tokenizer = ["tools/train_tokenizer.py", "--input", str(root / "text.txt"), "--vocab-size", "400"]
        preprocess = ["tools/preprocess_data.py", "--input", str(root / "text.txt"), "--seq-length", "32"]
        if held_out:
            preprocess += ["--text-unit", "line", "--valid-fraction", str(held_out)]
        for tool in (
            [*tokenizer, "--output", str(root / "tok")],
            [*preprocess, "--tokenizer", str(root / "tok.model"), "--output", str(root / "mr")],
        ):
            subprocess.run([sys.executable, *tool], cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
        return str(root)

    return Path(shared.once(["corpus", documents, held_out], build))


def one_worker_run() -> dict:
    """{"stdout", "run"}: run_train.py on one worker, micro batch 4, 6 steps, the uninterrupted run the
    data-parallel tests compare with; trained once a session (tests/shared.py), they only read it."""

    def run():
        parent = Path(tempfile.mkdtemp(dir=shared.ROOT, prefix="one_worker-"))
        return {
            "stdout": train(parent, "dp1", "train.micro_batch_size=4", "train.steps=6").stdout,
            "run": str(parent / "dp1"),
        }

    return shared.once(["one_worker_run"], run)


def processes_naming(marker):
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            pass
    return found


def files_of(run_dir):
    return sorted(str(p.relative_to(run_dir)) for p in Path(run_dir).rglob("*"))


def wait_for_records(records, job, count, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        if records.is_file() and len(records.read_text().splitlines()) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} steps were logged in {records}")


def digests(log_dir):
    return {re.search(r"weights sha256 (\w+)", (log_dir / f"worker_{r}.log").read_text()).group(1) for r in (0, 1)}


def router_biases(folder) -> np.ndarray:
    """The router bias of the expert layer (layer 1) a checkpoint holds."""
    from mindscale.train.checkpoints import folder as ckpt

    return ckpt.load_weights(folder)["layers.1.feed_forward.routing.router_bias"]


COUNT_SCRIPT = """
import json, sys
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn
import models
from mindscale.config import load_config
from mindscale.train.checkpoints import folder as ckpt
from mindscale.train.data.dataset import build_dataset
from models.moe import MoE

run, steps, overrides = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
ms.set_context(device_target="CPU", mode=ms.GRAPH_MODE)
cfg = load_config(run + "/config.yaml", overrides)
model = models.build_model(cfg)
counter = Parameter(Tensor(np.zeros(cfg.model.moe.num_experts, np.float32)), name="counter", requires_grad=False)
moes = [c for _, c in model.cells_and_names() if isinstance(c, MoE)]
assert len(moes) == 1
moes[0].attach_load_counter(counter)

class Counts(nn.Cell):
    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model
        self.counter = counter

    def construct(self, ids):
        return self.model.decode(ids)[1]

counts = Counts(model)
out = []
for step in steps[:-1]:
    models.load_weights_into(model, ckpt.load_weights(f"{run}/checkpoints/step_{step:08d}"))
    batch = next(iter(build_dataset(cfg, 0, 1, step)))["tokens"]  # optimizer step step + 1's global batch
    counter.set_data(Tensor(np.zeros(counter.shape, np.float32)))
    counts(Tensor(batch[:, :-1]))
    out.append(counter.asnumpy().tolist())
print(json.dumps(out))
"""


def global_batch_counts(run: Path, steps: list[int]) -> list[np.ndarray]:
    """Per step after the first of `steps`, the tokens per expert of its whole global batch, counted in one
    forward (one worker, one micro batch of every row: the data stream gives a step the same rows whatever the
    workers and micro batches) of the checkpoint of the step before."""
    script = Path(run) / "count_experts.py"  # a file: graph mode reads the Cell's source
    script.write_text(COUNT_SCRIPT)
    overrides = ["parallel.data_parallel=1", "parallel.gradient_accumulation_steps=1", "train.micro_batch_size=8"]
    proc = subprocess.run(
        [sys.executable, str(script), str(run), json.dumps(steps), json.dumps(overrides)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=one_core,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [np.array(c, np.float32) for c in json.loads(proc.stdout.strip().splitlines()[-1])]
