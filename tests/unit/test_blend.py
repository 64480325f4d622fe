"""Weighted blends and sample indexes (mindscale/train/data/blend.py, index.py, dataset.py): the step-count
bound, determinism, rank and accumulation invariance, resume, wrap-around epochs, index reuse and rebuild,
and bad input. Sources are real MindRecord folders written here, read through build_dataset."""

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import mindscale.train.data.index as index_module
from mindscale.config import ConfigError, config_from_tree
from mindscale.io import DataError
from mindscale.train.data.blend import StepCounts, assign
from mindscale.train.data.dataset import build_dataset
from tests.data_folders import write_data_folder

SEQ = 8
SIZES = (23, 29, 11)  # unequal sizes; in 40 steps each source wraps at least twice
WEIGHTS = (0.5, 0.3, 0.2)


def write_source(folder: Path, tag: int, samples: int, seq: int = SEQ, tokenizer_sha: str = "t0") -> Path:
    """A real MindRecord folder: sample i of source `tag` holds the id tag * 1000 + i everywhere, so every row
    read back names its source and stored index."""
    rows = np.repeat(tag * 1000 + np.arange(samples)[:, None], seq + 1, axis=1)
    return write_data_folder(folder, rows, 4000, tokenizer_sha)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return [write_source(root / f"s{k}", k, n) for k, n in enumerate(SIZES)]


def make_cfg(out, sources, weights=WEIGHTS, dp=1, micro=5, accumulation=1, seed=3, steps=40, **data):
    return config_from_tree(
        {
            "run": {"seed": seed, "output_dir": str(out), "name": "run"},
            "model": {
                "vocab_size": 4000,
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "ffn_hidden_size": 64,
                "seq_length": SEQ,
            },
            "parallel": {"data_parallel": dp, "gradient_accumulation_steps": accumulation},
            "train": {"micro_batch_size": micro, "steps": steps},
            "data": {"blend": [{"path": str(p), "weight": w} for p, w in zip(sources, weights)], **data},
        }
    )


def global_steps(cfg, world=1, start=0, count=None):
    """Per step, the (source, stored index) of every row of the global batch, ranks concatenated in rank order."""
    count = cfg.train.steps - start if count is None else count
    accumulation = cfg.parallel.gradient_accumulation_steps
    per_rank = []
    for rank in range(world):
        stream = iter(build_dataset(cfg, rank, world, start, say=lambda line: None))
        steps = []
        for _ in range(count):
            micro = [next(stream) for _ in range(accumulation)]
            steps.append([[int(row[0]) for row in m["tokens"]] for m in micro])
        per_rank.append(steps)
    out = []
    for s in range(count):  # micro step m of every rank, then m + 1: the global order (dataset.py)
        ids = [i for m in range(accumulation) for rank in range(world) for i in per_rank[rank][s][m]]
        out.append([divmod(i, 1000) for i in ids])
    return out


# ----------------------------------------------------------------------------------------------
# the assignment math


@pytest.mark.parametrize(
    "weights, batch",
    [
        ((0.5973, 0.0015, 0.3584, 0.0106, 0.0322), 1),  # breaks Megatron's furthest-below rule: 1.09 samples
        ((1, 1, 1), 1),
        ((0.7, 0.2, 0.1), 10),
        ((3.0, 1e-4, 2.0, 7.5), 64),
        ((1,), 4),
        ((0.91,) + (0.01,) * 9, 7),
    ],
)
def test_step_counts_stay_within_one_sample_of_the_weights(weights, batch):
    counts = StepCounts(weights, batch)
    starts = np.concatenate(list(counts.starts(3000, chunk=257)))
    share = np.arange(3001)[:, None] * batch * counts.weights[None]
    assert np.abs(starts - share).max() < 1
    assert (starts.sum(axis=1) == np.arange(3001) * batch).all() and (np.diff(starts, axis=0) >= 0).all()


def test_random_weights_keep_the_bound_and_every_draw_once():
    rng = np.random.default_rng(0)
    for _ in range(150):
        k = int(rng.integers(1, 9))
        weights = rng.random(k) ** rng.integers(1, 6) + 1e-6
        batch = int(rng.choice([1, 3, 8, 100]))
        counts = StepCounts(weights, batch)
        starts = np.concatenate(list(counts.starts(200, chunk=31)))
        assert np.abs(starts - np.arange(201)[:, None] * batch * counts.weights).max() < 1
        source, draw = assign(starts, np.arange(batch))
        for s in range(k):  # each source's draws 0, 1, 2, ... each once, in stream order
            assert (draw[source == s] == np.arange(starts[-1, s])).all()


def orders(tmp_path, name, n, epochs, seed=1):
    out = index_module.NpyFile(tmp_path / f"{name}.npy", np.uint32, (epochs * n,))
    index_module._fill_orders(out, n, seed, 0)
    out.close()
    return np.load(tmp_path / f"{name}.npy").reshape(epochs, n)


def bucket_epoch(n, seed, source, epoch, chunk, bucket):
    """The definition the two-pass build must meet, all in memory: sample i goes to bucket draws[i] (drawn
    `chunk` samples at a time), bucket b holds its samples in ascending order, shuffled by (seed, source,
    epoch, 1, b); the buckets back to back."""
    buckets = -(-n // bucket)
    draws = np.concatenate(
        [
            np.random.default_rng([seed, source, epoch, 0, c]).integers(
                0, buckets, min(chunk, n - low), dtype=np.uint16
            )
            for c, low in enumerate(range(0, n, chunk))
        ]
    )
    parts = []
    for b in range(buckets):
        part = np.flatnonzero(draws == b).astype(np.uint32)
        np.random.default_rng([seed, source, epoch, 1, b]).shuffle(part)
        parts.append(part)
    return np.concatenate(parts)


def test_long_epoch_shuffle_in_buckets_is_a_permutation_and_a_longer_run_extends_a_shorter(tmp_path, monkeypatch):
    monkeypatch.setattr(index_module, "CHUNK", 3000)  # 9 chunks, 25 buckets in 9 groups of a 25000-sample epoch
    monkeypatch.setattr(index_module, "BUCKET", 1000)
    monkeypatch.setattr(index_module, "GROUP", 3)
    monkeypatch.setattr(index_module, "IOV_MAX", 4)  # a group's 27 pieces read in 7 calls
    epochs = orders(tmp_path, "long", 25000, 2)
    assert (np.sort(epochs, axis=1) == np.arange(25000)).all() and (epochs[0] != epochs[1]).any()
    for e in range(2):  # the files are the definition's, byte for byte (an index built earlier stays valid)
        assert (epochs[e] == bucket_epoch(25000, 1, 0, e, 3000, 1000)).all()
    longer, shorter = orders(tmp_path, "longer", 300, 9), orders(tmp_path, "shorter", 300, 4)
    assert (np.sort(longer, axis=1) == np.arange(300)).all() and (longer[:4] == shorter).all()


# ----------------------------------------------------------------------------------------------
# the stream through build_dataset, real MindRecord


def test_blend_counts_at_every_step_and_sources_wrap_with_their_own_shuffle(tmp_path, sources):
    cfg = make_cfg(tmp_path, sources)
    rows = global_steps(cfg)
    batch, weights = cfg.samples_per_step, np.array(WEIGHTS) / sum(WEIGHTS)
    drawn = np.zeros(3, np.int64)
    for s, step in enumerate(rows, 1):
        drawn += np.bincount([k for k, _ in step], minlength=3)
        assert np.abs(drawn - weights * s * batch).max() < 1, (s, drawn)
    for k, n in enumerate(SIZES):
        seen = [i for step in rows for source, i in step if source == k]
        epochs = [seen[e * n : (e + 1) * n] for e in range(len(seen) // n)]
        assert len(epochs) >= 2 and all(sorted(e) == list(range(n)) for e in epochs)
        assert epochs[0] != epochs[1]  # the next epoch is shuffled anew
    assert [len(s) for s in rows] == [batch] * cfg.train.steps


def test_order_is_seeded_and_the_same_for_any_worker_count_accumulation_and_resume(tmp_path, sources):
    one = global_steps(make_cfg(tmp_path, sources, micro=4))
    assert global_steps(make_cfg(tmp_path, sources, micro=4)) == one
    assert global_steps(make_cfg(tmp_path, sources, micro=4, seed=4)) != one
    assert global_steps(make_cfg(tmp_path, sources, dp=2, micro=2), world=2) == one
    assert global_steps(make_cfg(tmp_path, sources, dp=2, micro=1, accumulation=2), world=2) == one
    assert global_steps(make_cfg(tmp_path, sources, micro=4), start=27) == one[27:]
    assert global_steps(make_cfg(tmp_path, sources, dp=2, micro=2), world=2, start=13) == one[13:]
    # a longer run (train.steps raised on resume: a new index) starts with the shorter run's steps
    assert global_steps(make_cfg(tmp_path, sources, micro=4, steps=70))[:40] == one


def test_a_single_path_is_a_blend_of_one_in_stored_order_without_shuffle(tmp_path, sources):
    cfg = config_from_tree(
        {
            "run": {"output_dir": str(tmp_path)},
            "model": {"vocab_size": 4000, "seq_length": SEQ},
            "train": {"micro_batch_size": 3, "steps": 10},
            "data": {"path": str(sources[0]), "shuffle": False},
        }
    )
    rows = global_steps(cfg)
    assert [i for step in rows for _, i in step] == [p % SIZES[0] for p in range(30)]
    stream = build_dataset(cfg, say=lambda line: None)  # the run log's line names no share: there is one source
    assert (
        stream.describe() == f"data: {sources[0]} (30 samples of 23, 1.30 epochs) over 10 steps; index "
        f"built {stream.index.folder} in {stream.index.note.split(' in ')[1]}"
    )


def test_the_index_is_reused_and_a_changed_input_is_named_and_rebuilt(tmp_path, sources, monkeypatch):
    lines = []
    cfg = make_cfg(tmp_path, sources)
    stream = build_dataset(cfg, say=lines.append)
    assert lines[0].startswith("data (train): 3 shard(s) match their checksums (")  # checked before the build
    assert lines[1:] == [f"data index (train): no index yet; building {stream.index.folder}"]
    assert stream.drawn(40) == {str(p): int(n) for p, n in zip(sources, (100, 60, 40))}
    header = stream.describe()
    assert header.startswith(f"data: blend of {sources[0]} 50.0% (100 samples of 23, 4.35 epochs)")
    # found again by a process of the same job (rank 0 after rank 1 took the lock first): built by this run
    again = build_dataset(cfg, say=lines.append)
    assert len(lines) == 2 and again.index.note.startswith(f"built {stream.index.folder} in ")
    assert again.index.note.endswith(" s (no index yet)") and again.index.note == stream.index.note
    monkeypatch.setattr(index_module, "PROCESS_STARTED", time.time())  # a later process: a resume, a new job
    assert build_dataset(cfg, say=lines.append).index.note == f"reused {stream.index.folder}"
    first = global_steps(cfg, count=8)

    build_dataset(make_cfg(tmp_path, sources, weights=(0.5, 0.3, 0.25)), say=lines.append)
    assert f"source 2 ({sources[2]}) weight changed from 0.2 to 0.25" in lines[-1]
    changed = tmp_path / "changed"  # a source whose shard is rewritten after the index was built
    write_source(changed, 1, SIZES[1])
    moved = [sources[0], changed, sources[2]]
    build_dataset(make_cfg(tmp_path, moved), say=lines.append)
    shard = changed / "data_00000.mindrecord"
    shard.write_bytes(shard.read_bytes())  # same bytes, new mtime: the index cannot know it is the same
    build_dataset(make_cfg(tmp_path, moved), say=lines.append)
    assert f"source 1 ({changed.resolve()}): shard data_00000.mindrecord changed" in lines[-1]
    assert len(list((tmp_path / "run" / "index").glob("train-*"))) == 1  # the stale folder is gone
    assert global_steps(cfg, count=8) == first  # rebuilt identically


def test_bad_blends_are_one_line_errors(tmp_path, sources):
    for data, message in [
        ({"blend": [{"path": "a", "weight": 0}]}, "data.blend[0].weight=0.0: must be a finite number > 0"),
        ({"blend": [{"path": "a", "weight": -1}]}, "data.blend[0].weight=-1.0"),
        ({"blend": [{"weight": 1}]}, "data.blend[0] has no path"),
        ({"blend": [{"path": "a"}]}, "data.blend[0] (a) has no weight"),
        ({"blend": [{"path": "a", "weigth": 1}]}, "unknown key data.blend[0].weigth; did you mean 'weight'?"),
        ({"blend": [{"path": "a", "weight": 1}], "path": "b"}, "data.blend and data.path=b are both set"),
        ({"valid_blend": [{"path": "a", "weight": 1}], "valid_path": "b"}, "data.valid_blend and data.valid_path=b"),
        ({"blend": []}, "data.blend is an empty list"),
        ({"blend": [{"path": "a", "weight": 1}, {"path": "a", "weight": 2}]}, "data.blend[1].path=a repeats"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            config_from_tree({"data": data})
    with pytest.raises(DataError, match=r"data.blend\[1\].path=.*missing does not exist"):
        build_dataset(make_cfg(tmp_path, [sources[0], tmp_path / "missing"], weights=(1, 1)))
    other_tokenizer = write_source(tmp_path / "tok1", 5, 10, tokenizer_sha="t1")
    with pytest.raises(
        DataError,
        match=r"data.blend\[1\].path=.*tok1 was tokenized with /tok/t1.model but "
        r"data.blend\[0\].path=.* with /tok/t0.model",
    ):
        build_dataset(make_cfg(tmp_path, [sources[0], other_tokenizer], weights=(1, 1)))
    longer = write_source(tmp_path / "seq16", 6, 10, seq=16)
    with pytest.raises(DataError, match="has seq_length 16 but model.seq_length=8"):
        build_dataset(make_cfg(tmp_path, [sources[0], longer], weights=(1, 1)))


def test_an_index_folder_of_another_blend_is_refused_in_one_line(tmp_path, sources):
    """The run's index folder is named by its key's digest: another blend's files in it (copied over it, or the
    whole folder, key.json included) are named on one line with the fix, never read."""
    quiet = {"say": lambda line: None}
    cfg = make_cfg(tmp_path / "a", sources)
    folder = build_dataset(cfg, **quiet).index.folder
    other = build_dataset(make_cfg(tmp_path / "b", sources, weights=(0.2, 0.3, 0.5)), **quiet).index.folder
    for name in ("starts.npy", "order_0.npy", "order_1.npy", "order_2.npy"):
        shutil.copyfile(other / name, folder / name)
    with pytest.raises(DataError) as info:
        build_dataset(cfg, **quiet)
    assert str(info.value) == (
        f"index folder {folder}: the draws in starts.npy do not follow its key.json's weights "
        f"(another blend's index?); delete {folder} and the next run builds it anew"
    )
    shutil.copyfile(other / "starts.npy", folder / "starts.npy")
    (folder / "starts.npy").write_bytes(b"\x93NUMPY")  # cut short
    with pytest.raises(DataError, match=r"starts.npy is unreadable \(.*\); delete "):
        build_dataset(cfg, **quiet)
    shutil.rmtree(folder)
    shutil.copytree(other, folder)
    with pytest.raises(DataError) as info:
        build_dataset(cfg, **quiet)
    assert str(info.value) == (
        f"index folder {folder} is not this data's index (its key.json differs: source 0 "
        f"({sources[0].resolve()}) weight changed from 0.2 to 0.5); it was copied or edited: "
        f"delete {folder} and the next run builds it anew"
    )
    shutil.rmtree(folder)
    assert build_dataset(cfg, **quiet).index.note.startswith("built")  # as the message says


def test_token_ids_outside_the_vocabulary_stop_the_stream_naming_the_sample_and_its_shard(tmp_path):
    """A stored id at or past the manifest's vocab_size, or negative, would index past the embedding table: the
    batch holding it is refused in one line naming the sample and its shard, before it reaches a step; the
    batches before it pass."""
    for stored, bad in ((7, 100), (4, -5)):
        rows = np.tile(np.arange(SEQ + 1), (10, 1))
        rows[stored, 3] = bad
        folder = write_data_folder(tmp_path / f"ids_{stored}", rows, vocab_size=100)
        cfg = config_from_tree(
            {
                "run": {"output_dir": str(tmp_path / f"run_{stored}")},
                "model": {"vocab_size": 100, "seq_length": SEQ},
                "train": {"micro_batch_size": 2, "steps": 5},
                "data": {"path": str(folder), "shuffle": False},
            }
        )
        batches = iter(build_dataset(cfg, say=lambda line: None))
        for _ in range(stored // 2):
            next(batches)
        with pytest.raises(DataError) as info:
            next(batches)
        assert str(info.value) == (
            f"sample {stored} of shard {folder}/data_00000.mindrecord holds token id {bad}, outside the vocabulary "
            "of 100 its manifest records: the shard is damaged or was not written by tools/preprocess_data.py with "
            "that tokenizer; copy the folder again from where it was made, or re-run tools/preprocess_data.py"
        )


def test_batches_are_read_ahead_in_order_and_the_reader_stops_when_the_stream_is_dropped():
    """dataset.prefetched: the same items in the same order, at most `depth` read ahead of the consumer, the
    reader's exception raised when its item is due, and the reader thread gone once the consumer is closed."""
    import threading
    import time

    from mindscale.train.data.dataset import prefetched

    read = []

    def numbers():
        for i in range(100):
            read.append(i)
            yield i
        raise DataError("the end")

    stream = prefetched(numbers(), 3)
    assert [next(stream) for _ in range(10)] == list(range(10))
    time.sleep(0.3)
    assert len(read) <= 10 + 3 + 1  # the queue's 3 and the one the reader holds
    rest = []
    with pytest.raises(DataError, match="the end"):
        for item in stream:
            rest.append(item)
    assert rest == list(range(10, 100))
    assert list(prefetched(iter(range(5)), 2)) == list(range(5))  # a stream that ends: so does this one
    before = set(threading.enumerate())
    endless = prefetched(iter(lambda: 1, None), 2)
    next(endless)
    (reader,) = set(threading.enumerate()) - before
    endless.close()
    reader.join(timeout=5)
    assert reader.name == "mindscale-data" and not reader.is_alive()
