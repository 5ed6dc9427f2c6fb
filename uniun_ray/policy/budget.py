"""The T2 budget (R11): a sliding window of held time.

Runs are recorded as closed intervals in dispatch order; they never overlap (one job at
a time), so only the oldest kept interval can straddle the window's start. Keeping running
sums makes the share O(1) amortised instead of a scan of the window.

The sums are kept exactly, in integer nanoseconds: float sums that are added to and
subtracted from drift (issue 10: a share of 1.0000000000000007 with `t2_share` 1.0, and
3.6e-15 s of T2 time in a window that held none), and a budget decision must never turn
on that noise. With integers a share of 1.0 is never exceeded and a window without T2
time is never over budget, whatever the history.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

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
        self._runs: deque[tuple[int, int, bool]] = deque()  # (start, end, counts as T2)
        self._held = 0
        self._held_t2 = 0

    def record(self, run: Run) -> None:
        start, end = ns(run.start), ns(run.end)
        self._runs.append((start, end, run.counts_as_t2))
        self._held += end - start
        self._held_t2 += (end - start) * run.counts_as_t2

    def _trim(self, cutoff: int) -> None:
        while self._runs and self._runs[0][1] <= cutoff:
            start, end, t2 = self._runs.popleft()
            self._held -= end - start
            self._held_t2 -= (end - start) * t2

    def _usage_ns(self, now: float, running: Run | None) -> tuple[int, int]:
        at = ns(now)
        cutoff = at - self._window
        self._trim(cutoff)
        held, held_t2 = self._held, self._held_t2
        if self._runs and self._runs[0][0] < cutoff:
            start, _, t2 = self._runs[0]
            held -= cutoff - start
            held_t2 -= (cutoff - start) * t2
        if running is not None:
            part = at - max(ns(running.start), cutoff)
            held += part
            held_t2 += part * running.counts_as_t2
        return held_t2, held

    def usage(self, now: float, running: Run | None) -> tuple[float, float]:
        """(T2 held seconds, all held seconds) inside [now - window, now]; `running` is the
        job holding the device right now, as a run ending at `now`."""
        used, held = self._usage_ns(now, running)
        return used / _NS, held / _NS

    def over(self, now: float, running: Run | None) -> bool:
        used, held = self._usage_ns(now, running)
        return used > self._share * held
