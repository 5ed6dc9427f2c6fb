"""The wait for a generating job, shared by the test modules and the subprocess scenarios
(which cannot import conftest: it sets the test session's environment)."""
from __future__ import annotations

from uniun_ray.client import await_generating

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
