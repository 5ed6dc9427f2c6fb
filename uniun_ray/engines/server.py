"""A model server as a child process, ready when its health route answers, and ended with
every process it started: vLLM's server starts an engine core, which starts workers. The
server runs below a supervisor (`supervisor`) that leads a session of its own and adopts
what the server leaves behind, so stopping it, the process that started it ending (`atexit`),
or dying (Linux tells the supervisor: a ModelActor killed by Ray, `uniun-ray down`) ends the
whole tree, SIGTERM then SIGKILL: a server left behind would hold its memory and cores for ever.

The vLLM engine runs vLLM's OpenAI server this way, and `benchmarks/peers.py` runs the peers
(vLLM, llama.cpp's server) the same way.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections import deque
from pathlib import Path
from typing import IO, Callable, Sequence

import psutil

from ..models.swap import SwapAbandoned
from . import supervisor
from .supervisor import PR_SET_PDEATHSIG, end_processes, tree

#: How long a stopped server's processes get to end before SIGKILL.
STOP_GRACE_S = 15.0


class ServerFailed(RuntimeError):
    """The server exited, or did not become ready in time; the message ends with its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _with_parent() -> "Callable[[], None] | None":
    """For Popen's `preexec_fn` on Linux: the supervisor gets SIGTERM when its parent dies
    (PR_SET_PDEATHSIG), and then ends the server's tree. libc is looked up here, before the
    fork, so the child only makes one call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _end(supervising: psutil.Process, grace_s: float) -> None:
    """End the supervisor and every process below it or in its group."""
    end_processes(tree(supervising), grace_s)


class ChildServer:
    """One server process. `start` returns the seconds it took to answer `health` with 200.
    Linux ties the server's life to the thread that called `start` (PR_SET_PDEATHSIG): call it
    from a thread that lives as long as the server should (the main thread, or a pool's worker
    such as asyncio's `to_thread`, which lives as long as its process)."""

    def __init__(self, command: Sequence[str], port: int, *, env: dict | None = None, log: Path | None = None,
                 health: str = "/health", host: str = "127.0.0.1") -> None:
        self.command, self.port, self.env, self.log, self.health = list(command), port, env, log, health
        self.url = f"http://{host}:{port}"
        self.process: subprocess.Popen | None = None
        self._log_file: IO | None = None
        self._end: weakref.finalize | None = None

    def start(self, timeout_s: float = 600, abandon=None) -> float:
        """Start the server and wait until it is healthy; seconds it took. ServerFailed when
        it exits or is not ready within `timeout_s`; SwapAbandoned (the server stopped) once
        `abandon` (a threading.Event) is set."""
        started = time.perf_counter()
        self._log_file = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [sys.executable, "-I", supervisor.__file__, str(os.getpid()), str(STOP_GRACE_S), *self.command],
            env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_with_parent())
        # at this process's exit too (a finalizer runs at exit), and once only
        self._end = weakref.finalize(self, _end, psutil.Process(self.process.pid), STOP_GRACE_S)
        while not self._healthy():
            if self.process.poll() is not None:
                raise ServerFailed(f"{self.command[:4]} exited with {self.process.returncode}{self._tail()}")
            if time.perf_counter() - started > timeout_s:
                self.stop()
                raise ServerFailed(f"{self.command[:4]} not ready after {timeout_s:.0f} s{self._tail()}")
            if abandon is not None and abandon.is_set():
                self.stop()
                raise SwapAbandoned(f"{self.command[:4]}: its start was abandoned")
            time.sleep(0.25)
        return time.perf_counter() - started

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> float:
        """End the server and every process it started (SIGTERM, SIGKILL what is left after
        `STOP_GRACE_S`); seconds until they were gone."""
        started = time.perf_counter()
        if self._end is not None:
            self._end()
            self.process.wait()
        if self._log_file not in (None, subprocess.DEVNULL):
            self._log_file.close()
        self.process, self._log_file, self._end = None, None, None
        return time.perf_counter() - started

    def __enter__(self) -> "ChildServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _tail(self, lines: int = 30) -> str:
        if not self.log or not Path(self.log).exists():
            return ""
        with open(self.log, errors="replace") as handle:
            return "; its log ends:\n" + "".join(deque(handle, lines))
