"""The scheduler's clock: the time its shell reads, and how its timers wait.

The policy takes explicit time; the shell feeds it from here: `time()` epoch seconds (the
policy's time; deadlines are time.time()), `monotonic()` for liveness (how long a caller has
been quiet), and `wait`/`sleep` for the timers (the reaper's rounds, R5's wake-ups). `Clock` is
real time; a test hands `SchedulerService` one it moves by hand, so that lease timeouts,
deadlines and the reaper are driven rather than slept for and asserted on.
"""
from __future__ import annotations

import asyncio
import time


class Clock:
    """Real time."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Until `event` is set (True) or `timeout_s` has passed (False)."""
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True
