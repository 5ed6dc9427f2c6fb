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

from .client import agenerate, await_generating
from .producers import spawn_producer
from .runtime.launch import local_cluster, start

PROMPT = "Reply with one friendly sentence."


async def measure(turns: int, deck: int, card_tokens: int, chat_tokens: int) -> dict:
    await agenerate("chat", "warm up", max_new_tokens=2)   # the first load is not what we measure
    idle = [(await agenerate("chat", PROMPT, max_new_tokens=chat_tokens)).ttft_s for _ in range(turns)]
    producer = spawn_producer("nataraj", "demo", deck_size=deck, max_new_tokens=card_tokens)
    await producer.open_page.remote()                      # the user is on the deck page
    busy = []
    try:
        for _ in range(turns):
            if not await await_generating("nataraj"):
                break
            busy.append((await agenerate("chat", PROMPT, max_new_tokens=chat_tokens)).ttft_s)
        card = await producer.take_card.remote() if await producer.wait_deck.remote(1, timeout_s=300) else None
        state = await producer.state.remote()
    finally:
        await producer.stop.remote()
    return {"idle": idle, "busy": busy, "nataraj": state, "card": card}


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

    with local_cluster(dashboard=True) as context:
        print(f"Ray dashboard: http://{context.dashboard_url}  (actors: scheduler, model:cpu0, "
              f"embedder, producer:nataraj:demo)")
        events = ray.get(start().scheduler.status.remote())["event_log"]
        print(f"watch it: uniun-ray status --watch --address {context.address_info['gcs_address']}\n"
              f"event log: {events}  (uniun-ray explain JOB_ID)")
        print("Loading the chat model (the first run converts it once, ~20 s)...", flush=True)
        r = asyncio.run(measure(args.turns, args.deck, args.card_tokens, args.chat_tokens))
        sim = simulated_two_lane()

    def show(values):
        return f"p50 {statistics.median(values):6.2f} s   max {max(values):6.2f} s   (n={len(values)})"
    print()
    print(f"chat TTFT, device idle:               {show(r['idle'])}")
    print(f"chat TTFT, while Nataraj fills:       {show(r['busy'])}")
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
