"""The scheduler's clock: the policy's timers and the reaper.

Ray does not cancel a dead caller's pending call, and a dead holder never releases. So
waiters long-poll `grant` (each poll, or their session's heartbeat, proves them alive) and
holders renew their lease; every `period_s` — or sooner, at the policy's next wake-up (a
deadline falling due, R5) — the reaper ticks the policy, drops a queued job whose caller
went quiet and reclaims a lease that was not renewed in time.
"""
from __future__ import annotations

import asyncio
import math
from typing import Callable, Iterable

from ..policy import RevokeCause
from .clock import Clock


class Reaper:
    def __init__(self, period_s: float, next_wakeup: Callable[[], float | None], tick: Callable[[], None],
                 idle: Callable[[float], Iterable], withdraw: Callable, after: Callable[[], None] | None = None,
                 clock: Clock | None = None) -> None:
        """`tick()` advances the policy to now; `idle(mono)` yields (tracked, idle_s) of the
        quiet callers; `withdraw(tracked, reason, cause)` ends one; `after()` runs each round
        (the metrics' gauges). `clock`: what it reads and waits on (real time by default)."""
        self.period_s = period_s
        self.clock = clock or Clock()
        self._next_wakeup, self._tick, self._idle, self._withdraw, self._after = next_wakeup, tick, idle, withdraw, after
        self._rearm: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._wake_at = math.inf   # when the timer next wakes (epoch seconds, as the policy's times)

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._rearm = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def rearm(self) -> None:
        """The next wake-up may have moved earlier (a job with a deadline arrived): wake the
        timer if it did. Not at every submit: each round ticks the policy and walks every job."""
        wake = self._next_wakeup()
        if self._rearm is not None and wake is not None and wake < self._wake_at:
            self._rearm.set()

    async def _run(self) -> None:
        while True:
            wake = self._next_wakeup()
            delay = self.period_s
            if wake is not None:
                delay = min(delay, max(0.0, wake - self.clock.time()))
            self._rearm.clear()
            self._wake_at = self.clock.time() + delay
            await self.clock.wait(self._rearm, delay)
            self._tick()
            self.reap(self.clock.monotonic())
            if self._after is not None:
                self._after()

    def reap(self, mono: float) -> None:
        for tracked, idle in self._idle(mono):  # lazily: each withdrawal may dispatch the next job
            if tracked.state == "queued":
                self._withdraw(tracked, f"its caller stopped polling for {idle:.1f} s (caller gone?)",
                               RevokeCause.CANCEL)
            else:
                self._withdraw(tracked, f"lease reclaimed: not renewed for {idle:.1f} s (holder gone?)",
                               RevokeCause.RECLAIM)
