"""Whether other programs took this host's CPU while a probe ran.

A probe's figures (the dtype, the thread count, the step profile) are the host's only if
nothing else ran on its cores meanwhile: a ``make demo`` beside a pip install once chose 1 thread
and 199 ms/token and kept them for good. So a probe runs inside a ``Watch``: over its window the
CPU seconds every program spent on the cores this process may use (``psutil``'s per-CPU times,
the kernel's /proc/stat on Linux), less this process's own CPU seconds, are the others'. Others
on cores the probe does not use (beyond its thread count) cost it nothing; the rest, as a share
of the cores it uses, is ``others_cpu``. Past ``BUSY_SHARE`` the probe is busy: used for now,
kept only as provisional, and measured again at the next load that finds the host ``quiet``
(a probe taken while it is still busy would be no truer, and on a 2-core host beside a burner
the dtype probe of SmolLM2 took 33 s).

Comparing CPU time, not the spread of repeated samples or the load average, tells a slow host
from a shared one (a slow one is quiet and consistently slow) and needs no extra samples; the
1-minute load average is recorded beside it for the reader, but it lags the window by minutes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import psutil

#: Others may take up to this share of the probe's cores: Ray's own daemons take a few percent of
#: one core, and a probe stretched by 15% still chooses as a quiet one would (its choices are
#: between figures 1.5-3x apart). A compiler or a second model beside it takes 50% or more.
BUSY_SHARE = 0.15
#: How long a load looks at the host, idle, before it measures a provisional probe again.
QUIET_CHECK_S = 0.25


@dataclass(frozen=True)
class Taken:
    """When, and under what load, a probe's figures were taken."""

    at: str                     # ISO 8601, UTC
    window_s: float             # how long the probe ran
    others_cpu: float           # share of the probe's cores that other programs used, 0..1
    load_avg: tuple[float, float]   # the host's 1-minute load average before and after
    busy: bool                  # others_cpu > BUSY_SHARE, or later speeds beat the figures
    note: str = ""              # why the figures are provisional when the window was quiet

    def describe(self) -> dict:
        return {"taken_at": self.at, "window_s": round(self.window_s, 3), "others_cpu": round(self.others_cpu, 3),
                "load_avg": [round(load, 2) for load in self.load_avg], "busy": self.busy} \
            | ({"note": self.note} if self.note else {})


class Watch:
    """The CPU time spent on this process's cores while a probe runs with up to ``threads``
    threads: start it before the probe, ``stop()`` after."""

    def __init__(self, threads: int) -> None:
        self.cpus = cpus()
        self.threads = max(1, min(threads, len(self.cpus)))
        self._at = datetime.now(timezone.utc)
        self._load = os.getloadavg()[0]
        self._wall, self._own, self._busy = time.perf_counter(), time.process_time(), busy_seconds(self.cpus)

    def stop(self) -> Taken:
        wall = time.perf_counter() - self._wall
        own = time.process_time() - self._own
        busy = busy_seconds(self.cpus) - self._busy
        share = others_share(busy - own, wall, len(self.cpus), self.threads)
        return Taken(self._at.isoformat(timespec="seconds"), wall, share, (self._load, os.getloadavg()[0]),
                     share > BUSY_SHARE)


def quiet(threads: int, seconds: float = QUIET_CHECK_S) -> bool:
    """Whether other programs leave the cores of a probe with ``threads`` threads free now (this
    thread sleeping for ``seconds`` meanwhile): a probe taken now would not be busy."""
    watch = Watch(threads)
    time.sleep(seconds)
    return not watch.stop().busy


def others_share(others_s: float, wall_s: float, cpus: int, threads: int) -> float:
    """The share of the probe's ``threads`` cores that others used: what they spent over the
    window, less what the ``cpus - threads`` cores the probe leaves idle could hold, 0..1."""
    if wall_s <= 0:
        return 0.0
    on_ours = others_s / wall_s - (cpus - threads)
    return min(1.0, max(0.0, on_ours / threads))


def cpus() -> list[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(psutil.cpu_count() or 1))


def busy_seconds(cpus: list[int]) -> float:
    """CPU seconds spent on ``cpus`` since boot by anything but the idle task (iowait is idle)."""
    times = psutil.cpu_times(percpu=True)
    return sum(_busy(times[cpu]) for cpu in cpus if cpu < len(times))


def _busy(times) -> float:
    """Busy seconds of one CPU: user, nice, system, irq, softirq and steal (a hypervisor's
    other guests are others too); guest time is already inside user and nice."""
    return sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq", "steal"))
