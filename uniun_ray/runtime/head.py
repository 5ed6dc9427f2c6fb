"""The Ray head that `uniun-ray up` starts and `uniun-ray down` stops, and nothing else.

`ray stop` kills every Ray process of the user: on a shared workstation that includes other
people's clusters and test sessions. So `up` runs `ray start --head` in a new session (a
process group of its own) and records the group and its processes in a state file; `down`
signals only that group and the processes descending from it (the raylet forks its workers
into groups of their own, but they stay its children). Recorded pids are checked against
their start time, so a pid the system reused is never signalled.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ..settings import state_dir
from .placement import DEVICE_RESOURCE, EMBEDDER_RESOURCE

STOP_GRACE_S = 5.0  # gcs_server and raylet often outlast a SIGTERM; the whole head goes anyway
#: How far a recorded process's start time may be from what another process reads for it. On
#: Linux psutil derives it from /proc/stat's `btime`, which the kernel recomputes at every read
#: from the wall clock (whole seconds): a clock adjustment moves it, and with a 10 ms match a
#: running head looked gone to `down` (seen on a loaded VM; psutil#2526). A pid reused by
#: another process starts later than that.
START_TIME_SLACK_S = 2.0


#: Ray starts its workers, and so every actor (the scheduler, the ModelActors), at niceness 15
#: (its `worker_niceness`): below every ordinary program of the host. Measured on the 2-core
#: box (BENCHMARKS.md, "Runtime"): with two busy programs at niceness 0 beside
#: it, the chat model did not finish loading in 200 s at 15 (other runs: the first chats
#: waited 8-43 s for a first token), against 23 s and a TTFT p50 of 0.5 s at 0. The clusters
#: this project starts set it to 0; an explicit setting wins.
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def worker_niceness() -> str:
    """The niceness of the workers of a Ray this process starts: $RAY_worker_niceness, set to
    0 where unset (the raylet reads it from the environment it is started with)."""
    return os.environ.setdefault(WORKER_NICENESS_ENV, "0")


#: How soon the GCS declares a silent node dead (its raylet misses this many health checks in a
#: row, one this often): then the scheduler takes that node's devices out of the pool and their
#: jobs run elsewhere (runtime/nodes.py). Ray's defaults (every 3 s, 5 missed: ~15 s) left
#: chats and jobs on a dead node waiting that long; a head that uniun-ray starts checks every
#: second and gives up after 3 (measured on this machine: a SIGKILLed node is known dead ~1-3 s
#: later, BENCHMARKS.md). An explicit setting wins. It is the head's (the GCS's) setting only.
NODE_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def node_health() -> dict:
    """`NODE_HEALTH`, with what the environment sets instead."""
    return {name: os.environ.get(name, value) for name, value in NODE_HEALTH.items()}


class HeadError(RuntimeError):
    """`ray start` failed, or the recorded head cannot be used."""


def state_path() -> Path:
    """up.json in the state folder (`UNIUN_STATE_DIR`, beside the event log)."""
    return state_dir() / "up.json"


@dataclass
class HeadState:
    """What `up` started: enough for clients to find it and for `down` to stop only it."""

    address: str                 # GCS address, for ray.init
    dashboard_url: str | None
    auth_mode: str
    pgid: int
    processes: list[list[float]]  # [pid, create_time] of the head's processes after `ray start`
    started_at: float
    session_dir: str | None = None
    actors: list[str] = field(default_factory=list)

    def save(self, path: Path | None = None) -> None:
        path = path or state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps(asdict(self), indent=2))
        staging.replace(path)

    @classmethod
    def load(cls, path: Path | None = None) -> "HeadState | None":
        path = path or state_path()
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as error:
            raise HeadError(f"unreadable state file {path} ({error}); remove it if no head is running") from None

    @staticmethod
    def forget(path: Path | None = None) -> None:
        (path or state_path()).unlink(missing_ok=True)

    def alive(self) -> list[psutil.Process]:
        """The recorded processes that still run (same pid, same start time)."""
        found = []
        for pid, created in self.processes:
            try:
                process = psutil.Process(int(pid))
                if abs(process.create_time() - created) <= START_TIME_SLACK_S:
                    found.append(process)
            except psutil.Error:
                continue
        return found


def stand_in_resources(gpus: int, devices: int = 1) -> dict:
    """The custom resources a node declares for what it lacks, mirroring `placement`: the models
    take GPUs, else `devices` stand-in devices (`uniun_device`, one ModelActor each); the
    embedder a second GPU, else `uniun_embedder`."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    resources = {}
    if gpus < 1:
        resources[DEVICE_RESOURCE] = devices
    if gpus < 2:
        resources[EMBEDDER_RESOURCE] = 1
    return resources


def gpu_count() -> int:
    """CUDA GPUs torch sees here (the model actor runs on torch, so its view is the one that
    matters; 0 on a CPU build)."""
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # no torch, or a broken driver: no GPU to use
        return 0


def _ray_executable() -> str:
    sibling = Path(sys.executable).with_name("ray")  # the `ray` of this environment first
    found = str(sibling) if sibling.exists() else shutil.which("ray")
    if not found:
        raise HeadError("the `ray` command was not found; install the project (make install)")
    return found


def _pgid(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except OSError:
        return None


def _group(pgid: int) -> list[psutil.Process]:
    return [process for process in psutil.process_iter() if _pgid(process) == pgid]


def start_head(*, port: int, dashboard_host: str, dashboard_port: int, auth_mode: str,
               temp_dir: str | None = None, devices: int = 1, extra: list[str] = ()) -> HeadState:
    """Run `ray start --head` in a new process group with RAY_AUTH_MODE set explicitly, its
    workers at `worker_niceness()`, dead nodes noticed within seconds (`NODE_HEALTH`),
    declaring the stand-in resources this machine needs (`devices` stand-in devices when it
    has no GPU). Returns the (unsaved) state."""
    resources = stand_in_resources(gpu_count(), devices)
    command = [_ray_executable(), "start", "--head", f"--port={port}", f"--dashboard-host={dashboard_host}",
               f"--dashboard-port={dashboard_port}", f"--resources={json.dumps(resources)}",
               *([f"--temp-dir={temp_dir}"] if temp_dir else []), *extra]
    # This environment's bin first on PATH: `python` in a job's entrypoint is then the
    # Python that runs Ray and has uniun-ray installed, not whatever the shell had.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, **node_health(), "RAY_AUTH_MODE": auth_mode, WORKER_NICENESS_ENV: worker_niceness(),
           "PATH": path}
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output, _ = process.communicate()
    members = _group(process.pid)
    if process.returncode != 0:
        _stop(members)
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise HeadError(f"`ray start --head` failed (exit {process.returncode}):\n{tail}")
    return HeadState(address=f"127.0.0.1:{port}", dashboard_url=f"http://{dashboard_host}:{dashboard_port}",
                     auth_mode=auth_mode, pgid=process.pid,
                     processes=[[p.pid, p.create_time()] for p in members], started_at=time.time())


def stop_head(state: HeadState) -> int:
    """Stop the recorded head: its process group and every descendant. Returns how many
    processes were signalled (0 when it was already gone)."""
    alive = state.alive()
    owned = [p for p in alive if _pgid(p) == state.pgid]
    tree = set(alive) | (set(_group(state.pgid)) if owned else set())
    for process in list(tree):
        try:
            tree.update(process.children(recursive=True))
        except psutil.Error:
            continue
    _stop(list(tree))
    return len(tree)


def _stop(processes: list[psutil.Process]) -> None:
    """SIGTERM, then SIGKILL what is left after the grace period (Ray's own order)."""
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(processes, timeout=STOP_GRACE_S)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=STOP_GRACE_S)


if __name__ == "__main__":  # cluster.yaml: `ray start --resources="$(python -m uniun_ray.runtime.head)"`
    print(json.dumps(stand_in_resources(gpu_count())))
