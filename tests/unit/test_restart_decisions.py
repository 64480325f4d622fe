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
from mindscale.launch.nodesync import NodeLost, NodeSync, Report, decide
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
    # per attempt: attempt 2's first step ended at 36 + 11 = 47 s, 17 s after attempt 1 ended
    assert s["attempts"] == [
        {"cause": "rank 1 died", "seconds": 30.0, "lost_steps": 1, "lost_s": pytest.approx(1.0), "restart_s": 17.0},
        {"cause": None, "seconds": 28.0, "lost_steps": 0, "lost_s": 0.0, "restart_s": None},
    ]


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
    again = for_restart(for_restart(plan, 29600), 29601)
    assert again.master_port == 29601
    assert again.overrides.count("checkpoint.resume_step=null") == 1
    assert "checkpoint.resume_step=4" not in again.overrides and "run.max_restarts=2" in again.overrides
    assert again.max_restarts == 2 and again.notes == [] and again.log_dir == plan.log_dir


class Clock:
    """A clock the tests move by hand; sleeping moves it too."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def two_launchers(tmp_path, timeout_s=10):
    clock = Clock()
    return clock, [NodeSync(tmp_path, 2, k, timeout_s, clock=clock, sleep=clock.sleep) for k in (0, 1)]


def bump(sync):
    """A beat whose mtime surely differs from the previous one (file systems keep coarse times)."""
    path = sync.alive_file(sync.node)
    path.touch()
    stamp = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(stamp, stamp))


def test_nodes_join_on_fresh_beats_only_and_a_silent_node_is_named(tmp_path):
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "node_1.alive").touch()  # left by an earlier job: not a sign of node 1
    clock, (n0, n1) = two_launchers(tmp_path)
    assert n0.join(timeout_s=3) == [1]
    bump(n1)
    assert n0.join(timeout_s=3) == [] and n0.silent_peer() is None
    clock.now += 10.5
    assert n0.silent_peer() == 1  # seen beating, then silent past the timeout
    bump(n1)
    assert n0.silent_peer() is None
    n1.report(Report(1, restart=False, failed=False, cause=None))  # node 1's workers finished: it exits
    clock.now += 30
    assert n0.silent_peer() is None


def test_nodes_restart_together_only_when_every_node_wants_it(tmp_path):
    clock, (n0, n1) = two_launchers(tmp_path)
    (tmp_path / "nodes" / "gen_0").mkdir()
    (tmp_path / "nodes" / "gen_0" / "node_0.json").write_text("{}")  # unreadable: not a report
    assert n1.failed_peer() is None
    n1.report(Report(1, restart=True, failed=True, cause="rank 1 was killed by SIGKILL"))
    assert n0.failed_peer().cause == "rank 1 was killed by SIGKILL"  # node 0 stops its workers on it
    n0.report(Report(0, restart=True, failed=True, cause="node 1: rank 1 was killed by SIGKILL", port=29600))
    assert decide(n1.gather()) == (True, n0.reports()[0])  # node 0's report carries the next port
    n0.generation = n1.generation = 1
    assert n0.failed_peer() is None  # generation 0's reports are done with
    n1.report(Report(1, restart=False, failed=True, cause="rank 1 exited with code 2"))
    n0.report(Report(0, restart=True, failed=True, cause="node 1: rank 1 exited with code 2", port=29601))
    assert decide(n0.gather()) == (False, n1.reports()[1])


def test_a_node_that_does_not_report_ends_the_job_naming_it(tmp_path):
    clock, (n0, n1) = two_launchers(tmp_path, timeout_s=5)
    n0.report(Report(0, restart=True, failed=True, cause="rank 0 stalled", port=29600))
    with pytest.raises(NodeLost, match=r"^node 1 did not come back within 5 s of the restart"):
        n0.gather()
    assert clock.now == pytest.approx(5.5)
    # a relaunched job in the same run folder drops this node's reports of the earlier one
    NodeSync(tmp_path, 2, 0, 5)
    assert n1.reports() == {}


def test_agree_reports_and_ends_the_job_with_the_refusing_nodes_cause(tmp_path):
    from mindscale.launch.restarts import Ended, agree

    clock, (n0, n1) = two_launchers(tmp_path, timeout_s=5)
    n1.report(Report(1, restart=False, failed=False, cause=None))  # node 1's workers finished
    ended, port = agree(n0, Ended(1, "rank 0 was killed by SIGKILL", restartable=True), again=True)
    assert port is None and (ended.code, ended.restartable) == (1, False)
    assert ended.cause == "rank 0 was killed by SIGKILL; not restarted: node 1 finished"
    assert n0.reports()[0].port is not None  # node 0 offered the next generation's port
    ended, port = agree(n1, Ended(1, "node 0: x", restartable=True), again=True)  # node 0 did not refuse
    assert port == n0.reports()[0].port
    n0.generation = n1.generation = 1
    n0.report(Report(0, restart=False, failed=True, cause="rank 0 exited with code 2"))  # bad input: not retried
    ended, port = agree(n1, Ended(1, "node 0: rank 0 exited with code 2", restartable=True), again=True)
    assert port is None and ended.cause == "node 0: rank 0 exited with code 2 (not restarted there)"
