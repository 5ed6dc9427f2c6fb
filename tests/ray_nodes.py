"""Real Ray nodes on this machine, as separate machines would run them, for the cluster
scenario (tests/cluster_scenario.py) and the node-loss benchmark (benchmarks/node_loss.py).

The head is `uniun-ray up`'s own (`head.start_head`: its health checks, `NODE_HEALTH`, make
Ray notice a dead node within seconds); each worker is `ray start --address=HEAD`, the
README's command for a machine that joins, each in a process group (session) of its own and
each declaring its own stand-in devices. A node dies as a machine does: SIGKILL, at once, to
every process of its group and every process descending from them (the raylet forks its
workers, the actors, into groups of their own). Nothing here touches any other Ray of the
machine: no `ray stop`, the nodes' temp dir is private, the ports are picked free. Each node's
group is written down in that dir as it starts, so that a run killed before it could clean up
is cleaned up after (`kill_leftovers`, by the test that started it).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from uniun_ray.http.measure import free_port
from uniun_ray.runtime.head import WORKER_NICENESS_ENV, start_head, worker_niceness
from uniun_ray.runtime.placement import DEVICE_RESOURCE

#: Each node's object store: the scenario moves no large objects.
OBJECT_STORE_BYTES = 80 * 1024 * 1024
#: Where `LocalNodes` keeps its nodes' temp dir (a caller's own, to clean up after it), and the
#: file in it that lists their process groups.
NODES_DIR_ENV = "UNIUN_NODES_DIR"
GROUPS_FILE = "uniun-node-groups"


def group_processes(pgid: int) -> set[psutil.Process]:
    """The processes of a group and every process descending from them."""
    group = set()
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                group.add(process)
        except (OSError, psutil.Error):
            continue
    for process in list(group):
        try:
            group.update(process.children(recursive=True))
        except psutil.Error:
            continue
    return group


def kill_all(processes: set[psutil.Process]) -> float:
    """SIGKILL these processes at once and wait for them; returns when (time.time(), the event
    log's clock)."""
    killed_at = time.time()
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    psutil.wait_procs(list(processes), timeout=10)
    return killed_at


def started_in(temp_dir: str) -> set[psutil.Process]:
    """Every process whose command line names `temp_dir`: a node's raylet and its workers
    (`--temp-dir=...`), also a worker forked as its raylet was being killed."""
    found = set()
    for process in psutil.process_iter():
        try:
            if any(temp_dir in part for part in process.cmdline()):
                found.add(process)
        except psutil.Error:
            continue
    return found


@dataclass
class NodeGroup:
    """A node: the process group its `ray start` made."""

    pgid: int
    devices: int

    def kill(self) -> float:
        """The node dies as a machine does: SIGKILL to all of it at once. Returns when."""
        return kill_all(group_processes(self.pgid))


def kill_leftovers(temp_dir: str) -> None:
    """Kill the nodes a `LocalNodes` with this temp dir started and did not stop (its process
    was killed), then remove the dir."""
    groups = Path(temp_dir, GROUPS_FILE)
    pgids = [int(line) for line in groups.read_text().split()] if groups.exists() else []
    kill_all(set().union(started_in(temp_dir), *(group_processes(pgid) for pgid in pgids)))
    shutil.rmtree(temp_dir, ignore_errors=True)


class LocalNodes:
    """A head and the workers that join it; every node is killed when the block ends. The
    nodes' temp dir is $UNIUN_NODES_DIR where the caller set it, else a new one. Their devices
    are stand-ins whatever GPUs the host has (they hide them: this process's own
    environment too, which `start_head` reads): the nodes are what is tested."""

    def __init__(self) -> None:
        self.temp_dir = os.environ.get(NODES_DIR_ENV) or tempfile.mkdtemp(prefix="uniun-nodes-")
        self.address: str | None = None
        self.nodes: list[NodeGroup] = []
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        self._env = os.environ | {"RAY_AUTH_MODE": "disabled", WORKER_NICENESS_ENV: worker_niceness()}
        self._env.pop("RAY_ADDRESS", None)

    def __enter__(self) -> "LocalNodes":
        return self

    def __exit__(self, *exc) -> None:
        kill_leftovers(self.temp_dir)

    def _started(self, pgid: int, devices: int) -> NodeGroup:
        self.nodes.append(NodeGroup(pgid, devices))
        with open(Path(self.temp_dir, GROUPS_FILE), "a") as groups:
            groups.write(f"{pgid}\n")
        return self.nodes[-1]

    def head(self, devices: int) -> NodeGroup:
        """`uniun-ray up`'s head, with `devices` stand-in devices and the embedder's seat."""
        state = start_head(port=free_port(), dashboard_host="127.0.0.1", dashboard_port=free_port(),
                           auth_mode="disabled", temp_dir=self.temp_dir, devices=devices,
                           extra=["--include-dashboard=false", *self._small()])
        self.address = state.address
        return self._started(state.pgid, devices)

    def start_runtime(self, config) -> str:
        """Join this process to the head and start uniun-ray there (`start(config)`: the first
        pool is the head's devices). Returns the head's node id."""
        import ray

        from uniun_ray.runtime.launch import connect, start

        connect(self.address)
        start(config)
        return ray.get_runtime_context().get_node_id()

    def join(self, devices: int) -> NodeGroup:
        """A worker node that joins the head with `devices` stand-in devices."""
        ray = str(Path(sys.executable).with_name("ray"))
        command = [ray, "start", f"--address={self.address}", f"--resources={json.dumps({DEVICE_RESOURCE: devices})}",
                   f"--dashboard-agent-listen-port={free_port()}", *self._small()]
        process = subprocess.Popen(command, env=self._env, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        node = self._started(process.pid, devices)   # killed at the end, even if it failed
        output, _ = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"`ray start --address` failed (exit {process.returncode}):\n{output[-2000:]}")
        return node

    @staticmethod
    def _small() -> list[str]:
        return ["--num-cpus=1", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
