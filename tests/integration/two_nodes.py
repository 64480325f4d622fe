"""Two nodes of one job on this machine: a network namespace per node (the `two_namespaces` fixture,
tests/integration/conftest.py), each running scripts/run_distribute.sh as NODE_RANK 0 and 1 with
MASTER_ADDR at node 0's address. They share this machine's file system, as nodes share a run folder."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MASTER = dict(NNODES=2, MASTER_ADDR="10.213.0.1", MASTER_PORT=29517)


def namespaces():
    """Two network namespaces joined by a veth pair: node 0 at 10.213.0.1, node 1 at 10.213.0.2.
    Each sees only its own address, so msrun on node 1 finds MASTER_ADDR remote, as on a cluster."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = str(os.getpid() % 100000)
    names, links = [f"mstest{tag}a", f"mstest{tag}b"], [f"msv{tag}a", f"msv{tag}b"]
    if subprocess.run(["ip", "netns", "add", names[0]], capture_output=True).returncode:
        pytest.skip("cannot create network namespaces here (ip netns add failed)")
    try:
        commands = [
            ["ip", "netns", "add", names[1]],
            ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]],
        ]
        for i, (ns, link) in enumerate(zip(names, links)):
            commands += [
                ["ip", "link", "set", link, "netns", ns],
                ["ip", "-n", ns, "addr", "add", f"10.213.0.{i + 1}/24", "dev", link],
                ["ip", "-n", ns, "link", "set", link, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
            ]
        for cmd in commands:
            subprocess.run(cmd, check=True, capture_output=True)
        yield names
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def start(tmp_path, names, args, env_of, cwd=None):
    """run_distribute.sh `args` in each namespace, node k with the environment `env_of(k)` plus MASTER;
    its output in `<tmp_path>/node<k>.txt`. Returns [(Popen, output file)]."""
    nodes = []
    for rank, ns in enumerate(names):
        log = tmp_path / f"node{rank}.txt"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "bash", str(ROOT / "scripts/run_distribute.sh"), *map(str, args)],
                cwd=cwd or tmp_path,
                env={**env_of(rank), **{k: str(v) for k, v in MASTER.items()}},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        nodes.append((proc, log))
    return nodes


def wait(nodes, timeout):
    """Wait for every node's launcher; [(exit status, output, time it returned)] per node. A launcher
    still running after `timeout` s is stopped (SIGINT: it stops its workers at once) and fails the test."""
    returned, deadline = {}, time.time() + timeout
    try:
        while len(returned) < len(nodes) and time.time() < deadline:
            for i, (proc, _) in enumerate(nodes):
                if i not in returned and proc.poll() is not None:
                    returned[i] = time.time()
            time.sleep(0.1)
    finally:
        for proc, _ in nodes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(10)
    assert len(returned) == len(nodes), "a node's launcher did not return in time"
    return [(proc.returncode, log.read_text(), returned[i]) for i, (proc, log) in enumerate(nodes)]
