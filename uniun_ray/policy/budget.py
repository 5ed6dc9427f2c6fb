"""The T2 budget (R11, R19): a sliding window of held device-seconds.

Runs are recorded as closed intervals, per device in the order they end; the runs of one
device never overlap (one job at a time), so only each device's oldest kept interval can
straddle the window's start. Keeping running sums makes the share O(devices) instead of a
scan of the window. Over a pool, T2 counts its device-seconds against `t2_share` of all
the device-seconds held in the window; with one device that is R11's held time.

The sums are kept exactly, in integer nanoseconds: float sums that are added to and
subtracted from drift (a share of 1.0000000000000007 with `t2_share` 1.0, and
3.6e-15 s of T2 time in a window that held none), and a budget decision must never turn
on that noise. With integers a share of 1.0 is never exceeded and a window without T2
time is never over budget, whatever the history.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

_NS = 1_000_000_000


def ns(seconds: float) -> int:
    """A time on the integer clock. Monotone, so the order of times is kept."""
    return round(seconds * _NS)


@dataclass(frozen=True, slots=True)
class Run:
    start: float
    end: float
    counts_as_t2: bool


class T2Window:
    def __init__(self, window_s: float, share: float) -> None:
        self._window = ns(window_s)
        self._share = share
        self._runs: dict[str, deque[tuple[int, int, bool]]] = {}  # device -> (start, end, T2)
        self._held = 0
        self._held_t2 = 0

    def record(self, device: str, run: Run) -> None:
        start, end = ns(run.start), ns(run.end)
        self._runs.setdefault(device, deque()).append((start, end, run.counts_as_t2))
        self._held += end - start
        self._held_t2 += (end - start) * run.counts_as_t2

    def _trim(self, cutoff: int) -> None:
        for device, runs in list(self._runs.items()):
            while runs and runs[0][1] <= cutoff:
                start, end, t2 = runs.popleft()
                self._held -= end - start
                self._held_t2 -= (end - start) * t2
            if not runs:
                del self._runs[device]  # a device removed long ago leaves nothing behind

    def _usage_ns(self, now: float, running: Iterable[Run]) -> tuple[int, int]:
        at = ns(now)
        cutoff = at - self._window
        self._trim(cutoff)
        held, held_t2 = self._held, self._held_t2
        for runs in self._runs.values():
            start, _, t2 = runs[0]
            if start < cutoff:
                held -= cutoff - start
                held_t2 -= (cutoff - start) * t2
        for run in running:
            part = at - max(ns(run.start), cutoff)
            held += part
            held_t2 += part * run.counts_as_t2
        return held_t2, held

    def usage(self, now: float, running: Iterable[Run]) -> tuple[float, float]:
        """(T2 held seconds, all held seconds) inside [now - window, now]; `running` are the
        jobs holding devices right now, as runs ending at `now`."""
        used, held = self._usage_ns(now, running)
        return used / _NS, held / _NS

    def over(self, now: float, running: Iterable[Run]) -> bool:
        used, held = self._usage_ns(now, running)
        return used > self._share * held
