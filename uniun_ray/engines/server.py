"""A model server as a child process: started in its own process group, ready when its health
route answers, stopped with its whole group (vLLM's server forks an engine core process). On
Linux it is also told to end when the process that started it dies (a ModelActor killed by
Ray, `uniun-ray down`): a server left behind would hold its memory and cores for ever.

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
from collections import deque
from pathlib import Path
from typing import IO, Callable, Sequence

from ..models.swap import SwapAbandoned


class ServerFailed(RuntimeError):
    """The server exited, or did not become ready in time; the message ends with its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _with_parent() -> "Callable[[], None] | None":
    """For Popen's `preexec_fn` on Linux: the child gets SIGTERM when its parent dies
    (PR_SET_PDEATHSIG; the server then stops its own children). libc is looked up here, before
    the fork, so the child only makes one call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG


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

    def start(self, timeout_s: float = 600, abandon=None) -> float:
        """Start the server and wait until it is healthy; seconds it took. ServerFailed when
        it exits or is not ready within `timeout_s`; SwapAbandoned (the server stopped) once
        `abandon` (a threading.Event) is set."""
        started = time.perf_counter()
        self._log_file = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, env=self.env, stdout=self._log_file,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_with_parent())
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

    def stop(self, grace_s: float = 15) -> float:
        """SIGTERM to the group, SIGKILL after `grace_s`; seconds until the leader was gone."""
        started = time.perf_counter()
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        if self.process is not None:
            self._signal(signal.SIGKILL)   # what the leader left behind in its group
        if self._log_file not in (None, subprocess.DEVNULL):
            self._log_file.close()
        self.process, self._log_file = None, None
        return time.perf_counter() - started

    def __enter__(self) -> "ChildServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

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
