"""The launch scripts, run for real: msrun with CPU workers running tests/fixtures/allreduce_probe.py.

Fast tests check the decisions (worker counts, data_parallel, node ranks, quoting, bad input) via
--dry-run. Slow tests start msrun: two workers AllReduce; one worker runs the entry point once; a
worker that exits 1 or is SIGKILLed stops the job within seconds and is named; two "nodes" in two
network namespaces form one job.
"""

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from mindscale.launch.msrun import assign_cores
from tests.integration import two_nodes

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests/fixtures/allreduce_probe.py"
LAUNCH_TIMEOUT = 120
NODE_TIMEOUT = 8  # MINDSCALE_NODE_TIMEOUT of the restartable two-node jobs


def write_config(tmp_path, name="probe", **parallel):
    lines = [
        f"base: {ROOT / 'configs/tiny/llama_tiny.yaml'}",
        f"run: {{name: {name}, output_dir: {tmp_path / 'out'}, device_target: CPU}}",
    ]
    if parallel:
        lines.append("parallel: {" + ", ".join(f"{k}: {v}" for k, v in parallel.items()) + "}")
    path = tmp_path / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("MINDSCALE_")
    }
    env["MINDSCALE_ENTRY"] = PROBE
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(script, *args, cwd, env=None, timeout=60):
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *map(str, args)],
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def msrun_call(dry_run_line):
    """Split a dry-run line `env K=V ... msrun --flag v ... python -m mindscale.launch worker ENTRY ARGS`
    into (env, msrun flags, entry args)."""
    argv = shlex.split(dry_run_line)
    at = argv.index("msrun")
    env = dict(a.split("=", 1) for a in argv[1:at])
    worker = argv.index("worker")
    flags = dict(zip(argv[at + 1 : worker - 3 : 2], argv[at + 2 : worker - 3 : 2]))
    return env, flags, argv[worker + 1 :]


def probe_lines(text):
    return {
        d["rank"]: d
        for d in (json.loads(line.split("PROBE ", 1)[1]) for line in text.splitlines() if line.startswith("PROBE "))
    }


def probe_results(log_dir):
    return probe_lines("\n".join(p.read_text() for p in sorted(Path(log_dir).glob("worker_*.log"))))


def leftover_processes(marker):
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in (p.info["cmdline"] or [])):
            found.append(p.pid)
    return found


# ----------------------------------------------------------------------------------------------
# Decisions, without starting anything


def test_one_core_per_cpu_worker():
    assert assign_cores([0, 1], 2) == [0, 1]
    assert assign_cores([4, 5, 6, 7], 2) == [4, 5]
    assert assign_cores([0, 1], 3) == [0, 1, 0]
    # node 1's first rank is 1 (one worker a node) or 2: two nodes on one host take different cores
    assert assign_cores([0, 1], 1, first_rank=1) == [1]
    assert assign_cores([4, 5, 6, 7], 2, first_rank=2) == [6, 7]
    assert assign_cores([0, 1, 2], 2, first_rank=2) == [2, 0]


def test_dry_run_defaults_to_two_cpu_workers_and_fits_data_parallel(tmp_path):
    cfg = write_config(tmp_path, data_parallel=1)
    default = run_script("run_distribute.sh", cfg, "--dry-run", cwd=tmp_path)
    assert default.returncode == 0, default.stderr
    env, flags, entry = msrun_call(default.stdout)
    assert (flags["--worker_num"], flags["--local_worker_num"], flags["--node_rank"]) == ("2", "2", "0")
    assert flags["--log_dir"] == str(tmp_path / "out/probe/logs") and flags["--join"] == "True"
    assert "--bind_core" not in flags and env["MINDSCALE_WORKER_CORES"].count(",") == 1
    assert entry == [str(ROOT / PROBE), "--config", str(cfg)]  # not given NUM_DEVICES: config untouched

    given = run_script("run_distribute.sh", cfg, 4, "--set", "train.steps=3", "--dry-run", cwd=tmp_path)
    assert given.returncode == 0, given.stderr
    _, flags, entry = msrun_call(given.stdout)
    assert flags["--worker_num"] == "4"
    assert entry[-4:] == ["--set", "train.steps=3", "--set", "parallel.data_parallel=4"]
    assert "parallel.data_parallel=4" in given.stderr  # said out loud


def test_dry_run_multi_node_world_and_ranks(tmp_path):
    cfg = write_config(tmp_path)
    out = run_script(
        "run_distribute.sh",
        cfg,
        2,
        "--dry-run",
        cwd=tmp_path,
        env=clean_env(NNODES=3, NODE_RANK=2, MASTER_ADDR="10.0.0.1", MASTER_PORT=29500),
    )
    assert out.returncode == 0, out.stderr
    _, flags, entry = msrun_call(out.stdout)
    assert flags == {
        **flags,
        "--worker_num": "6",
        "--local_worker_num": "2",
        "--node_rank": "2",
        "--master_addr": "10.0.0.1",
        "--master_port": "29500",
        "--tail_worker_log": "4",
    }
    assert entry[-2:] == ["--set", "parallel.data_parallel=6"]
    # 8 pipeline stages over 4 nodes of 32: the step lines come from rank 112, first of the last stage, whose
    # node's console follows its log beside its own first rank's
    staged = run_script(
        "run_distribute.sh",
        ROOT / "configs/llama2/llama2_70b.yaml",
        32,
        "--set",
        "run.device_target=Ascend",
        "--dry-run",
        cwd=tmp_path,
        env=clean_env(NNODES=4, NODE_RANK=3, MASTER_ADDR="10.0.0.1"),
    )
    assert staged.returncode == 0, staged.stderr
    assert msrun_call(staged.stdout)[1]["--tail_worker_log"] == "96,112"


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["missing.yaml"], {}, "missing.yaml does not exist"),
        (["CFG", "0"], {}, "NUM_DEVICES='0': must be a positive integer"),
        (["CFG", "two"], {}, "NUM_DEVICES='two': must be a positive integer"),
        (["CFG", "3"], {}, "3 device(s) cannot hold parallel.model_parallel=2"),
        (["CFG", "2", "extra"], {}, "unrecognized arguments: extra"),
        (["CFG"], {"NNODES": "2"}, "NNODES=2 needs MASTER_ADDR"),
        (
            ["CFG"],
            {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"},
            "NODE_RANK='2': must be an integer in [0, NNODES=2)",
        ),
        (["CFG"], {"MINDSCALE_ENTRY": "nope.py"}, "MINDSCALE_ENTRY=nope.py: no such file"),
        (["CFG", "--set", "train.stepz=3"], {}, "unknown key train.stepz"),
        (
            ["CFG", "--max-restarts", "1"],
            {"NNODES": "2", "MASTER_ADDR": "h", "MINDSCALE_NODE_TIMEOUT": "0"},
            "MINDSCALE_NODE_TIMEOUT='0': must be a positive integer (seconds)",
        ),
        (
            ["CFG", "--max-restarts", "1", "--set", "checkpoint.resume=false"],
            {},
            "run.max_restarts=1 needs checkpoint.resume=true",
        ),
        # what every worker would refuse is refused before msrun starts them (it used to start them all)
        (
            ["CFG", "2"],
            {},
            "error: parallel.model_parallel=2 needs Ascend or GPU: MindSpore has no semi-auto parallel "
            "on CPU; on CPU set parallel.model_parallel=1\n",
        ),
        (
            ["CFG", "2", "--set", "parallel.model_parallel=1", "--set", "parallel.optimizer_shard=true"],
            {},
            "error: parallel.optimizer_shard=true needs Ascend or GPU",
        ),
        (
            ["CFG", "2", "--set", "parallel.model_parallel=1", "--set", "hardware=ascend910b"],
            {},
            "error: hardware='ascend910b' describes Ascend but this host runs on CPU; add --set hardware=cpu",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, env, message):
    cfg = write_config(tmp_path, data_parallel=1, model_parallel=2)
    out = run_script(
        "run_distribute.sh",
        *[str(cfg) if a == "CFG" else a for a in args],
        "--dry-run",
        cwd=tmp_path,
        env=clean_env(**env),
    )
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


def test_restarts_across_nodes_refuse_a_run_folder_no_other_node_writes(tmp_path):
    """--max-restarts with NNODES=2 and no node 1 beating in the run folder (not shared, or never started):
    refused in one line naming the folder, exit 2, after msrun's cluster timeout and before msrun starts."""
    cfg = write_config(tmp_path, name="alone")
    env = clean_env(NNODES=2, NODE_RANK=0, MASTER_ADDR="127.0.0.1", MINDSCALE_CLUSTER_TIMEOUT=2)
    out = run_script("run_distribute.sh", cfg, "1", "--max-restarts", "1", cwd=tmp_path, env=env)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"error: run.max_restarts=1 with NNODES=2: no sign of node 1's launcher in {tmp_path / 'out/alone/logs/nodes'} "
        "within 2 s; put run.output_dir on a file system every node shares (and start every node), or set "
        "run.max_restarts=0"
    ], out.stderr
    assert "MindScale: " not in out.stdout and not (tmp_path / "out/alone/logs/msrun_node_0.log").exists()


def test_hostfile_dry_run_commands_run_as_written(tmp_path):
    cfg = write_config(tmp_path, data_parallel=1)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the first host is node 0\nnode-a   # master\n\n  node-b\n")
    out = run_script(
        "run_hostfile.sh", hostfile, cfg, 1, "--set", "train.lr=1e-3", "--set", "run.seed=7", "--dry-run", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        ssh = shlex.split(line)
        assert ssh[:5] == ["ssh", "-n", "-o", "BatchMode=yes", ["node-a", "node-b"][rank]]
        # What ssh would run on that host, run here (with --dry-run) to check rank, master and quoting.
        remote = subprocess.run(
            ["bash", "-c", ssh[5] + " --dry-run"], cwd="/", env=clean_env(), capture_output=True, text=True, timeout=60
        )
        assert remote.returncode == 0, remote.stderr
        _, flags, entry = msrun_call(remote.stdout)
        assert (flags["--node_rank"], flags["--master_addr"], flags["--master_port"]) == (str(rank), "node-a", "8118")
        assert flags["--worker_num"] == "2" and flags["--local_worker_num"] == "1"
        assert entry[-6:] == ["--set", "train.lr=1e-3", "--set", "run.seed=7", "--set", "parallel.data_parallel=2"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("# nobody\n\n", "lists no hosts"),
        ("node-a slots=8\n", "has more than a host name"),
        # msrun on a host that is MASTER_ADDR starts a scheduler: twice, two schedulers, and MindSpore's
        # "Failed to initialize distributed job cluster"
        (
            "localhost\n# again\nlocalhost\n",
            "hostfile HOSTS lists localhost twice (nodes 0 and 1): a host runs one "
            "node; list it once and give its worker count as NUM_DEVICES",
        ),
    ],
)
def test_hostfile_bad_input(tmp_path, content, message):
    hostfile = tmp_path / "hosts"
    if content is not None:
        hostfile.write_text(content)
    out = run_script("run_hostfile.sh", hostfile, write_config(tmp_path), "--dry-run", cwd=tmp_path)
    message = message.replace("HOSTS", str(hostfile))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and message in out.stderr, out.stderr
    assert out.stdout == ""


def test_slurm_script_gives_each_node_its_rank(tmp_path):
    """Slurm cannot run here: stand-in `scontrol` and `srun` (one task per node, in turn) check the
    script's own logic -- master from the node list, NODE_RANK read inside each task."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && tr , "\\n" <<< "$3"\n')
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n'
        'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit; done\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="gpu-07,gpu-08",
        SLURM_NNODES=2,
        SLURM_JOB_ID=1234,
        SLURM_SUBMIT_DIR=ROOT,
    )
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm_train.sbatch"), str(write_config(tmp_path)), "1", "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    calls = [msrun_call(line)[1] for line in out.stdout.splitlines()]
    assert [c["--node_rank"] for c in calls] == ["0", "1"]
    assert {(c["--master_addr"], c["--master_port"], c["--worker_num"]) for c in calls} == {("gpu-07", "21234", "2")}


# ----------------------------------------------------------------------------------------------
# Real launches


def test_standalone_runs_one_pinned_device(tmp_path):
    env = clean_env()
    env.pop("GLOG_v", None)  # MindSpore's warnings (tests/conftest.py quiets them for the whole session)
    out = run_script("run_standalone.sh", write_config(tmp_path, data_parallel=2), cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    (result,) = probe_lines(out.stdout).values()
    assert (result["world"], result["data_parallel"], result["omp_num_threads"]) == (1, 1, "1")
    assert len(result["cores"]) == 1
    assert result["glog_v"] == "3"  # errors only, as under msrun: no "side effect nodes" warning on every run


def test_two_workers_allreduce_on_their_own_cores(tmp_path):
    cfg = write_config(tmp_path, data_parallel=1)
    log_dir = tmp_path / "out/probe/logs"
    log_dir.mkdir(parents=True)
    (log_dir / "worker_1.exit").write_text("1\n")  # left by an earlier, failed launch
    out = run_script("run_distribute.sh", cfg, 2, cwd=tmp_path, timeout=LAUNCH_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"logs in {log_dir}" in out.stdout
    results = probe_results(log_dir)
    assert sorted(results) == [0, 1]
    for r in results.values():
        assert (r["world"], r["allreduce_sum"], r["data_parallel"], r["omp_num_threads"]) == (2, 3.0, 2, "1")
        assert len(r["cores"]) == 1
    if len(os.sched_getaffinity(0)) > 1:
        assert results[0]["cores"] != results[1]["cores"]
    assert 0 in probe_lines(out.stdout)  # rank 0's log is followed on the console
    # msrun's own lines (each process's start with its whole command line) and MindSpore's INFO chatter
    # at exit ("Event base dispatch success!") stay in the logs, off the console
    console = out.stdout + out.stderr
    assert "Execute command" not in console and "[INFO]" not in console, console
    kept = (log_dir / "msrun_node_0.log").read_text()
    assert kept.count("Execute command: python -m mindscale.launch worker") == 3  # scheduler and two workers
    assert "[INFO] DISTRIBUTED" in (log_dir / "worker_0.log").read_text()
    assert f"(msrun's output: msrun_node_0.log); following the rank 0 log {log_dir / 'worker_0.log'}\n" in out.stdout


def test_one_worker_runs_the_entry_point_once(tmp_path):
    """msrun starts its scheduler with the entry point's command line; init() is where that process serves
    the workers until they end, then exits. The runtime called init() only for several workers, so with
    one the scheduler ran a second copy of the job beside the worker (a second training into the same run
    folder, sharing its core)."""
    cfg = write_config(tmp_path, name="one")
    out = run_script("run_distribute.sh", cfg, 1, cwd=tmp_path, timeout=LAUNCH_TIMEOUT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log_dir = tmp_path / "out/one/logs"
    results = probe_results(log_dir)
    assert list(results) == [0] and (results[0]["world"], results[0]["allreduce_sum"]) == (1, 1.0)
    assert (log_dir / "scheduler.exit").read_text() == "0\n"
    assert "PROBE" not in (log_dir / "scheduler.log").read_text()
    assert list(probe_lines(out.stdout)) == [0]


@pytest.mark.parametrize("how, said", [("exit", "exited with code 1"), ("kill", "was killed by SIGKILL")])
def test_a_dead_worker_stops_the_job_and_is_named(tmp_path, how, said):
    cfg = write_config(tmp_path, name=f"fail_{how}")
    out = run_script(
        "run_distribute.sh", cfg, 2, cwd=tmp_path, env=clean_env(PROBE_FAIL=f"1:{how}"), timeout=LAUNCH_TIMEOUT
    )
    returned = time.time()
    log_dir = tmp_path / f"out/fail_{how}/logs"
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == f"error: rank 1 {said}; see {log_dir / 'worker_1.log'}"
    died = (log_dir / "worker_1.exit").stat().st_mtime
    assert returned - died < 5, f"the launcher took {returned - died:.1f} s to notice"
    assert leftover_processes(str(cfg)) == []  # rank 0 (blocked in AllReduce) and the scheduler are gone


# ----------------------------------------------------------------------------------------------
# Two nodes on one machine: a network namespace per node


def launch_two_nodes(tmp_path, namespaces, cfg, **extra_env):
    """Both nodes of a probe job (tests/integration/two_nodes.py), NUM_DEVICES=1 each."""
    nodes = two_nodes.start(tmp_path, namespaces, [str(cfg), "1"], lambda rank: clean_env(NODE_RANK=rank, **extra_env))
    return two_nodes.wait(nodes, LAUNCH_TIMEOUT)


def test_two_nodes_in_network_namespaces_form_one_job(tmp_path, two_namespaces):
    cfg = write_config(tmp_path, name="two_nodes", data_parallel=1)
    log_dir = tmp_path / "out/two_nodes/logs"
    log_dir.mkdir(parents=True)
    (log_dir / "worker_1.exit").write_text("-9\n")  # stale: node 0 must not take it for node 1's failure
    nodes = launch_two_nodes(tmp_path, two_namespaces, cfg)
    assert [code for code, _, _ in nodes] == [0, 0], [text[-2000:] for _, text, _ in nodes]
    started = [(log_dir / f"msrun_node_{rank}.log").read_text() for rank in (0, 1)]
    assert ["Start scheduler" in text for text in started] == [True, False]  # one scheduler, on node 0
    # each node's console tails its own first worker (msrun numbers workers by global rank)
    assert ['"rank": 0' in text for _, text, _ in nodes] == [True, False]
    assert ['"rank": 1' in text for _, text, _ in nodes] == [False, True]
    # node 1 has no step lines to show (rank 0 prints them) and says where they are
    assert ["the step lines are in the rank 0 log, on node 0's console" in text for _, text, _ in nodes] == [
        False,
        True,
    ]
    results = probe_results(log_dir)
    assert sorted(results) == [0, 1]
    assert {(r["world"], r["allreduce_sum"], r["data_parallel"]) for r in results.values()} == {(2, 3.0, 2)}
    if len(os.sched_getaffinity(0)) > 1:  # both launchers on this host: node 1 starts at the next core
        assert results[0]["cores"] != results[1]["cores"], results


def test_a_dead_worker_on_one_node_stops_the_other_node(tmp_path, two_namespaces):
    cfg = write_config(tmp_path, name="two_nodes_fail")
    nodes = launch_two_nodes(tmp_path, two_namespaces, cfg, PROBE_FAIL="1:kill")
    log_dir = tmp_path / "out/two_nodes_fail/logs"
    named = f"error: rank 1 was killed by SIGKILL; see {log_dir / 'worker_1.log'}"
    died = (log_dir / "worker_1.exit").stat().st_mtime
    for code, text, returned in nodes:
        assert code == 1 and text.splitlines()[-1] == named, text[-2000:]
        # Node 0 sees node 1's exit file in the shared run folder; without it, rank 0 would wait
        # in the AllReduce for MindSpore's collective timeout (about 30 s here).
        assert returned - died < 5
    assert leftover_processes(str(cfg)) == []


def test_a_lost_node_ends_a_restartable_job_in_one_line(tmp_path, two_namespaces):
    """With --max-restarts, node 1's launcher SIGKILLed while the workers run (the probe holds them): its
    workers die with it, node 0 names it within MINDSCALE_NODE_TIMEOUT (one line, exit 1) for the
    scheduler to requeue the job, and nothing is left running on either node."""
    cfg = write_config(tmp_path, name="lost_node")
    log_dir = tmp_path / "out/lost_node/logs"
    nodes = two_nodes.start(
        tmp_path,
        two_namespaces,
        [cfg, "1", "--max-restarts", "1"],
        lambda rank: clean_env(NODE_RANK=rank, PROBE_HOLD=LAUNCH_TIMEOUT, MINDSCALE_NODE_TIMEOUT=NODE_TIMEOUT),
    )
    deadline = time.time() + LAUNCH_TIMEOUT
    while sorted(probe_lines(nodes[1][1].read_text())) != [1] and time.time() < deadline:
        time.sleep(0.2)
    nodes[1][0].kill()
    killed = time.time()
    (code, text, returned), (lost, _, _) = two_nodes.wait(nodes, LAUNCH_TIMEOUT)
    assert lost == -signal.SIGKILL and code == 1, text[-2000:]
    assert text.splitlines()[-1] == (
        f"error: node 1's launcher went silent: no sign of it in {log_dir / 'nodes'} for {NODE_TIMEOUT} s "
        "(MINDSCALE_NODE_TIMEOUT); ending the job so the scheduler can requeue it"
    )
    assert returned - killed < NODE_TIMEOUT + 5, f"node 0 ended {returned - killed:.1f} s after the kill"
    deadline = time.time() + 5  # node 1's msrun and worker die with their parents (PR_SET_PDEATHSIG)
    while leftover_processes(str(cfg)) and time.time() < deadline:
        time.sleep(0.2)
    assert leftover_processes(str(cfg)) == []
