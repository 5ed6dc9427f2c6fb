"""`make demo`: the issue-118 moment on real Ray and the embedded models.

Starts a private local Ray (dashboard on 127.0.0.1, printed), creates the actors, measures
chat's time to first token with the device idle, then again while Nataraj fills its deck on
the same model, and prints both beside what the simulator predicts for the old two-lane
queue on the issue-118 workload. It stops only the Ray it started.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import ray

from .client import agenerate, astatus
from .runtime.launch import LOCAL_RESOURCES, ensure_auth_mode, start
from .runtime.producers import spawn_producer
from .runtime.protocol import NAMESPACE

PROMPT = "Reply with one friendly sentence."


async def nataraj_generating(timeout_s: float = 120.0) -> bool:
    """Wait until a nataraj job has held a granted lease for a while (so a chat sent now
    preempts a generation, not a model load); False if none does within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await astatus()
        running = status["running"]
        if running and running["kind"] == "nataraj":
            if status["leases"].get(running["id"], {}).get("held_s", 0) > 0.5:
                return True
        await asyncio.sleep(0.05)
    return False


async def measure(turns: int, deck: int, card_tokens: int, chat_tokens: int, http_url: str | None = None) -> dict:
    await agenerate("chat", "warm up", max_new_tokens=2)   # the first load is not what we measure
    idle = [(await agenerate("chat", PROMPT, max_new_tokens=chat_tokens)).ttft_s for _ in range(turns)]
    producer = spawn_producer("nataraj", "demo", deck_size=deck, max_new_tokens=card_tokens)
    await producer.open_page.remote()                      # the user is on the deck page
    busy = []
    try:
        for _ in range(turns):
            if not await nataraj_generating():
                break
            busy.append((await agenerate("chat", PROMPT, max_new_tokens=chat_tokens)).ttft_s)
        http = None   # one chat over the OpenAI-compatible endpoint, as any HTTP client sends it
        if http_url and await nataraj_generating():
            from .http.measure import stream_ttft
            http = (await asyncio.to_thread(stream_ttft, http_url, {
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": chat_tokens}))[0]
        card = await producer.take_card.remote() if await producer.wait_deck.remote(1, timeout_s=300) else None
        state = await producer.state.remote()
    finally:
        await producer.stop.remote()
    return {"idle": idle, "busy": busy, "nataraj": state, "card": card, "http": http}


def simulated_two_lane() -> dict[str, float]:
    """Chat TTFT p50 on the issue-118 workload, simulated: old two-lane queue vs this policy."""
    from .policy import SchedulerPolicy
    from .sim.baselines import TwoLaneQueue
    from .sim.metrics import measure as score
    from .sim.simulator import simulate
    from .sim.workloads import generate

    workload = generate("issue118", 1)
    return {name: score(simulate(policy(), workload).events).ttft_p50
            for name, policy in (("two-lane", TwoLaneQueue), ("uniun", SchedulerPolicy))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--deck", type=int, default=3)
    ap.add_argument("--card-tokens", type=int, default=96)
    ap.add_argument("--chat-tokens", type=int, default=12)
    args = ap.parse_args(argv)

    ensure_auth_mode()
    context = ray.init(address="local", namespace=NAMESPACE, resources=LOCAL_RESOURCES,
                       include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=False)
    try:
        print(f"Ray dashboard: http://{context.dashboard_url}  (actors: scheduler, model:cpu0, "
              f"embedder, producer:nataraj:demo)")
        events = ray.get(start().scheduler.status.remote())["event_log"]
        print(f"watch it: uniun-ray status --watch --address {context.address_info['gcs_address']}\n"
              f"event log: {events}  (uniun-ray explain JOB_ID)")
        from .http import deploy
        from .http.measure import free_port
        http_url = deploy(port=free_port())
        print(f"OpenAI-compatible endpoint: {http_url}/v1")
        print("Loading the chat model (the first run converts it once, ~20 s)...", flush=True)
        r = asyncio.run(measure(args.turns, args.deck, args.card_tokens, args.chat_tokens, http_url))
        sim = simulated_two_lane()
    finally:
        ray.shutdown()

    def show(values):
        return f"p50 {statistics.median(values):6.2f} s   max {max(values):6.2f} s   (n={len(values)})"
    print()
    print(f"chat TTFT, device idle:               {show(r['idle'])}")
    print(f"chat TTFT, while Nataraj fills:       {show(r['busy'])}")
    if r["http"] is not None:
        print(f"chat TTFT over HTTP, while Nataraj fills: {r['http']:6.2f} s   (POST /v1/chat/completions, streamed)")
    card = r["card"]
    if card:
        print(f"Nataraj's first card: {len(card['text'])} characters, revoked {card['revokes']}× by those chats "
              f"and resumed each time from its own tokens; deck {r['nataraj']['deck']}")
    print()
    print("The same moment, simulated on the issue-118 workload (uniun-ray bench):")
    print(f"  old two-lane queue: chat TTFT p50 {sim['two-lane']:6.2f} s   "
          f"this scheduler: {sim['uniun']:6.2f} s")


if __name__ == "__main__":
    main()
