"""A Ray cluster for real (issue 29): nodes that join, a node that dies, nothing lost. Run by
tests/test_cluster_nodes.py in a subprocess: it needs real nodes of its own (tests/ray_nodes.py).

    python tests/cluster_scenario.py

1. The head (one stand-in device, cpu0) and the runtime; then a worker, w1, joins with two
   devices: the scheduler hears of it from Ray and adds cpu1 and cpu2.
2. Work on every node's devices: three short Natarajs at once, one per device (they time the
   model's tokens, so that the runs of phase 3 last a few seconds on any host).
3. A Gana holds cpu0; a long Nataraj generates on one of w1's devices and a chat streams from
   the other; short jobs queue behind them. Then w1 dies (SIGKILL to its raylet, its workers,
   everything): Ray marks it dead, its devices leave the pool, the Gana lets go, and the chat,
   the Nataraj and every queued job complete on cpu0, each once, the chat and the Nataraj
   from the tokens they had.
4. A worker, w2, joins with one device: it is added at once and takes work.
Prints one JSON line: times, completions, statuses and the event log, for the test to assert on.

The model is SmolLM2-135M, not `tiny`: tiny's longest run (its context) takes ~2 s here, and the
chat and the long Nataraj must both still be generating when the node dies, whatever the host's
load (the kill comes a second or so after they start). Every device holds it from phase 2 on:
no swap delays either of them.
"""
from __future__ import annotations

import asyncio
import json
import time

import ray

from uniun_ray.client import agenerate, arun, astatus, astream
from uniun_ray.events.log import read
from uniun_ray.runtime.service import RuntimeConfig

from ray_nodes import LocalNodes
from waits import STARTED_TIMEOUT_S, pool_of, started, until

#: The model, how long the runs that the dying node takes down would last (the kill comes a
#: second or so after they start; their length in tokens, from phase 2's pace, within bounds),
#: and what the chat and the Nataraj ask (their answers run long: a short one could end first).
MODEL, RUN_S, MIN_LONG, MAX_LONG = "smollm2-135m-instruct", 3.0, 32, 400
QUESTION = "Tell me a long story about a dragon who learns to cook."
CARD = "Write a long card on the history of the printing press."
#: Short jobs queued behind the busy pool when w1 dies (and the other work), and their length.
QUEUED, SHORT = 6, 8


def completion(c) -> dict:
    return {"job": c.job_id, "tokens": c.tokens, "revokes": c.revokes, "text": c.text}


async def streamed(stream, before: asyncio.Event, first: asyncio.Event) -> dict:
    """Consume a stream; `first` is set at its first piece; what came before `before` was set is
    kept apart (the tokens a run had when its node died)."""
    early, late = [], []
    async for piece in stream:
        (late if before.is_set() else early).append(piece)
        first.set()
    return completion(stream.completion) | {"before_kill": "".join(early), "after_kill": "".join(late)}


async def kill_under_load(w1, long: int) -> dict:
    """Phase 3: the Gana on cpu0, the Nataraj and the chat on w1, queued work; w1 dies."""
    out, release, killed = {}, asyncio.Event(), asyncio.Event()

    async def hold(lease):
        await lease.agenerate("warm", max_new_tokens=2)
        await release.wait()
        return lease.lease.device

    gana = asyncio.ensure_future(arun("gana", MODEL, hold, producer="gana:hold"))
    out["gana_device"] = (await started("gana"))["device"]
    card_first, chat_first = asyncio.Event(), asyncio.Event()
    card = asyncio.ensure_future(streamed(astream("nataraj", CARD, model_id=MODEL, max_new_tokens=long),
                                          killed, card_first))
    out["card_device"] = (await started("nataraj"))["device"]
    chat = asyncio.ensure_future(streamed(astream("chat", QUESTION, model_id=MODEL, max_new_tokens=long),
                                          killed, chat_first))
    await asyncio.wait_for(chat_first.wait(), STARTED_TIMEOUT_S)
    queued = [asyncio.ensure_future(agenerate("nataraj", f"queued {i}", model_id=MODEL, max_new_tokens=SHORT,
                                              producer="nataraj:queued")) for i in range(QUEUED)]

    async def all_queued():
        status = await astatus()
        return status if status["queued"] >= QUEUED else None
    out["before_kill"] = await until(all_queued, f"{QUEUED} jobs queued")
    killed.set()
    out["killed_at"] = w1.kill()
    release.set()                       # cpu0 is free for what the dead node ran and what waits
    out["gana_end"] = await gana
    out["card"], out["chat"] = await card, await chat
    out["queued"] = [completion(c) for c in await asyncio.gather(*queued)]
    out["after_kill"] = await astatus()
    return out


async def scenario(nodes: LocalNodes, w1) -> dict:
    out, began = {"phases_s": {}}, time.monotonic()

    def phase(name: str) -> None:   # for the report: where this test spends its time
        out["phases_s"][name] = round(time.monotonic() - began, 1)
    out["joined"] = await pool_of(3)
    phase("w1's devices added and started")
    on_all = await asyncio.gather(*(agenerate("nataraj", f"card {i}", model_id=MODEL, max_new_tokens=SHORT,
                                              producer="nataraj:all") for i in range(3)))
    out["on_all"] = [completion(c) for c in on_all]
    pace = max((c.total_s - c.ttft_s) / (c.tokens - 1) for c in on_all)
    long = out["long"] = min(MAX_LONG, max(MIN_LONG, int(RUN_S / pace)))
    phase("work on every device")
    out |= await kill_under_load(w1, long)
    phase("w1 killed, its work done on the head")

    before = {n["NodeID"] for n in ray.nodes()}
    nodes.join(devices=1)
    out["w2_started_at"] = time.time()
    out["w2"] = next(n["NodeID"] for n in ray.nodes() if n["NodeID"] not in before)
    await pool_of(2, located=False)
    out["w2_pool_at"] = time.time()
    takes = await asyncio.gather(*(agenerate("nataraj", f"new {i}", model_id=MODEL, max_new_tokens=SHORT,
                                             producer="nataraj:new") for i in range(2)))
    out["new_work"] = [completion(c) for c in takes]
    out["final"] = await pool_of(2)
    phase("w2 joined and took work")
    out["events"] = read(out["final"]["event_log"])
    return out


def main() -> None:
    began, setup = time.monotonic(), {}

    def step(name: str) -> None:
        setup[name] = round(time.monotonic() - began, 1)
    with LocalNodes() as nodes:
        nodes.head(devices=1)
        step("head")
        head = nodes.start_runtime(RuntimeConfig(lease_timeout_s=5.0, waiter_timeout_s=5.0, reap_period_s=0.2, slots=1))
        step("runtime")
        w1 = nodes.join(devices=2)
        step("w1 joined")
        w1_id = next(n["NodeID"] for n in ray.nodes() if n["NodeID"] != head)
        out = asyncio.run(scenario(nodes, w1))
        ray.shutdown()
    step("done")
    print(json.dumps(out | {"head": head, "w1": w1_id, "setup_s": setup}, default=str))


if __name__ == "__main__":
    main()
