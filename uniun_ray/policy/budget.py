"""The T2 budget (R11): a sliding window of held time.

Runs are recorded as closed intervals in dispatch order; they never overlap (one job at
a time), so only the oldest kept interval can straddle the window's start. Keeping running
sums makes the share O(1) amortised instead of a scan of the window.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Run:
    start: float
    end: float
    counts_as_t2: bool


class T2Window:
    def __init__(self, window_s: float, share: float) -> None:
        self._window_s = window_s
        self._share = share
        self._runs: deque[Run] = deque()
        self._held = 0.0
        self._held_t2 = 0.0

    def record(self, run: Run) -> None:
        self._runs.append(run)
        self._held += run.end - run.start
        self._held_t2 += (run.end - run.start) * run.counts_as_t2

    def _trim(self, cutoff: float) -> None:
        while self._runs and self._runs[0].end <= cutoff:
            run = self._runs.popleft()
            self._held -= run.end - run.start
            self._held_t2 -= (run.end - run.start) * run.counts_as_t2
        if not self._runs:
            self._held = self._held_t2 = 0.0  # no float drift once the window empties

    def usage(self, now: float, running: Run | None) -> tuple[float, float]:
        """(T2 held seconds, all held seconds) inside [now - window, now]; `running` is the
        job holding the device right now, as a run ending at `now`."""
        cutoff = now - self._window_s
        self._trim(cutoff)
        held, held_t2 = self._held, self._held_t2
        if self._runs and self._runs[0].start < cutoff:
            clipped = cutoff - self._runs[0].start
            held -= clipped
            held_t2 -= clipped * self._runs[0].counts_as_t2
        if running is not None:
            part = now - max(running.start, cutoff)
            held += part
            held_t2 += part * running.counts_as_t2
        return max(held_t2, 0.0), max(held, 0.0)

    def share(self, now: float, running: Run | None) -> float:
        used, held = self.usage(now, running)
        return used / held if held > 0 else 0.0

    def over(self, now: float, running: Run | None) -> bool:
        return self.share(now, running) > self._share
