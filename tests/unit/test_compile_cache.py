"""The compile cache's key (mindscale/train/loop/compile_cache.py): what changes it and what does not."""
from mindscale.config import REPO_ROOT, load_config
from mindscale.train.loop.compile_cache import cache_key, sources_digest

TINY = str(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml")


def key(*overrides, device="CPU", version="2.9.0", sources="s"):
    return cache_key(load_config(TINY, list(overrides)), device, version, sources)


def test_the_key_changes_with_the_graph_config_device_version_and_sources():
    base = key()
    changed = [key("model.hidden_size=256"), key("train.steps=300"), key("parallel.gradient_accumulation_steps=2"),
               key("run.seed=1"), key(device="Ascend"), key(version="2.9.1"), key(sources="t")]
    assert base not in changed and len(set(changed)) == len(changed)


def test_the_key_ignores_the_run_name_folders_logging_and_checkpoints():
    # a --max-restarts restart adds checkpoint.resume_step=null and keeps run.max_restarts: the same key
    assert key("run.name=other", "run.output_dir=/elsewhere", "run.max_restarts=3", "run.hang_timeout_s=60",
               "train.log_interval=1", "checkpoint.save_interval=2", "checkpoint.resume_step=null",
               "profile.enable=true", "run.compile_cache=false") == key()


def test_the_sources_digest_sees_an_edit_of_a_model_file(tmp_path):
    for package in ("mindscale", "models"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "a.py").write_text("x = 1\n")
    before = sources_digest(tmp_path)
    (tmp_path / "models" / "a.py").write_text("x = 2\n")
    assert sources_digest(tmp_path) != before
