"""What the prefix KV cache buys on the real runtime (issue 11):

    .venv/bin/python benchmarks/kv_cache_bench.py [--turns 5]

Runs twice on a local Ray, once with the cache (the default budget) and once without
(UNIUN_KV_CACHE_MB=0), with SmolLM2 as the chat model:

- a conversation of ``--turns`` turns whose history grows past 1,000 tokens: chat TTFT per turn,
  against a one-message chat's TTFT (goal: the last turn <= 1.2x the one-message chat);
- a Nataraj card revoked by a chat, then resumed: the prompt tokens its resume prefilled and
  their time, against one decode step (goal: <= one decode step).

Prints a markdown table, with the host (CPU model, torch capability, threads, dtype).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from uniun_ray.client import agenerate, astatus, await_generating  # noqa: E402
from uniun_ray.models.tuning import cpu_model  # noqa: E402
from uniun_ray.runtime.launch import local_cluster, start  # noqa: E402

#: A user message of about 230 tokens: five turns of it and the replies pass 1,000 tokens.
PARAGRAPH = ("The lighthouse keeper wrote in the log every evening: the wind, the state of the sea, "
             "the ships that passed, the birds that rested on the gallery rail, the oil burned, and "
             "the small repairs of the day. ") * 4


async def kv_stats() -> dict:
    return (await astatus())["engine"]["kv_cache"]


async def conversation(turns: int) -> dict:
    await agenerate("chat", "warm up", max_new_tokens=2)
    single = [(await agenerate("chat", f"Say one word about {topic}.", max_new_tokens=8)).ttft_s
              for topic in ("rain", "bread", "owls")]
    messages, ttfts, prompt_tokens = [], [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn + 1}. {PARAGRAPH} Summarise the log so far."})
        before = await kv_stats()
        reply = await agenerate("chat", messages=list(messages), max_new_tokens=48)
        after = await kv_stats()
        ttfts.append(reply.ttft_s)
        prompt_tokens.append((after["prefilled_tokens"] + after["reused_tokens"])
                             - (before["prefilled_tokens"] + before["reused_tokens"]))
        messages.append({"role": "assistant", "content": reply.text})
    return {"single": statistics.median(single), "turns": ttfts, "history_tokens": prompt_tokens}


async def resume() -> dict:
    card = asyncio.ensure_future(agenerate("nataraj", PARAGRAPH + " Write a long card about it.",
                                           max_new_tokens=160))
    assert await await_generating("nataraj"), "no nataraj job got the device"
    await agenerate("chat", "Say hello.", max_new_tokens=4)        # revokes the card
    before = await kv_stats()
    done = await card                                                # its resume runs to the end
    after = await kv_stats()
    return {"revokes": done.revokes, "resume_prefilled": after["prefilled_tokens"] - before["prefilled_tokens"],
            "resume_reused": after["reused_tokens"] - before["reused_tokens"]}


def run(turns: int, kv_cache_mb: str | None) -> dict:
    if kv_cache_mb is None:
        os.environ.pop("UNIUN_KV_CACHE_MB", None)
    else:
        os.environ["UNIUN_KV_CACHE_MB"] = kv_cache_mb
    with local_cluster():
        start()
        talk = asyncio.run(conversation(turns))
        card = asyncio.run(resume())
        engine = asyncio.run(astatus())["engine"]
    return {"talk": talk, "card": card, "engine": engine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    cached, uncached = run(args.turns, None), run(args.turns, "0")
    engine = cached["engine"]
    print(f"{platform.machine()}, {cpu_model()}, torch CPU capability {engine['cpu_capability']}, "
          f"{engine['threads']} threads, {engine['model']} in {engine['dtype']} "
          f"(decode {engine['decode_ms']:.0f} ms/token); --turns {args.turns}\n")
    print("| measurement | with the prefix cache | without (UNIUN_KV_CACHE_MB=0) |")
    print("|---|---|---|")
    for name, key in (("one-message chat TTFT (p50 of 3)", "single"),):
        print(f"| {name} | {cached['talk'][key]:.2f} s | {uncached['talk'][key]:.2f} s |")
    for turn, (a, b) in enumerate(zip(cached["talk"]["turns"], uncached["talk"]["turns"]), 1):
        tokens = cached["talk"]["history_tokens"][turn - 1]
        print(f"| turn {turn} TTFT ({tokens} prompt tokens) | {a:.2f} s | {b:.2f} s |")
    last = cached["talk"]["turns"][-1] / cached["talk"]["single"]
    print(f"| last turn / one-message chat (goal <= 1.2x) | {last:.2f}x | "
          f"{uncached['talk']['turns'][-1] / uncached['talk']['single']:.2f}x |")
    a, b = cached["card"], uncached["card"]
    print(f"| Nataraj card's resume after a chat's revoke: prompt tokens prefilled / reused "
          f"(goal: <= one decode step of prefill) | {a['resume_prefilled']} / {a['resume_reused']} "
          f"({a['revokes']} revoke) | {b['resume_prefilled']} / {b['resume_reused']} ({b['revokes']} revoke) |")


if __name__ == "__main__":
    main()
