"""The pool of devices on a real, private local Ray with two stand-in devices (run by
tests/test_pool_runtime.py in a subprocess: the session's cluster declares one device).

    python tests/pool_scenario.py

Real models on both devices: `tiny` and `smollm2-135m-instruct`. In order:
1. a Gana holds `model:cpuX` with smollm2 while a Nataraj generates with tiny on the other
   device: two jobs on two models at once;
2. a chat (tiny) arrives while both are busy: exactly one of them is revoked (the Nataraj,
   which holds the chat's model, R18), the chat runs, the Nataraj resumes and completes;
3. the Gana lets go; a second Nataraj generates with tiny, and its ModelActor is killed for
   good: the job is re-queued and completes on the other device, and the scheduler creates
   a new ModelActor for the seat that freed up.
Prints one JSON line: the statuses, completions and event log the test asserts on.
"""
from __future__ import annotations

import asyncio
import json
import time

import ray

from uniun_ray.client import agenerate, arun, astatus
from uniun_ray.events.log import read
from uniun_ray.runtime.launch import local_cluster, start
from uniun_ray.runtime.protocol import NAMESPACE, model_actor_name
from uniun_ray.runtime.service import RuntimeConfig

from long_run import long_tokens_at, tiny_seconds_per_token
from waits import started


def completion(c) -> dict:
    return {"job": c.job_id, "tokens": c.tokens, "revokes": c.revokes, "text": bool(c.text.strip())}


async def scenario() -> dict:
    # tiny tokens that take seconds here, long enough to be revoked or killed mid-way
    long = long_tokens_at(await tiny_seconds_per_token())
    out, began = {"phases_s": {}, "long": long}, time.monotonic()

    def phase(name: str) -> None:   # for the report: where this slow test spends its time
        out["phases_s"][name] = round(time.monotonic() - began, 1)
    release = asyncio.Event()

    async def hold(lease):
        await lease.agenerate("warm", max_new_tokens=2)   # the model answers on this device
        await release.wait()
        return lease.lease.device

    gana = asyncio.ensure_future(arun("gana", "smollm2-135m-instruct", hold, producer="gana:g"))
    await started("gana")
    card = asyncio.ensure_future(agenerate("nataraj", "a card", model_id="tiny", max_new_tokens=long))
    await started("nataraj")
    out["both_busy"] = await astatus()
    phase("both busy")
    chat = await agenerate("chat", "hello", model_id="tiny", max_new_tokens=16)
    out["chat"], out["card"] = completion(chat), completion(await card)
    release.set()
    out["gana_device"] = await gana
    phase("chat served, card resumed and done")

    second = asyncio.ensure_future(agenerate("nataraj", "another card", model_id="tiny", max_new_tokens=long))
    victim = (await started("nataraj"))["device"]
    ray.kill(ray.get_actor(model_actor_name(victim), namespace=NAMESPACE), no_restart=True)
    out["killed"], out["second"] = victim, completion(await asyncio.wait_for(second, 300))
    phase("killed device's job done elsewhere")
    deadline = time.monotonic() + 120         # the freed seat gets a new ModelActor (importing torch)
    while len((await astatus())["devices"]) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    out["healed"] = await astatus()
    phase("pool healed")
    out["events"] = read(out["healed"]["event_log"])
    return out


def main() -> None:
    with local_cluster(devices=2, object_store_memory=80 * 1024 * 1024):
        began = time.monotonic()
        start(RuntimeConfig(lease_timeout_s=5.0, waiter_timeout_s=5.0, reap_period_s=0.2, slots=1))
        start_s = time.monotonic() - began
        out = asyncio.run(scenario())
        out["wall_s"], out["start_s"] = time.monotonic() - began, start_s
        out["model_actors"] = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                                     if a["name"].startswith(model_actor_name("")))
        print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
