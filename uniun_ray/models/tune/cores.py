"""How many threads the decode loop runs with while it serves: the probe's, less a core for
each core's worth that other programs keep busy.

The probe (``tuning``) picks the thread count on a quiet host, at load. But a serving host is
not quiet: Ray's processes, Serve's proxy and the HTTP replica stream the tokens the loop makes,
on the same cores. A forward pass of a small model is hundreds of short kernels, each ending in
a barrier where every thread waits for the slowest; a thread that loses its core to another
program stalls them all. On 2 AVX-512 cores, with 4 background streams and a chat over HTTP
(``benchmarks/peers.py``), the others took about a third of a core. (Hand-run measurements,
not recorded: beside a simulated load of that size a packed bf16 step at batch 4 took 133 ms
at 2 threads and 104 at 1; in the peers workload 2 threads made 23 tokens/s against 32 at 1,
but before the per-thread fix below, after which the two were within this VM's noise.) vLLM's
CPU build keeps a core for its front end for the same reason. So the loop measures, every
``WINDOW_S`` of stepping, the CPU time other programs spent on its cores (``contention``) and
runs ``threads_for`` threads: two windows must agree before it changes, so that a burst does
not flip it. A step in which no job streams (a prompt read at an idle device) runs every thread
the probe chose: the programs that stream wait for its first token then. A thread count the
user fixed (``UNIUN_THREADS``) is kept as is.

Each thread that runs the loop sets the count for itself (``enter``): oneDNN and MKL, which run
the linear layers, read OpenMP's per-thread setting, and a new thread starts from the process's
default, which Ray sets to 1 (``OMP_NUM_THREADS``) whatever ``torch.set_num_threads`` said in
the thread that loaded the model. A decode loop's thread so ran its linear layers on one core
and the rest of the forward pass on two.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import torch

from .contention import busy_seconds, cpus

#: How often the loop looks at the others' share of its cores.
WINDOW_S = 2.0
#: Others' CPU below this many cores costs a barrier little (Ray's daemons take a few percent).
SPARE_CORES = 0.1


def threads_for(most: int, others_cores: float) -> int:
    """``most`` threads, less one for each core (rounded up) the others keep busy beyond
    ``SPARE_CORES``; at least one."""
    return max(1, most - max(0, math.ceil(others_cores - SPARE_CORES)))


class CoreShare:
    """Sets torch's threads for the loop from the others' recent CPU time (see the module)."""

    def __init__(self, most: int, fixed: bool) -> None:
        self.most, self.fixed, self.threads = most, fixed, most
        self._running: int | None = None     # what the loop's current thread runs with
        self.others_cores = 0.0
        self._cpus = cpus()
        self._pending: int | None = None
        self._mark()

    def _mark(self) -> None:
        self._wall, self._own, self._busy = time.perf_counter(), time.process_time(), busy_seconds(self._cpus)

    def enter(self) -> None:
        """Called first by each thread that runs the loop (see the module): a new thread starts
        from the process's default, whatever the thread before it ran with."""
        self._running = None
        self._run_with(self.threads)

    def before_step(self, streaming: bool) -> None:
        """Called by the loop's thread before each step: the share's threads while jobs stream
        tokens, every thread the probe chose for a step in which none does (a prompt read at an
        idle device: the programs that stream wait for its first token)."""
        self._run_with(self.threads if streaming else self.most)

    def _run_with(self, threads: int) -> None:
        if threads != self._running:
            torch.set_num_threads(threads)
            self._running = threads

    def after_step(self) -> None:
        """Called by the loop's thread between steps: cheap until a window has passed."""
        wall = time.perf_counter() - self._wall
        if self.fixed or wall < WINDOW_S:
            return
        others = busy_seconds(self._cpus) - self._busy - (time.process_time() - self._own)
        self.others_cores = max(0.0, others / wall)
        self._mark()
        wanted = threads_for(self.most, self.others_cores)
        if wanted == self.threads:
            self._pending = None
        elif self._pending == wanted:
            self.threads, self._pending = wanted, None
        else:
            self._pending = wanted

    def describe(self) -> dict:
        return {"threads": self.threads, "threads_most": self.most, "others_cores": round(self.others_cores, 2)}


def in_own_thread(work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args)`` in a thread that ends with it; the caller is left with the torch thread
    count the work ended with (a load tunes it), and gets its result or its exception.

    A thread that ran OpenMP kernels keeps a team of worker threads while it lives. With two
    such teams on the cores (the one of the thread that loaded the model, the decode loop's),
    GNU OpenMP stops spinning between kernels, and every kernel of a forward pass then waits to
    wake its workers (``benchmarks/loader_thread.py``: the loop's second thread half idle)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = work(*args)
        except BaseException as error:   # re-raised in the caller
            outcome["error"] = error
        outcome["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=run, name="torch-work", daemon=True)
    thread.start()
    thread.join()
    torch.set_num_threads(outcome["threads"])
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]

