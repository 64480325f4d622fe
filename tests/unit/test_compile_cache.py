"""The compile cache's key (mindscale/train/loop/compile_cache.py): what changes it and what does not."""

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.train.loop.compile_cache import (
    CACHE_DIR,
    SHARED_DIR_ENV,
    SHARDED_SKIP,
    CompileCache,
    cache_key,
    sources_digest,
)

TINY = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")


def key(*overrides, device="CPU", version="2.9.0", sources="s"):
    return cache_key(load_config(TINY, list(overrides)), device, version, sources)


def test_the_key_changes_with_the_graph_config_device_version_and_sources():
    base = key()
    changed = [
        key("model.hidden_size=256"),
        key("train.steps=300"),
        key("parallel.gradient_accumulation_steps=2"),
        key("run.seed=1"),
        key(device="Ascend"),
        key(version="2.9.1"),
        key(sources="t"),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_the_key_ignores_the_run_name_folders_logging_and_checkpoints():
    # a --max-restarts restart adds checkpoint.resume_step=null and keeps run.max_restarts: the same key
    assert (
        key(
            "run.name=other",
            "run.output_dir=/elsewhere",
            "run.max_restarts=3",
            "run.hang_timeout_s=60",
            "train.log_interval=1",
            "checkpoint.save_interval=2",
            "checkpoint.resume_step=null",
            "profile.enable=true",
            "run.compile_cache=false",
        )
        == key()
    )


def test_the_sources_digest_sees_an_edit_of_a_model_file(tmp_path):
    for package in ("mindscale", "models"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "a.py").write_text("x = 1\n")
    before = sources_digest(tmp_path)
    (tmp_path / "models" / "a.py").write_text("x = 2\n")
    assert sources_digest(tmp_path) != before


def test_sharded_layouts_and_pynative_are_not_cached_and_a_stale_key_of_this_rank_goes(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [__file__])  # an xdist worker runs as `python -c`: no entry script to hash
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)  # the run folder's own cache (tests/conftest.py shares one)
    sharded = load_config(TINY, ["parallel.model_parallel=2", "parallel.data_parallel=1", "hardware=ascend910b"])
    cache = CompileCache.of(sharded, Layout.of(sharded, "Ascend", 2), tmp_path, "Ascend", 0)
    assert cache.folder is None and cache.skipped == SHARDED_SKIP
    pynative = load_config(TINY, ["run.mode=pynative"])
    off = CompileCache.of(pynative, Layout.of(pynative, "CPU", 2), tmp_path, "CPU", 0)
    assert off.folder is None and off.skipped is None  # nothing compiled to cache: nothing said
    cfg = load_config(TINY)
    for rank in (0, 1):
        (tmp_path / CACHE_DIR / "0123456789abcdef" / f"rank_{rank}").mkdir(parents=True)
    cache = CompileCache.of(cfg, Layout.of(cfg, "CPU", 2), tmp_path, "CPU", 0)
    assert cache.folder.parent == (tmp_path / CACHE_DIR).absolute() and cache.skipped is None
    assert [p.name for p in (tmp_path / CACHE_DIR / "0123456789abcdef").iterdir()] == ["rank_1"]


def test_a_shared_folder_holds_every_runs_keys_and_a_compiling_rank_locks_its_own(tmp_path, monkeypatch):
    """MINDSCALE_COMPILE_CACHE_DIR: the keys' folders there, none pruned; while a rank compiles, another job's
    same rank waits for it (its lock), another rank does not."""
    import fcntl

    monkeypatch.setattr("sys.argv", [__file__])
    monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path / "shared"))
    (tmp_path / "shared" / "0123456789abcdef" / "rank_0").mkdir(parents=True)
    cfg = load_config(TINY)
    cache = CompileCache.of(cfg, Layout.of(cfg, "CPU", 2), tmp_path / "run", "CPU", 0)
    assert cache.folder.parent == tmp_path / "shared" and (tmp_path / "shared" / "0123456789abcdef").is_dir()
    with cache.compiling():
        for rank, free in ((0, False), (1, True)):
            (cache.folder / f"rank_{rank}.lock").touch()
            with open(cache.folder / f"rank_{rank}.lock") as other:
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    taken = True
                except BlockingIOError:
                    taken = False
            assert taken == free


def test_an_entry_script_mindspore_cannot_open_turns_the_cache_off_in_one_line(tmp_path, monkeypatch):
    """MindSpore opens sys.argv[0] (resolved at its import) to hash it into the cache: a `python -c` run,
    or a script that changed directory first, would fail in the compile; the cache stays off instead."""
    cfg = load_config(TINY)
    monkeypatch.setattr("sys.argv", ["bench/not_here.py"])
    monkeypatch.chdir(tmp_path)
    cache = CompileCache.of(cfg, Layout.of(cfg, "CPU", 2), tmp_path, "CPU", 0)
    assert cache.folder is None and "'bench/not_here.py'" in cache.skipped and "\n" not in cache.skipped
