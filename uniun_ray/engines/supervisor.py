"""A server's parent that ends its whole process tree: run as a script, it starts the server
command as its child and, when asked to stop (SIGTERM, or its own parent dying: the server's
`ChildServer` sets PR_SET_PDEATHSIG) or when the server exits, ends every process below it,
SIGTERM then SIGKILL after a grace period. It is the children's subreaper
(PR_SET_CHILD_SUBREAPER): a process whose own parent ended (vLLM's engine core and workers,
once its API server is gone) is adopted here, not by init, so none is missed, and one that
left the server's process group is still found. Only the standard library and psutil: it runs
by its path, before and beside any model.

    python supervisor.py PARENT_PID GRACE_S COMMAND...
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import Iterable

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def end_processes(processes: Iterable[psutil.Process], grace_s: float) -> None:
    """SIGTERM each, then SIGKILL what is left after `grace_s` (Ray's own order); processes
    already gone are skipped."""
    processes = list(processes)
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(processes, timeout=grace_s)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=grace_s)


def pgid_of(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except OSError:
        return None


def group(pgid: int) -> list[psutil.Process]:
    """The processes of process group `pgid`."""
    return [process for process in psutil.process_iter() if pgid_of(process) == pgid]


def tree(process: psutil.Process) -> list[psutil.Process]:
    """`process`, every descendant it has now and, where it leads a process group, the group's
    other members; empty when it is gone."""
    try:
        if not process.is_running():   # its start time checked: a pid reused since is not it
            return []
        below = process.children(recursive=True)
    except psutil.Error:
        return []
    return list({p.pid: p for p in [process, *below, *group(process.pid)]}.values())


def prctl(option: int, value: int) -> None:
    """Linux's prctl in this process; nothing elsewhere (no subreaper there)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def supervise(parent: int, grace_s: float, command: list[str]) -> int:
    """Run `command` until it exits or this process is told to stop; then end every process
    below this one. The server's exit status (or 0 once stopped)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.set())
    if os.getppid() != parent:   # the parent died before its death signal was set
        return 0
    server = subprocess.Popen(command)
    while server.poll() is None and not stopping.wait(0.2):
        pass
    end_processes(psutil.Process().children(recursive=True), grace_s)
    status = server.wait()
    return 0 if stopping.is_set() else status if status >= 0 else 128 - status   # a signal: the shell's way


if __name__ == "__main__":
    sys.exit(supervise(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]))
