"""Validation loss during training (train.eval_interval, data.valid_path): real runs on a real held-out split.

The corpus is split by tools/preprocess_data.py --valid-fraction; the runs are run_train.py and
scripts/run_distribute.sh processes. The validation loss is checked against an offline forward pass
of the final checkpoint over the held-out sequences (numpy cross entropy in float64, in this process).
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mindscale.config import REPO_ROOT, load_config
from mindscale.train.checkpoints import folder as ckpt
from mindscale.train.data.dataset import read_manifest
from tests.integration import tiny_runs

VALIDATION = ["model.vocab_size=512", "train.lr_schedule=constant"]  # beside tiny_runs.SMALL
EVAL = ["train.steps=4", "train.eval_interval=2", "train.eval_steps=2"]  # G=4: the first 8 held-out sequences


@pytest.fixture(scope="module")
def corpus():
    """600 one-line documents, 20% held out."""
    return tiny_runs.corpus(600, held_out=0.2)


def data_args(corpus):
    return [
        f"data.path={corpus / 'mr'}",
        f"data.valid_path={corpus / 'mr' / 'valid'}",
        f"data.tokenizer={corpus / 'tok.model'}",
    ]


def train(tmp_path, name, *overrides, check=True):
    return tiny_runs.train(tmp_path, name, *VALIDATION, *overrides, check=check)


def val_losses(run_dir):
    return {r["step"]: r["val_loss"] for r in tiny_runs.metrics(run_dir) if "val_loss" in r}


def offline_val_loss(run_dir, sequences, folder=None):
    """Token-mean cross entropy of the run's final weights over the first `sequences` held-out samples (of
    `folder`, else data.valid_path), in stored order: a forward pass of the model in this process, the loss in
    numpy float64."""
    import mindspore as ms
    from mindspore import Tensor
    from mindspore.mindrecord import FileReader

    import models

    cfg = load_config(Path(run_dir) / "config.yaml")
    folder = Path(folder or cfg.data.valid_path)
    rows = []
    for shard in read_manifest(folder)["shards"]:
        reader = FileReader(str(folder / shard["file"]))
        rows += [np.asarray(row["input_ids"]) for row in reader.get_next()]
        reader.close()
    tokens = np.stack(rows[:sequences]).astype(np.int32)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = models.build_model(cfg)
    models.load_weights_into(model, ckpt.load_weights(ckpt.latest_checkpoint(Path(run_dir) / "checkpoints")))
    logits = model(Tensor(tokens[:, :-1])).asnumpy().astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, tokens[:, 1:, None].astype(np.int64), -1)[..., 0]
    return float((log_z - picked).mean())


def test_validation_loss_is_an_offline_forward_pass_and_the_same_on_two_workers(tmp_path, corpus):
    """One worker (its batch in two accumulated micro batches) and two data-parallel workers validate on the
    same 8 held-out sequences: each run's val_loss equals the offline pass over its final weights (rtol 1e-5),
    and the two runs agree as closely as their training losses do (all-reduce order)."""
    one = train(
        tmp_path, "one", *data_args(corpus), *EVAL, "train.micro_batch_size=2", "parallel.gradient_accumulation_steps=2"
    )
    assert re.search(r"ETA \S+ val_loss \d+\.\d{4} val_ppl \d+\.\d{2}$", one.stdout.splitlines()[-3])
    launch = subprocess.run(
        [
            "bash",
            "scripts/run_distribute.sh",
            tiny_runs.TINY,
            "2",
            *tiny_runs.sets(
                *VALIDATION,
                f"run.output_dir={tmp_path}",
                "run.name=two",
                "train.micro_batch_size=2",
                *data_args(corpus),
                *EVAL,
            ),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]

    single, double = val_losses(tmp_path / "one"), val_losses(tmp_path / "two")
    assert sorted(single) == sorted(double) == [2, 4]
    last = tiny_runs.metrics(tmp_path / "one")[-1]
    assert last["val_ppl"] == pytest.approx(np.exp(last["val_loss"])) and last["val_time_s"] > 0
    for run, values in (("one", single), ("two", double)):
        np.testing.assert_allclose(values[4], offline_val_loss(tmp_path / run, 8), rtol=1e-5)
    np.testing.assert_allclose([double[s] for s in (2, 4)], [single[s] for s in (2, 4)], rtol=2e-4)


def test_validation_changes_no_training_number_nor_the_resumed_data_position(tmp_path, corpus):
    """On one core the training losses and final weights are bit-identical with validation on and off; a run
    resumed at step 2 continues both the training and the validation losses of an unbroken run exactly."""
    on = train(tmp_path, "eval_on", *data_args(corpus), *EVAL)
    off = train(tmp_path, "eval_off", *data_args(corpus), "train.steps=4")
    digest = re.compile(r"weights sha256 (\w+)")
    assert digest.search(on.stdout).group(1) == digest.search(off.stdout).group(1)
    losses = {name: tiny_runs.losses(tmp_path / name) for name in ("eval_on", "eval_off")}
    assert losses["eval_on"] == losses["eval_off"] and sorted(losses["eval_on"]) == [1, 2, 3, 4]

    train(tmp_path, "resumed", *data_args(corpus), *EVAL[1:], "train.steps=2")
    again = train(tmp_path, "resumed", *data_args(corpus), *EVAL)
    assert "resumed from" in again.stdout
    resumed = tiny_runs.losses(tmp_path / "resumed")
    assert resumed == losses["eval_on"] and val_losses(tmp_path / "resumed") == val_losses(tmp_path / "eval_on")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.eval_steps=20"],
            "holds 52 sequences but train.eval_steps=20 x global batch 4 needs 80; set train.eval_steps <= 13",
        ),
        (
            ["train.micro_batch_size=64", "train.eval_steps=1"],
            "holds 52 sequences but train.eval_steps=1 x global batch 64 needs 64; hold out at least 64 sequences, one "
            "global batch (raise tools/preprocess_data.py --valid-fraction)",
        ),
        (["train.eval_interval=2", "data.valid_path=null"], "train.eval_interval=2 needs data.valid_path"),
    ],
)
def test_a_held_out_split_that_cannot_serve_is_one_line_and_exit_2(tmp_path, corpus, overrides, message):
    proc = train(tmp_path, "bad", *data_args(corpus), *EVAL, *overrides, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_blend_trains_validates_and_logs_the_tokens_and_losses_of_each_source(tmp_path, corpus):
    """data.blend of two folders (the corpus and a second one preprocessed with the same tokenizer) and
    data.valid_blend of their held-out splits, weights 3:1: the run log's header names each share, metrics.jsonl
    counts the tokens each source gave (3:1 of G=4 samples of 32 tokens per step) and each held-out source's
    loss, each equal to an offline pass over its sequences (train.eval_steps=2 x 3/4 and 1/4 in whole steps: 2
    and 1 steps, 8 and 4 sequences); TensorBoard plots both per source, tools/report.py prints the mix and
    its HTML names the held-out sources. Index reuse, rebuilds and the order: tests/unit/test_blend.py."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    other = tmp_path / "other"
    text = tmp_path / "other.txt"
    text.write_text("\n".join(f"seven lazy wizards jump over {n} brown foxes." for n in range(300)))
    subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(text),
            "--text-unit",
            "line",
            "--tokenizer",
            str(corpus / "tok.model"),
            "--seq-length",
            "32",
            "--valid-fraction",
            "0.2",
            "--output",
            str(other),
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    blend = f"data.blend=[{{path: {corpus / 'mr'}, weight: 3}}, {{path: {other}, weight: 1}}]"
    held_out = [str(corpus / "mr" / "valid"), str(other / "valid")]
    valid = f"data.valid_blend=[{{path: {held_out[0]}, weight: 3}}, {{path: {held_out[1]}, weight: 1}}]"
    args = [
        blend,
        valid,
        "data.valid_path=null",
        f"data.tokenizer={corpus / 'tok.model'}",
        "run.tensorboard=true",
        *EVAL,
    ]
    run = train(tmp_path, "blend", *args)
    assert f"data: blend of {corpus / 'mr'} 75.0% (12 samples of" in run.stdout
    assert f"{other} 25.0% (4 samples of" in run.stdout
    assert "data index (train): no index yet; building" in run.stdout
    logged = tiny_runs.metrics(tmp_path / "blend")
    assert [r["data_tokens"] for r in logged if r["step"] == 4] == [{str(corpus / "mr"): 12 * 32, str(other): 4 * 32}]
    assert sorted(val_losses(tmp_path / "blend")) == [2, 4]
    last = logged[-1]
    by_source = [offline_val_loss(tmp_path / "blend", n, folder) for n, folder in zip((8, 4), held_out)]
    np.testing.assert_allclose([last["val_loss_by_source"][path] for path in held_out], by_source, rtol=1e-5)
    np.testing.assert_allclose(last["val_loss"], (8 * by_source[0] + 4 * by_source[1]) / 12, rtol=1e-5)

    events = accumulator.EventAccumulator(
        str(tmp_path / "blend" / "tensorboard"), size_guidance={accumulator.SCALARS: 0}
    )
    events.Reload()
    assert {
        f"data_tokens/{corpus / 'mr'}",
        f"data_tokens/{other}",
        *(f"val_loss_by_source/{path}" for path in held_out),
    } <= set(events.Tags()["scalars"])
    assert events.Scalars(f"data_tokens/{other}")[-1].value == 4 * 32

    report = subprocess.run(
        [sys.executable, "tools/report.py", str(tmp_path / "blend")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert f"data mix at step 4: {corpus / 'mr'} 75.0% (384 tokens), {other} 25.0% (128 tokens)" in report.stdout
    page = (tmp_path / "blend" / "report.html").read_text()
    section = page[page.index("<h2>Validation</h2>") :]
    assert "None" not in section[: section.index("</table>")]
    assert f"each source's own: {held_out[0]} (weight 3), {held_out[1]} (weight 1)" in section
    assert f"<th>val_loss</th><th>{held_out[0]}</th><th>{held_out[1]}</th>" in section


def test_a_damaged_shard_stops_the_run_in_one_line_before_the_compile(tmp_path, corpus):
    """Random bytes over a data page of a shard (its size unchanged): MindSpore's reader crashed the process
    (SIGSEGV, no message, after the compile); the shard's checksum now refuses it before anything compiles."""
    damaged = tmp_path / "damaged"
    shutil.copytree(corpus / "mr", damaged)
    shard = damaged / read_manifest(damaged)["shards"][0]["file"]
    header_size = json.loads(shard.read_bytes()[8:].split(b"\0", 1)[0])["header_size"]
    with open(shard, "r+b") as handle:
        handle.seek(header_size)
        handle.write(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    proc = train(
        tmp_path,
        "damaged",
        f"data.path={damaged}",
        f"data.tokenizer={corpus / 'tok.model'}",
        "train.steps=4",
        check=False,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [
        f"error: shard {shard} does not match its xxh3_128 checksum in {damaged}/manifest.json: its bytes changed "
        "after preprocessing; copy the folder again from where it was made, or re-run tools/preprocess_data.py"
    ], proc.stderr[-2000:]
    assert not any((tmp_path / "damaged" / name).exists() for name in ("compile_cache", "checkpoints"))
