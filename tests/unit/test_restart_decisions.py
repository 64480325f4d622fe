"""The decisions behind restarts and hang detection, without processes: which rank is stalled, HCCL's
timeouts from run.hang_timeout_s, the goodput buckets, and when a save window is healthy."""

import json
import math
import os
import time

import pytest

from mindscale.launch.goodput import Attempt, describe, summarise
from mindscale.launch.hangwatch import HangWatch, find_stall
from mindscale.train.resilience.heartbeat import Heartbeat, heartbeat_file
from mindscale.launch.msrun import hccl_timeouts
from mindscale.train.resilience.health import SaveWindow


def beat(step, age, compiling=False, now=1000.0):
    return {"step": step, "time": now - age, "compiling": compiling}


def test_the_stalled_rank_is_the_one_behind_once_any_timed_rank_is_late():
    # rank 1 stopped in host code before step 4; rank 0 finished step 3 and waits in step 4's collective
    beats = {0: beat(3, age=9), 1: beat(2, age=11)}
    assert find_stall(beats, 1000.0, timeout_s=12) is None
    stall = find_stall(beats, 1000.0, timeout_s=10)
    assert (stall.ranks, stall.step, round(stall.silent_s)) == ([1], 2, 11)
    assert stall.describe().startswith("rank 1 stalled: no heartbeat for 11 s, the last one after step 2")
    # all at the same step (stuck inside one collective): every one of them is named
    assert find_stall({0: beat(5, 20), 1: beat(5, 21)}, 1000.0, 10).ranks == [0, 1]
    # a rank still compiling its first step is not timed, however long it takes
    assert find_stall({0: beat(0, 5000, compiling=True), 1: beat(0, 5000, compiling=True)}, 1000.0, 10) is None


def test_a_rank_still_compiling_behind_timed_peers_is_the_stalled_one(tmp_path):
    # rank 1 wrote only its first (compiling) beat; rank 0 finished step 1 and waits in step 2's collective
    watch = HangWatch(tmp_path, world=2, local_ranks=range(0, 2), timeout_s=10)
    peer, stuck = Heartbeat(heartbeat_file(tmp_path, 0), rank=0), Heartbeat(heartbeat_file(tmp_path, 1), rank=1)
    peer.beat(0)
    stuck.beat(0)
    assert watch.stalled(now=time.time() + 60) is None  # nobody timed: a long compile is not a hang
    peer.beat(1)
    assert watch.stalled(now=time.time() + 5) is None
    stall = watch.stalled(now=time.time() + 60)
    assert (stall.ranks, stall.step) == ([1], 0) and stall.describe().startswith("rank 1 stalled")
    # resumed at step 4: the compiling rank counts as at the step it started from
    beats = {0: beat(5, 11), 1: beat(4, 30, compiling=True), 2: beat(5, 11)}
    assert find_stall(beats, 1000.0, timeout_s=10).ranks == [1]


def test_hccl_timeouts_wait_longer_than_the_launcher():
    assert hccl_timeouts(1800) == {"HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "7200"}  # the floor
    assert hccl_timeouts(0)["HCCL_EXEC_TIMEOUT"] == "7200"
    longer = int(hccl_timeouts(9000)["HCCL_EXEC_TIMEOUT"])
    assert longer >= 9000 + 120 and longer % 68 == 0 and longer - 68 < 9000 + 120  # 910A rounds down to 68 s
    assert hccl_timeouts(10**6)["HCCL_EXEC_TIMEOUT"] == "17340"  # 910A's maximum


def test_a_heartbeat_ledger_separates_compile_steps_and_saves(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    hb = Heartbeat(heartbeat_file(tmp_path, 3), rank=3)
    hb.beat(4)  # resumed at step 4, before the first (compiling) step
    now[0] = 110.0
    hb.beat(5)  # the first step took 10 s
    now[0] = 112.0
    hb.saved(1.5)  # a save after step 6 ...
    now[0] = 112.5
    hb.beat(6)  # ... inside that step's 2.5 s
    record = json.loads(heartbeat_file(tmp_path, 3).read_text())
    assert (record["rank"], record["step"], record["compiling"], record["first_step"]) == (3, 6, False, 4)
    assert (record["first_step_s"], record["steps"], record["save_s"]) == (10.0, 1, 1.5)
    assert record["steps_s"] == pytest.approx(1.0)
    assert Heartbeat(None, 0).beat(1) is None  # outside the launcher: nothing written


def test_alive_refreshes_the_time_only(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    path = heartbeat_file(tmp_path, 0)
    watch = HangWatch(tmp_path, world=1, local_ranks=range(0, 1), timeout_s=30)
    hb = Heartbeat(path, rank=0)
    hb.alive()
    assert not path.exists()  # before the first beat: no record to refresh
    hb.beat(0)
    now[0] = 110.0
    hb.beat(1)
    before = json.loads(path.read_text())
    now[0] = 150.0
    hb.alive()  # a validation batch 40 s after the step's beat
    record = json.loads(path.read_text())
    assert record["time"] == 150.0 and {**record, "time": before["time"]} == before
    assert watch.stalled(now=170.0) is None and watch.stalled(now=181.0).ranks == [0]
    now[0] = 160.0
    hb.beat(2)  # the step's interval still counts from the beat, not from alive()
    assert json.loads(path.read_text())["steps_s"] == pytest.approx(50.0)


def ledger(first_step, step, started, first_step_s, steps_s, steps, save_s, compile_s=0.0, compile_cache="off"):
    return dict(
        first_step=first_step,
        step=step,
        started=started,
        first_step_s=first_step_s,
        steps_s=steps_s,
        steps=steps,
        save_s=save_s,
        compile_s=compile_s,
        compile_cache=compile_cache,
    )


def test_goodput_buckets_add_up_to_the_wall_time():
    # attempt 1: from step 0, killed after completing step 3, step 2 committed; attempt 2 resumes at 2
    first = Attempt(0.0, 30.0, ledger(0, 3, 5.0, 12.0, 2.0, 2, 1.0), failed=True, committed=2, cause="rank 1 died")
    second = Attempt(32.0, 60.0, ledger(2, 6, 36.0, 11.0, 3.0, 3, 0.5), failed=False, committed=6)
    s = summarise([first, second], wall_s=60.0)
    assert s["lost_steps"] == 1 and s["lost_s"] == pytest.approx(1.0)  # one step at attempt 1's mean of 1 s
    assert s["compile_s"] == pytest.approx(11.0 + 10.0) and s["startup_s"] == pytest.approx(5.0 + 4.0)
    assert s["training_s"] == pytest.approx((1 + 2 - 1) + (1 + 3))
    assert sum(v for k, v in s.items() if k.endswith("_s") and k != "wall_s") == pytest.approx(60.0)
    assert s["goodput"] == pytest.approx(s["training_s"] / 60) and s["restarts"] == ["rank 1 died"]


def test_goodput_counts_a_compile_cache_load_apart_from_a_compile():
    # attempt 1 compiles its step in 20 s (of its 25 s before the first heartbeat) and dies after step 3;
    # attempt 2 loads the step from the compile cache in 2 s; each first step waits 0.5 s more than a mean step
    first = Attempt(
        0.0, 40.0, ledger(0, 3, 25.0, 1.5, 2.0, 2, 0.0, 20.0, "miss"), failed=True, committed=2, cause="rank 1 died"
    )
    second = Attempt(41.0, 55.0, ledger(2, 6, 47.0, 1.5, 3.0, 3, 0.0, 2.0, "hit"), failed=False, committed=6)
    s = summarise([first, second], wall_s=55.0)
    assert s["compile_s"] == pytest.approx(20.5) and s["cache_load_s"] == pytest.approx(2.5)
    assert s["startup_s"] == pytest.approx(5.0 + 4.0) and s["compile_cache"] == ["miss", "hit"]
    assert sum(v for k, v in s.items() if k.endswith("_s") and k != "wall_s") == pytest.approx(55.0)
    assert "compile 20.5 s, compile cache load 2.5 s" in describe(s)


def test_a_save_window_is_unhealthy_after_a_non_finite_loss_or_a_skip_streak():
    window = SaveWindow()
    for loss, skipped in [(2.0, False), (2.1, True), (2.0, False), (1.9, True), (1.9, True)]:
        window.add(loss, skipped)
    assert window.close() == {
        "healthy": True,
        "health": {"steps": 5, "non_finite_losses": 0, "skipped_updates": 3, "longest_skip_streak": 2},
    }
    window.add(1.8, True)  # the streak of the previous window goes on: 3 in a row
    assert window.close()["healthy"] is False
    window.add(math.nan, False)
    assert window.close() == {
        "healthy": False,
        "health": {"steps": 1, "non_finite_losses": 1, "skipped_updates": 0, "longest_skip_streak": 0},
    }
    window.add(1.7, False)
    assert window.close()["healthy"] is True


def test_the_hang_watch_ignores_an_earlier_launch_and_keeps_the_last_whole_heartbeat(tmp_path):
    earlier = heartbeat_file(tmp_path, 1)
    earlier.write_text(json.dumps({"rank": 1, "step": 99, "time": 0.0, "compiling": False}))
    watch = HangWatch(tmp_path, world=2, local_ranks=range(0, 1), timeout_s=5)
    assert watch.beats() == {}  # rank 1's file predates this launch (another node's, unchanged)
    hb = Heartbeat(heartbeat_file(tmp_path, 0), rank=0)
    hb.beat(0)
    hb.beat(1)
    assert watch.beats()[0]["step"] == 1 and not watch.beats()[0]["compiling"]
    fd = os.open(heartbeat_file(tmp_path, 0), os.O_WRONLY)
    os.pwrite(fd, b'{"rank": 0, "st', 0)  # a record caught mid-rewrite
    os.close(fd)
    assert watch.beats()[0]["step"] == 1
    assert watch.stalled(now=time.time() + 4) is None
    assert watch.stalled(now=time.time() + 60).ranks == [0]


def test_a_restart_plan_drops_the_pinned_resume_step(tmp_path):
    from mindscale.launch.msrun import plan_distribute
    from mindscale.launch.restarts import for_restart
    from tests.run_folder import TINY

    plan = plan_distribute(
        str(TINY),
        "2",
        [f"run.output_dir={tmp_path}", "checkpoint.resume_step=4", "run.max_restarts=2"],
        {"PATH": os.environ["PATH"]},
    )
    again = for_restart(for_restart(plan))
    assert again.overrides.count("checkpoint.resume_step=null") == 1
    assert "checkpoint.resume_step=4" not in again.overrides and "run.max_restarts=2" in again.overrides
    assert again.max_restarts == 2 and again.notes == [] and again.log_dir == plan.log_dir
