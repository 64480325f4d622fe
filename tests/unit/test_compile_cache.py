"""The compile cache (mindscale/train/loop/compile_cache.py): what changes its key and what does not, and the
layouts a loaded step is completed with. tests/dryrun/test_dryrun.py loads a sharded step from it for real."""

import json
import re

import pytest

from mindscale.config import REPO_ROOT, Layout, UserError, load_config
from mindscale.train.loop.compile_cache import (
    CACHE_DIR,
    LAYOUTS_FILE,
    SHARED_DIR_ENV,
    CompileCache,
    cache_key,
    completed_layouts,
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


def test_pynative_is_not_cached_sharded_layouts_are_and_a_stale_key_of_this_rank_goes(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [__file__])  # an xdist worker runs as `python -c`: no entry script to hash
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)  # the run folder's own cache (tests/conftest.py shares one)
    sharded = load_config(TINY, ["parallel.model_parallel=2", "parallel.data_parallel=1", "hardware=ascend910b"])
    cache = CompileCache.of(sharded, Layout.of(sharded, "Ascend", 2), tmp_path, "Ascend", 0)
    assert cache.folder is not None and cache.skipped is None
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
    with cache.compiling(step_with()):
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


def step_with(layouts=None):
    """A cell whose parameter layouts are set as a compile sets them (Cell.parameter_layout_dict)."""
    from mindspore import nn

    cell = nn.Cell()
    cell.parameter_layout_dict = layouts or {}
    return cell


# a parameter's compiled layout (12 fields: device matrix, tensor map, slice shape, ..., optimizer-shard group,
# full shape, ...) and the same as MindSpore 2.9 loads it from the cache: full shape and the field after it empty,
# the optimizer shard's slice appended (measured under the dry run, tests/dryrun/test_dryrun.py)
COMPILED = [[2, 2], [0, -1], [64, 128], 0, True, "2-52", [128, 128], [64, 128], False, False, 0, 0]
LOADED = ([2, 2], [0, -1], [64, 128], 0, True, "2-52", [], [], False, False, 0, 0, [32, 128])


def test_a_loaded_layout_is_completed_from_the_compiled_one_and_any_other_difference_is_refused(tmp_path):
    assert completed_layouts({"w": LOADED}, {"w": COMPILED}, tmp_path) == {"w": tuple(COMPILED)}
    for loaded, kept, named in (
        ({"w": LOADED, "b": LOADED}, {"w": COMPILED}, "parameter b"),
        ({"w": LOADED[:5]}, {"w": COMPILED}, "5 fields, 12 compiled"),
        ({"w": (LOADED[0], [-1, 0], *LOADED[2:])}, {"w": COMPILED}, "field 1 is [-1, 0], [0, -1] compiled"),
    ):
        with pytest.raises(UserError, match=re.escape(named)) as refused:
            completed_layouts(loaded, kept, tmp_path)
        assert "\n" not in str(refused.value) and "remove the folder or set run.compile_cache=false" in str(
            refused.value
        )


def test_a_compile_keeps_the_layouts_and_a_graph_cached_without_them_is_compiled_again(tmp_path):
    """A rank killed between MindSpore writing the graph and the cache keeping its layouts leaves a graph it
    could not complete: the next launch removes it and compiles (a miss), keeping the layouts this time."""
    cache = CompileCache(tmp_path, 0)
    graphs = tmp_path / "rank_0" / "graph_cache"
    graphs.mkdir(parents=True)
    (graphs / "MS_WORKERcompile_cache_0.mindir").write_bytes(b"a graph without its layouts")
    with cache.compiling(step_with({"w": COMPILED})) as compiled:
        assert cache.graph_file() is None
    assert compiled.cache == "miss" and json.loads((tmp_path / "rank_0" / LAYOUTS_FILE).read_text()) == {"w": COMPILED}


def test_a_loaded_step_with_an_unreadable_layouts_file_is_refused_in_one_line(tmp_path):
    cache = CompileCache(tmp_path, 0)
    graphs = tmp_path / "rank_0" / "graph_cache"
    graphs.mkdir(parents=True)
    (graphs / "MS_WORKERcompile_cache_0.mindir").write_bytes(b"a graph")
    (tmp_path / "rank_0" / LAYOUTS_FILE).write_text('{"w": [[2, 2], [0,')  # cut short
    with pytest.raises(UserError, match="parameter_layouts.json is unreadable") as refused:
        with cache.compiling(step_with()):
            pass  # nothing compiled: the graph file is untouched, a load
    assert "\n" not in str(refused.value) and "remove the folder" in str(refused.value)
