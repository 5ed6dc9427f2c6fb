"""The waits of the runtime tests, shared by the test modules, the subprocess scenarios (which
cannot import conftest: it sets the test session's environment) and the cluster benchmark: a
generating job, a pool of so many devices."""
from __future__ import annotations

import asyncio
import time

from uniun_ray.client import astatus, await_generating

#: How long a test waits for a job to be generating. Room for the worst case a test itself
#: causes: its job may be the session's first use of a model in an empty cache (a conversion
#: and the dtype probe), on a slow host beside another pytest worker (56 s measured for `tiny`
#: on 2 busy AVX2 cores, where it is ~5 s alone). Only a failing test waits this long.
STARTED_TIMEOUT_S = 300.0


async def started(kind: str) -> dict:
    """Wait until a job of `kind` is generating on a device (the client's `await_generating`);
    fail the test if none is within `STARTED_TIMEOUT_S`. Returns the running job's snapshot."""
    running = await await_generating(kind, timeout_s=STARTED_TIMEOUT_S, min_held_s=0.3)
    assert running is not None, f"no {kind} job started"
    return running


async def until(check, what: str):
    """Poll `check()` (a coroutine function) until its value is truthy, and return that; fail,
    naming `what`, after STARTED_TIMEOUT_S."""
    deadline = time.monotonic() + STARTED_TIMEOUT_S
    while not (value := await check()):
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)
    return value


async def pool_of(devices: int, located: bool = True) -> dict:
    """The status once the pool has `devices` devices (and, if `located`, each knows its node)."""
    async def look():
        status = await astatus()
        found = status["devices"]
        return status if len(found) == devices and (not located or all(d["node"] for d in found)) else None
    return await until(look, f"a pool of {devices} devices")


async def withdraw(job: asyncio.Future) -> None:
    """Cancel a job's task (its caller goes away: the client withdraws it) and wait until its
    cleanup has told the scheduler."""
    job.cancel()
    await asyncio.gather(job, return_exceptions=True)
