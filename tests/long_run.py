"""How many tokens of `tiny` keep a device busy for a while on this host, measured through the
runtime (the session's cluster, or a scenario's private one). A fixed count was wrong on every
host: 1,800 tokens were 2 s where it was chosen and 8-15 s on a slower one, most of the suite's
time spent finishing runs that had done their part. A host that gets busier later only makes
the runs longer."""
from __future__ import annotations

import time

#: How long a "long" run keeps the device busy: long enough that a test's next step (a chat, a
#: kill, a flip) meets it running, with seconds to spare on a loaded host.
LONG_RUN_S = 2.0
#: tiny's context is 2048 tokens: room for the prompt. Also the run of a test whose next step
#: must find it running whatever the host's speed then (a long run measured while the host was
#: busy is short once it is not): over 2 s at tiny's fastest; a test done with it withdraws it.
MAX_LONG_TOKENS = 1800
#: The shortest long run, whatever the measure said: a measure taken while the host was busy
#: (another worker converting a model at the session's start: 6.6 ms a token, where the host
#: gave 1.5 later) made a half-long run end before a test could see it running (``waits.started``
#: wants one held 0.3 s) or before the flapping test's flips met it. A half-long run is over
#: 0.5 s at tiny's fastest (1.3 ms a token through the runtime): 400 tokens failed the flapping
#: test in most runs there (200-token halves), 800 passed.
MIN_LONG_TOKENS = 800


async def tiny_seconds_per_token() -> float:
    """Seconds per token of a Nataraj on `tiny`, streamed through the running runtime, from
    its first piece on (a lease's grant is not a token), after a warm-up run: the first
    hundreds of tokens after a load ran 3x slower."""
    from uniun_ray.client import agenerate, astream

    await agenerate("nataraj", "warm up", model_id="tiny", max_new_tokens=150)
    stream, first = astream("nataraj", "a card", model_id="tiny", max_new_tokens=150), None
    async for _ in stream:
        first = first or time.perf_counter()
    return (time.perf_counter() - first) / (stream.completion.tokens - 1)


def long_tokens_at(seconds_per_token: float) -> int:
    return max(MIN_LONG_TOKENS, min(MAX_LONG_TOKENS, int(LONG_RUN_S / seconds_per_token)))
