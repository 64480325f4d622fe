"""Restarts, hang detection and healthy checkpoints with real processes: scripts/run_distribute.sh with
two CPU workers training a tiny LLaMA (on one node, or one on each of two nodes in network namespaces), faults
injected by MINDSCALE_FAULT (mindscale/train/resilience/faults.py)."""

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from mindscale.config import REPO_ROOT
from mindscale.launch.goodput import goodput_file
from mindscale.train.loop.compile_cache import SHARED_DIR_ENV
from mindscale.train.checkpoints import folder as ckpt, commit
from tests.data_folders import write_data_folder
from tests.integration import two_nodes
from tests.integration.tiny_runs import TINY, digests, losses, metrics, processes_naming, sets, train

SAVE = ("train.micro_batch_size=2", "train.steps=6", "checkpoint.save_interval=2", "checkpoint.keep_last=3")


def launch(tmp_path, name, *args, fault=None, timeout=600, own_cache=False):
    """`own_cache`: the compile cache in the run folder, as users have it, not the session's (tests/conftest.py)."""
    argv = [
        "bash",
        "scripts/run_distribute.sh",
        TINY,
        "2",
        *sets(f"run.output_dir={tmp_path}", f"run.name={name}", *SAVE),
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if k != "MINDSCALE_FAULT" and not (own_cache and k == SHARED_DIR_ENV)}
    if fault:
        env["MINDSCALE_FAULT"] = fault
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def goodput_adds_up(run_dir, node=0):
    summary = json.loads(goodput_file(run_dir, node).read_text())
    parts = [v for k, v in summary.items() if k.endswith("_s") and k != "wall_s"]
    assert sum(parts) == pytest.approx(summary["wall_s"]) and all(v >= 0 for v in parts), summary
    return summary


def two_source_blend(tmp_path) -> list[str]:
    """--set data.blend: two MindRecord folders of 7 and 5 samples of random ids, weights 3:1. With a global
    batch of 4 the 6 steps draw 18 and 6 samples: both sources wrap into a new, reshuffled epoch mid-run."""
    rng = np.random.default_rng(0)
    folders = [
        write_data_folder(tmp_path / f"source_{k}", rng.integers(3, 256, (n, 33)), 256) for k, n in enumerate((7, 5))
    ]
    return ["--set", f"data.blend=[{{path: {folders[0]}, weight: 3}}, {{path: {folders[1]}, weight: 1}}]"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One run never interrupted, which the restart tests end equal to: two workers on one node, the
    compile cache in its run folder, reading two_source_blend. Returns (its folder, the blend's --set)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    blend = two_source_blend(root)
    straight = launch(root, "straight", *blend, own_cache=True)
    assert straight.returncode == 0, straight.stderr[-2000:]
    return root / "straight", blend


def test_a_killed_rank_is_restarted_and_the_run_ends_with_uninterrupted_weights(tmp_path, uninterrupted):
    """Rank 1 SIGKILLs itself before step 4 (step 2 committed, step 3 done): --max-restarts 1 relaunches
    both workers from step 2, and the final weights equal those of a run never killed. Both runs read a
    blend of two sources, so the restart resumes mid-epoch of each: it reuses the sample index and reads
    from step 2's position. The restart loads the train step from the compile cache the first attempt left
    in the run folder (run.compile_cache), and its losses are bit-identical to the uninterrupted run's,
    which compiled."""
    straight, blend = uninterrupted
    restarted = launch(tmp_path, "restarted", "--max-restarts", "1", *blend, fault="kill:1:4", own_cache=True)
    assert restarted.returncode == 0, restarted.stdout[-2000:] + restarted.stderr[-2000:]
    run = tmp_path / "restarted"
    headers = [line for line in restarted.stdout.splitlines() if line.startswith("data: blend of")]
    assert len(headers) == 2 and f"index reused {run / 'index'}" in headers[1]
    assert "(18 samples of 7, 2.57 epochs)" in headers[0] and "(6 samples of 5, 1.20 epochs)" in headers[0]
    builds = [
        sum(log.read_text().count("data index (train): ") for log in logs.glob("worker_*.log"))
        for logs in (run / "logs" / "attempt_1", run / "logs")
    ]
    assert builds == [1, 0]  # one rank of the first attempt built the index; the restart built none
    assert [r["data_tokens"] for r in metrics(run) if r["step"] == 6] == [
        {str(straight.parent / "source_0"): 18 * 32, str(straight.parent / "source_1"): 6 * 32}
    ]
    assert all(r["data_wait_s"] >= 0 for r in metrics(run))
    kept = run / "logs" / "attempt_1" / "worker_1.log"
    assert (
        f"MindScale: restart 1 of 1: rank 1 was killed by SIGKILL (its log: {kept}); relaunching every worker "
        "from committed step 2"
    ) in restarted.stdout
    assert "fault: rank 1 kills itself before step 4" in kept.read_text()
    assert "resumed from" in restarted.stdout and "step_00000002 at step 2" in restarted.stdout
    assert digests(run / "logs") == digests(straight / "logs")
    assert len(digests(run / "logs")) == 1
    assert losses(run) == losses(straight)  # the restart's steps 3-6 overwrite the lost step 3
    summary = goodput_adds_up(run)
    assert summary["lost_steps"] == 1 and summary["restarts"] == ["rank 1 was killed by SIGKILL"]
    assert summary["compile_cache"] == ["miss", "hit"] and summary["cache_load_s"] > 0
    assert restarted.stdout.count("(compile cache miss)") == restarted.stdout.count("(compile cache hit)") == 1
    for rank in (0, 1):  # each rank loaded its own cache of the step, which the restart left as it was
        cached = list((run / "compile_cache").glob(f"*/rank_{rank}/graph_cache/*compile_cache_0.mindir"))
        assert len(cached) == 1 and cached[0].stat().st_mtime < kept.stat().st_mtime
    assert re.search(
        r"^MindScale goodput: \d+% of .* lost 1 step\(s\) .* 1 restart\(s\): rank 1 was killed by SIGKILL$",
        restarted.stdout,
        re.M,
    )
    straight_summary = goodput_adds_up(straight)
    assert straight_summary["restarts"] == [] and straight_summary["compile_cache"] == ["miss"]


def test_two_nodes_restart_together_after_a_kill_and_a_hang(tmp_path, two_namespaces, uninterrupted):
    """Two nodes of one worker each (tests/integration/two_nodes.py), --max-restarts 2: rank 1, on node 1,
    SIGKILLs itself before step 4, then rank 0, on node 0, hangs before step 6 (run.hang_timeout_s). Each
    failure stops both nodes' workers and both relaunch from the newest committed step (2, then 4) on a
    scheduler port node 0 chose; the end weights equal those of the uninterrupted run (one node, same world
    of two, same data). Each node's goodput file has every attempt's lost and restart time."""
    straight, blend = uninterrupted
    hang_timeout = 12  # generous: a loaded host stretches the steps and the teardown
    args = [TINY, "1", *sets(f"run.output_dir={tmp_path}", "run.name=two", *SAVE), *blend]
    args += ["--set", f"run.hang_timeout_s={hang_timeout}", "--max-restarts", "2"]
    base = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base.update(MINDSCALE_FAULT="kill:1:4,hang:0:6", MINDSCALE_NODE_TIMEOUT="60")
    nodes = two_nodes.start(tmp_path, two_namespaces, args, lambda rank: {**base, "NODE_RANK": str(rank)}, REPO_ROOT)
    ended = two_nodes.wait(nodes, timeout=600)
    said = [
        [line for line in text.splitlines() if line.startswith(("MindScale", "error", "fault"))] for _, text, _ in ended
    ]
    assert [code for code, _, _ in ended] == [0, 0], said
    run = tmp_path / "two"
    for node, (_, text, _) in enumerate(ended):
        restarts = [line for line in text.splitlines() if line.startswith("MindScale: restart ")]
        assert len(restarts) == 2, text[-3000:]
        assert re.match(r"MindScale: restart 1 of 2: (node 1: )?rank 1 was killed by SIGKILL ", restarts[0])
        assert re.match(r"MindScale: restart 2 of 2: (node 0: )?rank 0 stalled: ", restarts[1])
        assert restarts[0].endswith("relaunching every worker on 2 nodes from committed step 2")
        assert restarts[1].endswith("relaunching every worker on 2 nodes from committed step 4")
        summary = goodput_adds_up(run, node)
        assert [a["cause"] is None for a in summary["attempts"]] == [False, False, True], summary
        assert all(a["restart_s"] > 0 for a in summary["attempts"][:2]), summary
        print(f"node {node}: back to training", [round(a["restart_s"], 1) for a in summary["attempts"][:2]], "s")
    assert digests(run / "logs") == digests(straight / "logs")
    assert losses(run) == losses(straight)
    assert processes_naming(str(run)) == []


def test_after_a_restart_sigterm_still_stops_the_job_gracefully(tmp_path):
    """The launcher's signal handlers outlive a restart's teardown: rank 1 dies before step 4, the job
    restarts, and a SIGTERM to the launcher during the second attempt stops every worker after one step,
    committed, exit 0, naming the checkpoint (it used to be ignored from the first teardown on)."""
    argv = [
        "bash",
        "scripts/run_distribute.sh",
        TINY,
        "2",
        *sets(f"run.output_dir={tmp_path}", "run.name=run", *SAVE, "train.steps=100000"),
        "--max-restarts",
        "1",
    ]
    with open(tmp_path / "stderr", "w") as err:
        job = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "MINDSCALE_FAULT": "kill:1:4"},
        )
        try:
            lines = []
            while not lines or "resumed from" not in lines[-1]:  # the second attempt's rank 0 is training
                lines.append(job.stdout.readline())
                assert lines[-1], "".join(lines)[-2000:] + (tmp_path / "stderr").read_text()[-2000:]
            assert any(line.startswith("MindScale: restart 1 of 1: rank 1 was killed by SIGKILL") for line in lines)
            job.send_signal(signal.SIGTERM)
            out, _ = job.communicate(timeout=120)
        finally:
            job.kill()
    assert job.returncode == 0, out[-2000:] + (tmp_path / "stderr").read_text()[-2000:]
    root = tmp_path / "run" / "checkpoints"
    stop = commit.committed_steps(root)[-1]
    assert stop > 2 and f"stopping after step {stop} of 100000" in out
    assert out.splitlines()[-1].startswith(
        f"MindScale: all 2 worker(s) on this node stopped on SIGTERM; newest "
        f"committed checkpoint: {root / ckpt.step_dir_name(stop)}; logs in "
    )
    assert processes_naming(str(tmp_path / "run")) == []


def test_restarts_give_up_after_max_restarts_naming_the_cause(tmp_path):
    """Rank 1 dies before step 4, and after the restart before step 6: with run.max_restarts=1 the job gives
    up, exit 1, naming the last cause; each attempt lost the one step after its last save."""
    out = launch(tmp_path, "gives_up", "--set", "run.max_restarts=1", fault="kill:1:4,kill:1:6")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    log = tmp_path / "gives_up" / "logs" / "worker_1.log"
    assert out.stderr.splitlines()[-1] == (
        f"error: rank 1 was killed by SIGKILL; gave up after 1 restart(s) (run.max_restarts=1); see {log}"
    )
    assert out.stdout.count("MindScale: restart ") == 1
    assert commit.committed_steps(tmp_path / "gives_up" / "checkpoints")[-1] == 4
    summary = goodput_adds_up(tmp_path / "gives_up")
    assert summary["lost_steps"] == 2 and len(summary["restarts"]) == 1


def test_a_health_guard_stop_is_not_restarted(tmp_path):
    """fp16 with a loss scale that overflows every step: the health guard stops both ranks after step 3,
    exit 1; --max-restarts 1 does not replay the divergence, and the last line names the guard's cause."""
    out = launch(
        tmp_path,
        "diverged",
        "--max-restarts",
        "1",
        "--set",
        "model.compute_dtype=float16",
        "--set",
        "train.loss_scale=1.0e+30",
        "--set",
        "train.max_skipped_steps=3",
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "MindScale: restart " not in out.stdout
    assert re.fullmatch(
        r"error: rank \d stopped by a health guard, not restarted: step 3: 3 steps in a row skipped "
        r"for non-finite gradients or loss spikes \(train.max_skipped_steps=3.*; see \S+worker_\d.log",
        out.stderr.splitlines()[-1],
    ), out.stderr[-2000:]


def test_a_stalled_rank_is_named_and_its_stacks_are_in_its_log(tmp_path):
    """Rank 1 sleeps before step 3: within run.hang_timeout_s + 10 s the launcher names it (rank 0, waiting
    in step 3's all-reduce, is a step ahead), dumps its stacks into its log, and nothing is left running."""
    timeout = 8
    out = launch(tmp_path, "stalled", "--set", f"run.hang_timeout_s={timeout}", fault="hang:1:3")
    returned = time.time()
    run = tmp_path / "stalled"
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    log = run / "logs" / "worker_1.log"
    assert re.fullmatch(
        rf"error: rank 1 stalled: no heartbeat for \d+ s, the last one after step 1 "
        rf"\(run.hang_timeout_s={timeout}\); its Python stacks are in {re.escape(str(log))}",
        out.stderr.splitlines()[-1],
    ), out.stderr[-2000:]
    hung = (run / ".fault-hang-1-3").stat().st_mtime  # written as the rank began to sleep
    assert returned - hung < timeout + 10, f"named {returned - hung:.1f} s after the hang began"
    dump = log.read_text().split("fault: rank 1 hangs before step 3", 1)[1]
    assert "most recent call first" in dump and "in before_step" in dump and "in train" in dump
    assert processes_naming(str(run)) == []


def test_resume_prefers_the_newest_healthy_checkpoint(tmp_path):
    """Steps 2 and 4 are healthy; steps 5-8 run in fp16 with a loss scale that overflows every step, so
    the save at 8 is unhealthy (4 skipped updates in a row). A resume passes over it on one line and takes
    step 4; checkpoint.resume_step=8 still takes 8."""
    common = ("checkpoint.save_interval=4", "checkpoint.keep_last=3")
    train(tmp_path, "run", "train.steps=4", "checkpoint.save_interval=2", "checkpoint.keep_last=3")
    train(
        tmp_path,
        "run",
        "train.steps=8",
        "model.compute_dtype=float16",
        "train.loss_scale=1.0e+30",
        "train.max_skipped_steps=0",
        *common,
    )
    root = tmp_path / "run" / "checkpoints"
    assert commit.committed_steps(root) == [2, 4, 8]
    state = json.loads((root / "step_00000008" / "state.json").read_text())
    assert state["healthy"] is False and state["health"]["longest_skip_streak"] == 4
    assert json.loads((root / "step_00000004" / "state.json").read_text())["healthy"] is True

    exact = train(tmp_path, "run", "train.steps=8", "checkpoint.resume_step=8", *common)
    assert "step_00000008 at step 8" in exact.stdout and "unhealthy" not in exact.stdout
    resumed = train(tmp_path, "run", "train.steps=10", *common)
    lines = [line for line in resumed.stdout.splitlines() if "unhealthy" in line]
    assert lines == [
        "checkpoint: passing over unhealthy step 8 (0 non-finite loss(es), 4 update(s) in a row skipped "
        "in the 4 steps before it); resuming from healthy step 4; the later steps leave the run's "
        "history (their folders are removed at the next save)"
    ], resumed.stdout
    assert "step_00000004 at step 4" in resumed.stdout
    assert commit.committed_steps(root) == [4, 8, 10]  # the unhealthy 8 left the history; 8 saved anew
    assert json.loads((root / "step_00000008" / "state.json").read_text())["healthy"] is True
