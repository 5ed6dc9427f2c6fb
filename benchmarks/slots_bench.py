"""Slots on the real runtime (issue 25, SPEC §6): what a device with several slots gives, on a
local Ray with the chat model, measured through the client, in one run:

    .venv/bin/python benchmarks/slots_bench.py                 # slots auto against slots 1
    .venv/bin/python benchmarks/slots_bench.py --quick         # shorter windows, fewer chats

- background tokens/s: `--streams` background streams (Nataraj pages of `--tokens`, each sent
  again as it ends) for `--window` seconds, with the scheduler at slots 1, then at "auto" (the
  scheduler is made anew between, the ModelActor and its loaded model kept), the ratio taken in
  the same run;
- a chat while every slot is busy against the chat on an idle device: time to first token
  (submit to first piece, client side) and time per token after it (R23's bound: ≤ the larger
  of 1.25x alone and 75 ms), each the median of `--chats` chats; the device's step at the batch it ran, from the
  step profile, says what "one step" is.

Records a row per figure (`record.py`, section "slots").
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from record import Record  # noqa: E402

from uniun_ray.client import agenerate, astatus, await_generating  # noqa: E402
from uniun_ray.policy import PolicyConfig  # noqa: E402
from uniun_ray.runtime.launch import forget_handles, local_cluster, start  # noqa: E402
from uniun_ray.runtime.protocol import NAMESPACE, SCHEDULER_NAME  # noqa: E402
from uniun_ray.runtime.service import RuntimeConfig  # noqa: E402

CHAT = "smollm2-135m-instruct"
STORY = "Write a long story about the sea, with many details."


def fresh_scheduler(slots: int | None) -> None:
    """A new scheduler with `slots` (None: auto) beside the kept ModelActor."""
    try:
        ray.kill(ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE), no_restart=True)
        time.sleep(1.0)
    except ValueError:
        pass
    forget_handles()
    start(RuntimeConfig(slots=slots))


async def background(streams: int, tokens: int, window: float) -> tuple[float, list]:
    """Tokens/s of `streams` Nataraj streams over `window` seconds: the runs that ended within it
    (short runs, so the one each stream has going at the end costs little)."""
    made, stop = [], time.perf_counter() + window

    async def one(i: int) -> None:
        while time.perf_counter() < stop:
            done = await agenerate("nataraj", STORY, model_id=CHAT, producer=f"nataraj:{i}", max_new_tokens=tokens)
            made.append(done.tokens)
    started = time.perf_counter()
    tasks = [asyncio.ensure_future(one(i)) for i in range(streams)]
    await asyncio.sleep(window)
    status = await astatus()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return sum(made) / (time.perf_counter() - started), status["devices"]


async def chats(n: int, tokens: int) -> tuple[float, float]:
    """Median TTFT and median seconds per token after the first, over `n` chats in a row."""
    ttfts, per_token = [], []
    for i in range(n):
        done = await agenerate("chat", f"Say something kind, number {i}.", model_id=CHAT, max_new_tokens=tokens)
        ttfts.append(done.ttft_s)
        if done.tokens > 1:
            per_token.append((done.total_s - done.ttft_s) / (done.tokens - 1))
    return statistics.median(ttfts), statistics.median(per_token)


async def busy_chats(slots: int, n: int, tokens: int) -> tuple[float, float, float]:
    """The chats while `slots` long Nataraj pages hold every slot; and the mean batch the chats ran in."""
    pages = [asyncio.ensure_future(agenerate("nataraj", STORY, model_id=CHAT, producer=f"nataraj:p{i}",
                                             max_new_tokens=4000)) for i in range(slots)]
    await await_generating("nataraj", timeout_s=300, min_held_s=1.0)
    await asyncio.sleep(2.0)
    result = await chats(n, tokens)
    for page in pages:
        page.cancel()
    await asyncio.gather(*pages, return_exceptions=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--chats", type=int, default=7)
    ap.add_argument("--chat-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.window, args.chats = 30.0, 3
    record = Record("slots", quick=args.quick)
    with local_cluster():
        fresh_scheduler(1)
        asyncio.run(agenerate("chat", "hi", model_id=CHAT, max_new_tokens=2))    # load, probe
        one, _ = asyncio.run(background(args.streams, args.tokens, args.window))
        fresh_scheduler(None)
        asyncio.run(agenerate("chat", "hi", model_id=CHAT, max_new_tokens=2))
        auto, devices = asyncio.run(background(args.streams, args.tokens, args.window))
        slots, profile = devices[0]["slots"], devices[0]["step_profile"] or {}
        idle = asyncio.run(chats(args.chats, args.chat_tokens))
        busy = asyncio.run(busy_chats(slots, args.chats, args.chat_tokens))
    step = {int(b): s for b, s in profile.items()}
    record.runs_on(engine="transformers")
    record.row(f"{CHAT}: slot count chosen (auto) and the step profile, ms per step by batch",
               f"{slots}; " + ", ".join(f"{b}: {s * 1e3:.0f}" for b, s in sorted(step.items())))
    record.row(f"background tokens/s, {args.streams} Nataraj streams, slots 1", f"{one:.1f}")
    record.row(f"the same at slots auto ({slots})", f"{auto:.1f}")
    gain = auto / one if one else float("inf")
    record.row("background tokens/s, slots auto / slots 1", f"{gain:.2f}×", goal="≥ 1.8× (issue 25)", met=gain >= 1.8)
    budget = idle[0] + max(step.values(), default=0.0) + 0.05
    record.row(f"chat TTFT, idle / every slot busy (median of {args.chats})", f"{idle[0] * 1e3:.0f} / "
               f"{busy[0] * 1e3:.0f} ms", goal="busy ≤ idle + one step + 50 ms (issue 25)", met=busy[0] <= budget)
    r23 = PolicyConfig()
    bound = max(r23.chat_step_slack * idle[1], r23.chat_step_floor_s)
    record.row("chat time per token after the first, alone / every slot busy", f"{idle[1] * 1e3:.1f} / "
               f"{busy[1] * 1e3:.1f} ms ({busy[1] / idle[1]:.2f}×)",
               goal=f"≤ max({r23.chat_step_slack}× alone, {r23.chat_step_floor_s * 1e3:.0f} ms) (R23)",
               met=busy[1] <= bound)
    record.save()


if __name__ == "__main__":
    main()
