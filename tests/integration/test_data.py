"""Data pipeline: tokenizer training, preprocessing of every input format, packing arithmetic, the loader's
order (determinism, rank sharding invariance, accumulation, resume, epochs), SFT masks and packing, and every
bad-input case of the CLIs (exit 2, one line)."""

import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from mindscale.config import config_from_tree
from mindscale.io import DataError
from mindscale.train.data.dataset import build_dataset, read_manifest
from mindscale.train.data.templates import TEMPLATES, encode_examples, encode_prompt
from mindscale.train.data.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SEQ = 16
VOCAB = 512
TEMPLATE_TEXT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request. ### Instruction: ### Input: ### Response: [INST] [/INST] <<SYS>> <</SYS>> "
    "<|start_header_id|>user<|end_header_id|> assistant system"
)


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"mindscale_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PREPROCESS = load_tool("preprocess_data")
TRAIN_TOKENIZER = load_tool("train_tokenizer")


def run_cli(tool, *args, env=None):
    """A tool as a subprocess (the way users run it): (exit code, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout, proc.stderr


def assert_bad_input(tool, *args, match):
    # some errors are found only after a stage ran (a held-out split too small to fill a sample): on a loaded
    # host that stage can outlast the progress interval and rightly print its line first (mindscale/progress.py)
    code, _, err = run_cli(tool, *args, env={"MINDSCALE_PROGRESS_EVERY_S": "3600"})
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err


def make_documents(seed=0, count=60):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def docs():
    return make_documents()


@pytest.fixture(scope="module")
def tokenizer(work, docs):
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(docs + make_documents(seed=1, count=400) + [TEMPLATE_TEXT] * 50) + "\n")
    TRAIN_TOKENIZER.main(["--input", str(corpus), "--vocab-size", str(VOCAB), "--output", str(work / "tok")])
    return work / "tok.model"


@pytest.fixture(scope="module")
def sp(tokenizer):
    return sentencepiece.SentencePieceProcessor(model_file=str(tokenizer))


@pytest.fixture(scope="module")
def encoder(tokenizer):
    """The tokenizer as MindScale's templates take it."""
    return load_tokenizer(tokenizer)


def preprocess(*args):
    PREPROCESS.main([str(a) for a in args])


def stored(folder):
    """Every stored sample (dict of fields) in stream order, read back with MindSpore's MindRecord reader."""
    from mindspore.mindrecord import FileReader

    manifest = read_manifest(folder)
    rows = []
    for shard in manifest["shards"]:
        reader = FileReader(str(Path(folder) / shard["file"]))
        rows += [{k: np.asarray(v) for k, v in row.items()} for row in reader.get_next()]
        reader.close()
    return rows


def make_cfg(
    path,
    vocab=VOCAB,
    seq=SEQ,
    dp=1,
    micro=2,
    accumulation=1,
    seed=7,
    shuffle=True,
    tokenizer=None,
    steps=100,
    run_dir="output",
    **data,
):
    return config_from_tree(
        {
            "run": {"seed": seed, "output_dir": str(run_dir)},
            "model": {
                "vocab_size": vocab,
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "ffn_hidden_size": 64,
                "seq_length": seq,
            },
            "parallel": {"data_parallel": dp, "gradient_accumulation_steps": accumulation},
            "train": {"micro_batch_size": micro, "steps": steps},  # the data stream covers train.steps
            "data": {"path": str(path), "shuffle": shuffle, "tokenizer": str(tokenizer) if tokenizer else None, **data},
        }
    )


def steps(cfg, rank=0, world=1, start_step=0, count=5):
    """`count` optimizer steps of one rank: per step the accumulation micro batches stacked along rows."""
    source = iter(build_dataset(cfg, rank, world, start_step))
    g = cfg.parallel.gradient_accumulation_steps
    out = []
    for _ in range(count):
        micro = [next(source) for _ in range(g)]
        out.append({k: np.concatenate([m[k] for m in micro]) for k in micro[0]})
    return out


# ----------------------------------------------------------------------------------------------
# tokenizer and pretraining preprocessing


def test_tokenizer_ids_agree_with_config_defaults_and_any_text_encodes(sp):
    assert (sp.pad_id(), sp.unk_id(), sp.eos_id(), sp.bos_id()) == (0, 1, 2, 3)
    assert sp.vocab_size() == VOCAB
    cfg = make_cfg("synthetic")
    assert (cfg.data.pad_id, cfg.data.eos_id) == (sp.pad_id(), sp.eos_id())
    text = "unseen ✓ 日本語 text\twith  tabs"
    ids = sp.encode(text)
    assert sp.unk_id() not in ids and sp.decode(ids) == text  # byte fallback, whitespace kept


@pytest.fixture(scope="module")
def pretrain_folder(work, docs, tokenizer):
    (work / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    preprocess(
        "--input",
        work / "docs.jsonl",
        "--tokenizer",
        tokenizer,
        "--seq-length",
        SEQ,
        "--output",
        work / "pre_jsonl",
        "--shard-size",
        10,
    )
    return work / "pre_jsonl"


def test_packing_joins_documents_with_eos_and_loses_only_the_tail(pretrain_folder, docs, sp):
    stream = np.array([t for d in docs for t in sp.encode(d) + [sp.eos_id()]], np.int32)
    manifest = read_manifest(pretrain_folder)
    n = manifest["num_samples"]
    assert manifest["num_tokens"] == len(stream) and manifest["documents"] == len(docs)
    assert n == (len(stream) - 1) // SEQ and manifest["tail_tokens_dropped"] == len(stream) - n * SEQ - 1 < SEQ
    samples = np.stack([row["input_ids"] for row in stored(pretrain_folder)])
    assert samples.shape == (n, SEQ + 1)
    for k in range(n):  # consecutive samples share one token: every token but the first is a target once
        np.testing.assert_array_equal(samples[k], stream[k * SEQ : k * SEQ + SEQ + 1])


def test_valid_fraction_holds_out_whole_documents_evenly_and_deterministically(
    work, docs, tokenizer, sp, pretrain_folder
):
    """--valid-fraction 0.25: documents 3, 7, 11, ... (exactly a quarter) are packed into <output>/valid, the
    others into the training folder, each stream exactly as packing alone would cut it; a rerun is identical."""
    outputs = []
    for name in ("split", "split_again"):
        preprocess(
            "--input",
            work / "docs.jsonl",
            "--tokenizer",
            tokenizer,
            "--seq-length",
            SEQ,
            "--valid-fraction",
            0.25,
            "--output",
            work / name,
            "--shard-size",
            10,
        )
        outputs.append(work / name)
    held = [i for i in range(len(docs)) if i % 4 == 3]
    for folder, chosen in (
        (outputs[0], [d for i, d in enumerate(docs) if i not in held]),
        (outputs[0] / "valid", [docs[i] for i in held]),
    ):
        stream = np.array([t for d in chosen for t in sp.encode(d) + [sp.eos_id()]], np.int32)
        manifest = read_manifest(folder)
        assert manifest["documents"] == len(chosen) and manifest["num_tokens"] == len(stream)
        samples = np.stack([row["input_ids"] for row in stored(folder)])
        assert len(samples) == manifest["num_samples"] == (len(stream) - 1) // SEQ
        for k, sample in enumerate(samples):
            np.testing.assert_array_equal(sample, stream[k * SEQ : k * SEQ + SEQ + 1])
    assert read_manifest(outputs[0])["valid"] == {
        "path": "valid",
        "fraction": 0.25,
        "documents": len(held),
        "num_samples": read_manifest(outputs[0] / "valid")["num_samples"],
    }
    for sub in ("", "valid"):
        first, again = stored(outputs[0] / sub), stored(outputs[1] / sub)
        assert len(first) == len(again) and all(
            np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again)
        )
    cfg = make_cfg(outputs[0] / "valid", tokenizer=tokenizer, shuffle=False)
    assert steps(cfg, count=1)[0]["tokens"].shape == (2, SEQ + 1)  # a data folder the loader reads


def test_worker_count_and_chunk_size_do_not_change_the_output(work, tokenizer, pretrain_folder):
    """2 tokenizer processes on chunks of ~200 characters (a few documents each, many chunks in flight) write
    byte-identical shards, the same held-out split and the same manifests as 1 process on one chunk."""
    from mindscale.train.data.preprocess import Options, load_tokenizer, preprocess as write_folder
    from mindscale.train.data.raw_text import resolve_sources

    sources, encoder = resolve_sources([str(work / "docs.jsonl")]), load_tokenizer(str(tokenizer), None)
    folders = []
    for workers, chunk in ((1, 1 << 21), (2, 200)):
        folders.append(work / f"workers_{workers}")
        write_folder(
            folders[-1],
            Options(workers=workers, chunk_chars=chunk, valid_fraction=0.25, shard_size=10),
            sources,
            encoder,
            SEQ,
        )
    for sub in ("", "valid"):
        one, two = (read_manifest(f / sub) for f in folders)
        assert one == two and len(one["shards"]) > 1
        for shard in one["shards"]:
            assert (folders[0] / sub / shard["file"]).read_bytes() == (folders[1] / sub / shard["file"]).read_bytes()
    assert [r["input_ids"].tobytes() for r in stored(folders[1])] != []


RSS_CHILD = """
import json, resource, sys
from pathlib import Path
from mindscale.train.data.preprocess import Options, load_tokenizer, preprocess
from mindscale.train.data.raw_text import resolve_sources
if __name__ == "__main__":
    corpus, tokenizer, out = sys.argv[1:4]
    preprocess(Path(out), Options(workers=2, chunk_chars=1 << 14), resolve_sources([corpus]),
               load_tokenizer(tokenizer, None), 64)
    own_peak = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 1024
    print(json.dumps([own_peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))
"""


def test_peak_memory_does_not_grow_with_the_input(work, tokenizer):
    """Peak RSS of the main process (VmHWM: its own; ru_maxrss would include the pytest worker that started it,
    whatever that worker held before) and of the tokenizer processes for ~2.5 and ~30 MB of JSON lines in
    16 KiB chunks: the workers' within 4 MiB, the main process's by less than half the extra input (holding
    even half the extra text would exceed it). Measured: 709.2 and 716.7 MiB, the same to 0.4 MiB
    from run to run; the few MiB it grows are the reader's 1 MiB blocks and the allocator's."""
    script = work / "rss_child.py"
    script.write_text(RSS_CHILD)
    peaks = []
    for megabytes in (2, 24):
        corpus = work / f"rss_{megabytes}.jsonl"
        docs = make_documents(seed=megabytes, count=megabytes * 10_000)
        with corpus.open("w") as out:
            out.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        proc = subprocess.run(
            [sys.executable, str(script), str(corpus), str(tokenizer), str(work / f"rss_out_{megabytes}")],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3"},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks.append(json.loads(proc.stdout.strip().splitlines()[-1]) + [corpus.stat().st_size / 2**20])
    (main, workers, size), (main_big, workers_big, size_big) = peaks
    assert workers_big - workers < 4, peaks  # the tokenizer processes hold a few chunks
    assert main_big - main < (size_big - size) / 2, peaks


def test_manifest_records_tokenizer_ids_and_shards(pretrain_folder, tokenizer, sp):
    manifest = read_manifest(pretrain_folder)
    from mindscale.io import sha256

    assert manifest["tokenizer"]["sha256"] == sha256(Path(tokenizer))
    assert (manifest["vocab_size"], manifest["eos_id"], manifest["pad_id"], manifest["bos_id"]) == (VOCAB, 2, 0, 3)
    assert manifest["seq_length"] == SEQ and manifest["mode"] == "pretrain" and manifest["fields"] == ["input_ids"]
    sizes = [s["samples"] for s in manifest["shards"]]
    assert sum(sizes) == manifest["num_samples"] and max(sizes) == 10 and len(sizes) > 2


def test_every_input_format_gives_the_same_samples(work, docs, tokenizer, pretrain_folder):
    import datasets
    import pandas as pd

    (work / "docs.txt").write_text("\n".join(docs) + "\n")
    pd.DataFrame({"text": docs}).to_parquet(work / "docs.parquet")
    pd.DataFrame({"other": range(len(docs)), "text": docs}).to_csv(work / "docs.csv", index=False)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(work / "docs_disk"))
    expected = [row["input_ids"] for row in stored(pretrain_folder)]
    for name, extra in [
        ("docs.txt", ["--text-unit", "line"]),
        ("docs.parquet", []),
        ("docs.csv", []),
        ("docs_disk", []),
    ]:
        out = work / f"pre_{name.replace('.', '_')}"
        preprocess("--input", work / name, "--tokenizer", tokenizer, "--seq-length", SEQ, "--output", out, *extra)
        got = [row["input_ids"] for row in stored(out)]
        assert len(got) == len(expected), name
        np.testing.assert_array_equal(np.stack(got), np.stack(expected), err_msg=name)


# ----------------------------------------------------------------------------------------------
# the loader


def sample_ids(folder):
    return {row["input_ids"].tobytes(): i for i, row in enumerate(stored(folder))}


def which(batch, index):
    """Stored sample index of each row of a batch (its tokens are the stored S+1)."""
    return [index[row.tobytes()] for row in batch["tokens"]]


def test_pretraining_batches_are_the_stored_tokens_without_a_mask(pretrain_folder):
    """Every label of pretraining data is trained: the step takes the stored S+1 tokens alone and shifts them
    in the graph (models.transformer.NextTokenLoss); no mask is fed."""
    batch = steps(make_cfg(pretrain_folder, micro=3), count=1)[0]
    assert list(batch) == ["tokens"] and batch["tokens"].shape == (3, SEQ + 1) and batch["tokens"].dtype == np.int32
    index = sample_ids(pretrain_folder)
    assert all(row.tobytes() in index for row in batch["tokens"])


def test_order_is_deterministic_and_seeded(pretrain_folder):
    index = sample_ids(pretrain_folder)
    first = [which(b, index) for b in steps(make_cfg(pretrain_folder), count=6)]
    again = [which(b, index) for b in steps(make_cfg(pretrain_folder), count=6)]
    other = [which(b, index) for b in steps(make_cfg(pretrain_folder, seed=8), count=6)]
    assert first == again and first != other
    plain = [which(b, index) for b in steps(make_cfg(pretrain_folder, shuffle=False), count=3)]
    assert plain == [[0, 1], [2, 3], [4, 5]]


def test_rank_sharding_and_accumulation_keep_the_global_order(pretrain_folder):
    index = sample_ids(pretrain_folder)
    one = [which(b, index) for b in steps(make_cfg(pretrain_folder, micro=4), count=7)]
    ranks = [
        [which(b, index) for b in steps(make_cfg(pretrain_folder, dp=2, micro=2), r, 2, count=7)] for r in range(2)
    ]
    assert [a + b for a, b in zip(*ranks)] == one
    accumulated = [which(b, index) for b in steps(make_cfg(pretrain_folder, micro=2, accumulation=2), count=7)]
    assert accumulated == one
    # two ranks with accumulation: micro step m of rank r takes rows [m*W*B + r*B, ...+B) of the step
    both = [
        [which(b, index) for b in steps(make_cfg(pretrain_folder, dp=2, micro=1, accumulation=2), r, 2, count=7)]
        for r in range(2)
    ]
    assert [[a[0], b[0], a[1], b[1]] for a, b in zip(*both)] == one


def test_resume_skips_exactly_the_consumed_steps(pretrain_folder):
    index = sample_ids(pretrain_folder)
    cfg = make_cfg(pretrain_folder, dp=2, micro=2)
    for rank in range(2):
        full = [which(b, index) for b in steps(cfg, rank, 2, count=20)]
        resumed = [which(b, index) for b in steps(cfg, rank, 2, start_step=13, count=7)]
        assert resumed == full[13:]


def test_epochs_cycle_through_every_sample_in_a_new_order(pretrain_folder):
    index = sample_ids(pretrain_folder)
    n = len(index)
    cfg = make_cfg(pretrain_folder, micro=3, steps=(2 * n) // 3 + 1)
    order = [i for b in steps(cfg, count=(2 * n) // 3 + 1) for i in which(b, index)]
    first, second = order[:n], order[n : 2 * n]
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second


def test_synthetic_data_is_seeded_in_vocab_and_rank_invariant():
    cfg = make_cfg("synthetic", vocab=97, micro=4)
    one = steps(cfg, count=3)
    assert all(b["tokens"].min() >= 0 and b["tokens"].max() < 97 for b in one)
    np.testing.assert_array_equal(steps(cfg, count=3)[2]["tokens"], one[2]["tokens"])
    assert not np.array_equal(
        steps(make_cfg("synthetic", vocab=97, micro=4, seed=8), count=1)[0]["tokens"], one[0]["tokens"]
    )
    ranks = [steps(make_cfg("synthetic", vocab=97, dp=2, micro=2), r, 2, count=3) for r in range(2)]
    for step, (a, b) in enumerate(zip(*ranks)):
        np.testing.assert_array_equal(np.concatenate([a["tokens"], b["tokens"]]), one[step]["tokens"])
    np.testing.assert_array_equal(steps(cfg, start_step=2, count=1)[0]["tokens"], one[2]["tokens"])


def test_loader_validation_errors_name_the_problem(work, pretrain_folder, tokenizer):
    cases = [
        (make_cfg(work / "nope"), "does not exist"),
        (make_cfg(pretrain_folder, seq=32), "seq_length 16 but model.seq_length=32"),
        (make_cfg(pretrain_folder, vocab=256), "set model.vocab_size >= 512"),
        (make_cfg(pretrain_folder, eos_id=5), "set data.eos_id=2"),
        (make_cfg(pretrain_folder, tokenizer=work / "missing.model"), "does not exist"),
        (make_cfg("synthetic", vocab=256, tokenizer=tokenizer), "model.vocab_size=256"),
    ]
    empty = work / "empty_dir"
    empty.mkdir()
    cases.append((make_cfg(empty), "is empty"))
    no_manifest = work / "no_manifest"
    no_manifest.mkdir()
    (no_manifest / "data_00000.mindrecord").write_bytes(b"x")
    cases.append((make_cfg(no_manifest), "manifest.json is missing"))
    lost_shard = work / "lost_shard"
    shutil.copytree(pretrain_folder, lost_shard)
    (lost_shard / "data_00001.mindrecord").unlink()
    cases.append((make_cfg(lost_shard), "data_00001.mindrecord (or its .db index) listed in"))
    changed = work / "changed"
    shutil.copytree(pretrain_folder, changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["num_samples"] += 1
    (changed / "manifest.json").write_text(json.dumps(manifest))
    cases.append((make_cfg(changed), "the folder was changed after preprocessing"))
    for cfg, message in cases:
        with pytest.raises(DataError, match=None) as info:
            build_dataset(cfg)
        assert message in str(info.value) and "\n" not in str(info.value), (message, str(info.value))
    TRAIN_TOKENIZER.main(["--input", str(work / "corpus.txt"), "--vocab-size", "480", "--output", str(work / "other")])
    with pytest.raises(DataError, match="is not the tokenizer"):
        build_dataset(make_cfg(pretrain_folder, tokenizer=work / "other.model"))
    with pytest.raises(DataError, match="does not split over 3 workers"):
        build_dataset(make_cfg(pretrain_folder, dp=2), 0, 3)


def linked_copy(
    folder, name, own=(), copy=lambda src, dst: subprocess.run(["cp", "--sparse=always", src, dst], check=True)
):
    """A copy of `folder` cheap in time and disk: hard links to its files, but the files named in `own`, which are
    copied (`copy`; cp keeps a sparse shard's holes), and the manifest, so that changing them leaves `folder` whole."""
    target = folder.parent / name
    target.mkdir()
    for path in folder.iterdir():
        if path.is_file():
            (copy if path.name in {*own, "manifest.json"} else os.link)(path, target / path.name)
    return target


def damaged_copy(folder, name, damage):
    """A copy of `folder` whose second shard `damage(path)` changed."""
    shard = read_manifest(folder)["shards"][1]["file"]
    copy = linked_copy(folder, name, own=[shard])
    damage(copy / shard)
    return copy


def overwrite_data_pages(path):
    """Random bytes over the shard's first data page (after MindRecord's header, whose size it states), in place:
    the size stays, MindSpore's reader crashes the process (SIGSEGV) on the page."""
    header = json.loads(path.read_bytes()[8:].split(b"\0", 1)[0])
    with open(path, "r+b") as handle:
        handle.seek(header["header_size"])
        handle.write(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def test_damaged_shards_are_refused_before_reading_and_old_folders_load_unchecked(work, pretrain_folder):
    """Each shard's size and xxh3_128 are in the manifest: a truncated shard is refused by its size at every start,
    one with other bytes by its checksum when the run's index is built (before any read: MindSpore's reader
    crashes on both). A folder from before checksums loads, said unchecked in one line, until --add-checksums
    records them; data.verify_checksums=false hashes nothing."""
    shard = read_manifest(pretrain_folder)["shards"][1]
    assert set(shard) == {"file", "samples", "bytes", "xxh3_128", "db_bytes", "db_xxh3_128"}
    cut = damaged_copy(pretrain_folder, "cut", lambda path: os.truncate(path, path.stat().st_size // 2))
    with pytest.raises(DataError) as info:
        build_dataset(make_cfg(cut, run_dir=work / "runs_cut"), say=lambda line: None)
    assert str(info.value) == (
        f"shard {cut}/data_00001.mindrecord holds {shard['bytes'] // 2:,} bytes but "
        f"{cut}/manifest.json records {shard['bytes']:,}: it was cut short or changed after "
        "preprocessing; copy the folder again from where it was made, or re-run "
        "tools/preprocess_data.py"
    )
    overwritten = damaged_copy(pretrain_folder, "overwritten", overwrite_data_pages)
    lines = []
    with pytest.raises(DataError) as info:
        build_dataset(make_cfg(overwritten, run_dir=work / "runs_overwritten"), say=lines.append)
    assert str(info.value) == (
        f"shard {overwritten}/data_00001.mindrecord does not match its xxh3_128 checksum in "
        f"{overwritten}/manifest.json: its bytes changed after preprocessing; copy the folder "
        "again from where it was made, or re-run tools/preprocess_data.py"
    )
    assert lines == [] and not (work / "runs_overwritten" / "run" / "index" / "train.json").exists()
    unchecked = build_dataset(
        make_cfg(overwritten, run_dir=work / "runs_off", verify_checksums=False), say=lines.append
    )
    assert unchecked.index.note.startswith("built") and not any("checksum" in line for line in lines)

    lines = []
    build_dataset(make_cfg(pretrain_folder, run_dir=work / "runs_intact"), say=lines.append)
    shards = len(read_manifest(pretrain_folder)["shards"])
    # MindRecord's preallocated pages are holes in a small shard, not read; a copy that wrote them out matches
    dense = linked_copy(
        pretrain_folder,
        "dense",
        own=["data_00000.mindrecord"],
        copy=lambda src, dst: Path(dst).write_bytes(Path(src).read_bytes()),
    )
    on_disk = [
        (path.stat().st_blocks * 512, path.stat().st_size)
        for path in (pretrain_folder / "data_00000.mindrecord", dense / "data_00000.mindrecord")
    ]
    assert on_disk[0][0] < on_disk[0][1] <= on_disk[1][0], on_disk
    build_dataset(make_cfg(dense, run_dir=work / "runs_dense"), say=lambda line: None)
    assert re.fullmatch(
        rf"data \(train\): {shards} shard\(s\) match their checksums \(\d+\.\d\d GB in "
        r"\d+\.\d s, xxh3_128\)",
        lines[0],
    ), lines

    old = linked_copy(pretrain_folder, "before_checksums")
    manifest = read_manifest(old)
    manifest["shards"] = [{"file": s["file"], "samples": s["samples"]} for s in manifest["shards"]]
    (old / "manifest.json").write_text(json.dumps(manifest))
    lines = []
    build_dataset(make_cfg(old, run_dir=work / "runs_old"), say=lines.append)
    assert lines[0] == (
        f"data (train): not checked, their manifest.json records no shard checksums (written before "
        f"MindScale kept them): {old}; add them with tools/preprocess_data.py --add-checksums FOLDER"
    )
    code, out, err = run_cli("preprocess_data", "--add-checksums", old)
    assert code == 0 and re.fullmatch(
        rf"{old}: recorded the size and checksum of {shards} shard\(s\) \(\d+\.\d\d GB "
        rf"in \d+\.\d s\) in {old}/manifest.json\n",
        out,
    ), (out, err)
    assert read_manifest(old)["shards"] == read_manifest(pretrain_folder)["shards"]


# ----------------------------------------------------------------------------------------------
# SFT


ALPACA = [
    {"instruction": "describe a cat", "input": "", "output": "a small animal"},
    {"instruction": "add", "input": "one and two", "output": "three"},
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "greetings friend"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "see you"},
        ]
    }
]


def answers(record):
    if "messages" in record:
        return [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    return [record["output"]]


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_sft_mask_covers_exactly_the_answers(template, sp, encoder):
    for record, (ids, mask) in zip(ALPACA + CHAT, encode_examples(ALPACA + CHAT, TEMPLATES[template], encoder)):
        trained = [t for t, m in zip(ids, mask) if m]
        assert trained == [t for a in answers(record) for t in sp.encode(a) + [sp.eos_id()]]
        prompt = sp.decode([t for t, m in zip(ids, mask) if not m])
        user = record["messages"][1]["content"] if "messages" in record else record["instruction"]
        assert user in prompt and not any(a in prompt for a in answers(record))
    first = ALPACA[0]
    ids, mask = encode_examples([first], TEMPLATES[template], encoder)[0]
    messages = [{"role": "user", "content": first["instruction"]}]
    assert encode_prompt(messages, TEMPLATES[template], encoder) == ids[: mask.index(1)]


def test_special_tokens_come_from_the_template_not_from_user_text(sp, encoder):
    ids, mask = encode_examples([{"instruction": "<eos> <bos> <s>", "output": "</s>"}], TEMPLATES["alpaca"], encoder)[0]
    assert ids.count(sp.eos_id()) == 1 and ids[-1] == sp.eos_id() and ids.count(sp.bos_id()) == 1


@pytest.fixture(scope="module")
def sft_file(work):
    long_answer = " ".join(["word"] * 200)
    records = ALPACA + CHAT + ALPACA + [{"instruction": "say a lot", "output": long_answer}]
    path = work / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records


def test_sft_samples_pad_truncate_and_align_the_mask_with_labels(work, sft_file, tokenizer, sp, encoder, capsys):
    path, records = sft_file
    out = work / "sft_plain"
    preprocess(
        "--mode",
        "sft",
        "--template",
        "llama2",
        "--input",
        path,
        "--tokenizer",
        tokenizer,
        "--seq-length",
        63,
        "--output",
        out,
    )
    manifest = read_manifest(out)
    encoded = encode_examples(records, TEMPLATES["llama2"], encoder)
    assert manifest["examples"] == manifest["num_samples"] == len(records)
    assert manifest["truncated_examples"] == sum(len(ids) > 64 for ids, _ in encoded) >= 1
    # the summary line says what became of the examples, as the pretraining one says what was held out
    assert capsys.readouterr().out == (
        f"sft: {len(records)} examples ({manifest['truncated_examples']} truncated, 0 dropped without answer tokens; "
        f"template llama2) -> {len(records)} samples of 64 tokens ({manifest['num_tokens']} tokens, "
        f"{manifest['loss_tokens']} trained) in 1 shard(s) -> {out}\n"
    )
    assert manifest["fields"] == ["input_ids", "loss_mask"] and manifest["dropped_examples"] == 0
    for row, (ids, mask) in zip(stored(out), encoded):
        n = min(len(ids), 64)
        np.testing.assert_array_equal(row["input_ids"], ids[:n] + [sp.pad_id()] * (64 - n))
        np.testing.assert_array_equal(row["loss_mask"], mask[:n] + [0] * (64 - n))
    batch = steps(make_cfg(out, seq=63, micro=len(records), shuffle=False), count=1)[0]
    for row, (ids, mask) in enumerate(encoded):
        n = min(len(ids), 64)
        trained_labels = batch["tokens"][row, 1:][batch["loss_mask"][row] == 1].tolist()
        assert trained_labels == [t for t, m in zip(ids[1:n], mask[1:n]) if m]


def test_sft_packing_keeps_examples_whole_with_segment_ids(work, sft_file, tokenizer, sp, encoder):
    path, records = sft_file
    out = work / "sft_packed"
    preprocess(
        "--mode",
        "sft",
        "--template",
        "alpaca",
        "--input",
        path,
        "--tokenizer",
        tokenizer,
        "--seq-length",
        255,
        "--output",
        out,
        "--pack",
    )
    manifest = read_manifest(out)
    assert manifest["fields"] == ["input_ids", "loss_mask", "segment_ids"] and manifest["pack"] is True
    encoded = [(ids[:256], mask[:256]) for ids, mask in encode_examples(records, TEMPLATES["alpaca"], encoder)]
    rows = stored(out)
    assert len(rows) < len(records)
    unpacked = []
    for row in rows:
        seg = row["segment_ids"]
        used = int((seg > 0).sum())
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all() and (np.diff(seg[:used]) >= 0).all()
        assert (row["input_ids"][used:] == sp.pad_id()).all() and (row["loss_mask"][used:] == 0).all()
        for k in range(1, int(seg.max()) + 1):
            unpacked.append((row["input_ids"][seg == k].tolist(), row["loss_mask"][seg == k].tolist()))
    assert unpacked == encoded
    batch = steps(make_cfg(out, seq=255, micro=1, shuffle=False), count=1)[0]
    np.testing.assert_array_equal(batch["segment_ids"][0], rows[0]["segment_ids"][:-1])


def test_sft_drops_examples_without_answer_tokens(work, tokenizer):
    path = work / "long_prompt.jsonl"
    path.write_text(
        json.dumps({"instruction": " ".join(["prompt"] * 100), "output": "ok"}) + "\n" + json.dumps(ALPACA[1]) + "\n"
    )
    out = work / "sft_dropped"
    preprocess("--mode", "sft", "--input", path, "--tokenizer", tokenizer, "--seq-length", 127, "--output", out)
    manifest = read_manifest(out)
    assert (manifest["examples"], manifest["dropped_examples"], manifest["num_samples"]) == (2, 1, 1)


# ----------------------------------------------------------------------------------------------
# bad input: one line on stderr, exit 2, nothing overwritten


def test_preprocess_bad_inputs_exit_2_with_one_line(work, tokenizer, pretrain_folder):
    base = ["--tokenizer", tokenizer, "--seq-length", SEQ]
    (work / "empty.jsonl").write_text("")
    (work / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "no end\n')
    (work / "not_sft.jsonl").write_text('{"text": "fine"}\n')
    (work / "fake.model").write_text("not a model")
    out = work / "out_bad"
    assert_bad_input(
        "preprocess_data", "--input", work / "missing.jsonl", *base, "--output", out, match="does not exist"
    )
    assert_bad_input("preprocess_data", "--input", work / "empty.jsonl", *base, "--output", out, match="is empty")
    assert_bad_input("preprocess_data", "--input", work / "broken.jsonl", *base, "--output", out, match="cannot read")
    assert_bad_input(
        "preprocess_data",
        "--input",
        work / "docs.jsonl",
        *base,
        "--output",
        out,
        "--text-key",
        "body",
        match="no column 'body'",
    )
    assert_bad_input(
        "preprocess_data",
        "--mode",
        "sft",
        "--input",
        work / "not_sft.jsonl",
        *base,
        "--output",
        out,
        match="record 0 (0-based)",
    )
    assert_bad_input(
        "preprocess_data",
        "--input",
        work / "docs.jsonl",
        *base,
        "--output",
        out,
        "--vocab-size",
        300,
        match="more than the model's vocabulary of 300",
    )
    assert_bad_input(
        "preprocess_data",
        "--input",
        work / "docs.jsonl",
        "--tokenizer",
        work / "fake.model",
        "--seq-length",
        SEQ,
        "--output",
        out,
        match="is not a SentencePiece model",
    )
    assert_bad_input(
        "preprocess_data",
        "--input",
        work / "docs.jsonl",
        *base,
        "--output",
        out,
        "--valid-fraction",
        1.5,
        match="--valid-fraction 1.5: must be in [0, 1)",
    )
    assert_bad_input(
        "preprocess_data",
        "--input",
        work / "docs.jsonl",
        *base,
        "--output",
        out,
        "--valid-fraction",
        0.01,
        match="--valid-fraction 0.01 holds out 0 document(s), 0 tokens: too few for one sample",
    )
    assert_bad_input(
        "preprocess_data",
        "--mode",
        "sft",
        "--input",
        work / "not_sft.jsonl",
        *base,
        "--output",
        out,
        "--valid-fraction",
        0.1,
        match="--valid-fraction applies to --mode pretrain",
    )
    assert not out.exists() and not list(work.glob(".out_bad.partial-*"))
    before = sorted(p.name for p in pretrain_folder.iterdir())
    assert_bad_input(
        "preprocess_data",
        "--input",
        work / "docs.jsonl",
        *base,
        "--output",
        pretrain_folder,
        match="exists and is not empty",
    )
    assert sorted(p.name for p in pretrain_folder.iterdir()) == before


def test_overwrite_replaces_a_folder_it_wrote_and_refuses_one_with_other_files(work, tokenizer, pretrain_folder):
    out = work / "replace_me"
    preprocess("--input", work / "docs.jsonl", "--tokenizer", tokenizer, "--seq-length", SEQ, "--output", out)
    first = read_manifest(out)["num_samples"]
    preprocess(
        "--input",
        work / "docs.jsonl",
        "--tokenizer",
        tokenizer,
        "--seq-length",
        2 * SEQ,
        "--output",
        out,
        "--overwrite",
    )
    manifest = read_manifest(out)
    assert manifest["seq_length"] == 2 * SEQ and manifest["num_samples"] < first
    assert len(stored(out)) == manifest["num_samples"]
    assert not [p for p in work.iterdir() if p.name.startswith(".replace_me")]
    # a file the tool did not write is never deleted: --overwrite refuses the folder then
    (out / "notes.txt").write_text("mine")
    before = sorted(p.name for p in out.iterdir())
    assert_bad_input(
        "preprocess_data",
        "--input",
        work / "docs.jsonl",
        "--tokenizer",
        tokenizer,
        "--seq-length",
        SEQ,
        "--output",
        out,
        "--overwrite",
        match="holds files tools/preprocess_data.py did not write "
        "(notes.txt); --overwrite replaces only a folder it wrote",
    )
    assert sorted(p.name for p in out.iterdir()) == before and (out / "notes.txt").read_text() == "mine"


def test_train_tokenizer_bad_inputs_exit_2_with_one_line(work, tokenizer):
    assert_bad_input(
        "train_tokenizer",
        "--input",
        work / "missing.txt",
        "--vocab-size",
        400,
        "--output",
        work / "t",
        match="does not exist",
    )
    assert_bad_input(
        "train_tokenizer",
        "--input",
        work / "corpus.txt",
        "--vocab-size",
        100,
        "--output",
        work / "t",
        match="--vocab-size 100 is too small",
    )
    assert_bad_input(
        "train_tokenizer",
        "--input",
        work / "corpus.txt",
        "--vocab-size",
        512,
        "--output",
        work / "tok",
        match="exists; pass --overwrite",
    )
