"""What the prefix KV cache buys on the real runtime (issue 11):

    .venv/bin/python benchmarks/kv_cache_bench.py            # the figures, on a quiet machine
    .venv/bin/python benchmarks/kv_cache_bench.py --quick    # proves the script runs (~2.5 min)

Runs on a local Ray, with SmolLM2 as the chat model, once with the cache (the default budget)
and once without (UNIUN_KV_CACHE_MB=0; ``--quick`` skips it):

- **one-line turns** (the issue's goal): a first message of ~950 tokens, then four one-line
  messages, so the 5th turn's history passes 1,000 tokens while only its new line and the chat
  template's tokens are new: its TTFT against a one-message chat's, measured in the same run
  (goal: <= 1.2x);
- **long turns**: each turn a new ~200-token message, so each turn prefills at least that much
  (``--quick`` skips it);
- **two conversations taking turns** (a third local Ray, run by ``--quick`` too) with a device
  budget of ~1.5 histories (sized from the first run's): each turn finds its history pushed out by the other's. On a GPU it moved to
  CPU memory and comes back (a copy, no prefill); on a CPU, the one tier, it was dropped and is
  prefilled again;
- **a Nataraj card revoked by a chat mid-decode** (after its first piece), then resumed, on one
  slot (with free slots a chat joins beside the card and nothing is revoked; every run here is
  one job at a time, so one slot changes no other figure): the
  tokens its resume prefilled and their time, against one decode step (goal: <= one decode
  step); and one with a long prompt revoked 0.5 s in (mid-prefill, on a CPU), whose resume
  reads only what it had not.

Every turn reports its prompt tokens, how many of them were prefilled (the rest came from the
cache) and the engine's time for that, from the runs' own results (``Completion.prefills``);
TTFT is the client's, submit to first piece. Records a row per figure (section "KV cache" of
BENCHMARKS.md), the KV tiers in the rows' words.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from record import Record  # noqa: E402

from uniun_ray.client import Completion, agenerate, astatus, astream, await_generating  # noqa: E402
from uniun_ray.runtime.launch import local_cluster, start  # noqa: E402

#: A user message of about 180 tokens: five turns of it and the replies pass 1,000 tokens.
PARAGRAPH = ("The lighthouse keeper wrote in the log every evening: the wind, the state of the sea, "
             "the ships that passed, the birds that rested on the gallery rail, the oil burned, and "
             "the small repairs of the day. ") * 4
LONG_TURNS = [f"Turn {turn}. {PARAGRAPH} Summarise the log so far." for turn in range(1, 6)]
#: A ~950-token log, then one line per turn: what "the 5th turn of a conversation" usually is.
ONE_LINE_TURNS = [f"Here is a week of the log. {PARAGRAPH * 5} What did the keeper write about?",
                  "Which birds?", "And the ships?", "Was anything repaired?", "Say it in one line."]
#: The other conversation of the tiers row: another log, diverging from the first at its first words.
OTHER_LOG = f"Another keeper kept this log. {PARAGRAPH * 5} What did the keeper write about?"


def prefill(completion: Completion, run: int = 0) -> tuple[int, int, float | None]:
    """(prompt tokens, of those prefilled, prefill seconds) of one run of a completion."""
    record = completion.prefills[run]
    return record["prompt_tokens"], record["prompt_tokens"] - record["cached_tokens"], record["prefill_s"]


async def one_message_ttft(samples: int) -> float:
    await agenerate("chat", "warm up", max_new_tokens=2)
    topics = ("rain", "bread", "owls", "salt", "ropes")[:samples]
    return statistics.median([(await agenerate("chat", f"Say one word about {topic}.", max_new_tokens=8)).ttft_s
                              for topic in topics])


async def kv_stats() -> dict:
    return (await astatus())["engine"]["kv_cache"]


async def turn(messages: list[dict], content: str, answer_tokens: int) -> dict:
    """Send one user message of a conversation (``messages`` gains it and the reply)."""
    messages.append({"role": "user", "content": content})
    reply = await agenerate("chat", messages=list(messages), max_new_tokens=answer_tokens)
    messages.append({"role": "assistant", "content": reply.text})
    prompt, prefilled, seconds = prefill(reply)
    return {"ttft": reply.ttft_s, "prompt": prompt, "prefilled": prefilled, "prefill_s": seconds}


async def conversation(user_turns: list[str], answer_tokens: int) -> list[dict]:
    messages: list[dict] = []
    return [await turn(messages, content, answer_tokens) for content in user_turns]


async def taking_turns(rounds: int, answer_tokens: int) -> dict:
    """Two conversations, one turn each in turn: the tiers row."""
    one, other = [], []
    turns = []
    for content, other_content in list(zip(ONE_LINE_TURNS, [OTHER_LOG] + ONE_LINE_TURNS[1:]))[:rounds]:
        turns += [await turn(one, content, answer_tokens), await turn(other, other_content, answer_tokens)]
    return {"turns": turns, "kv": await kv_stats()}


async def revoked_card(mid: str) -> dict:
    """A Nataraj card revoked by a chat mid-``decode`` (after its first piece) or mid-``prefill``
    (0.5 s into its ~750-token prompt), run to its end: what its resume prefilled, and where the
    revoke landed (a run revoked before the end of its prefill has no prefill time)."""
    prompt = PARAGRAPH * 4 + " Write a long card about it." if mid == "prefill" else "Write a card about the sea."
    card = astream("nataraj", prompt, max_new_tokens=96)
    pieces = card.__aiter__()
    if mid == "decode":
        await pieces.__anext__()
    else:
        first = asyncio.ensure_future(pieces.__anext__())
        assert await await_generating("nataraj"), "no nataraj job got the device"
    chat = asyncio.ensure_future(agenerate("chat", "Say hello.", max_new_tokens=4))   # revokes the card
    if mid == "prefill":
        await first
    async for _ in pieces:
        pass
    await chat
    done = card.completion
    assert done.revokes >= 1 and len(done.prefills) >= 2, f"the card was not revoked: {done}"
    prompt_tokens, prefilled, seconds = prefill(done, -1)
    landed = "mid-decode" if done.prefills[0]["prefill_s"] is not None else "mid-prefill"
    return {"revokes": done.revokes, "prompt": prompt_tokens, "prefilled": prefilled, "prefill_s": seconds,
            "landed": landed}


async def measure(quick: bool) -> dict:
    single = await one_message_ttft(1 if quick else 5)
    answer = 8 if quick else 48
    messages: list[dict] = []
    held_before = (await kv_stats())["held_mb"]
    one_line = [await turn(messages, ONE_LINE_TURNS[0], answer)]
    history_mb = (await kv_stats())["held_mb"] - held_before     # one history's KV; 0 with the cache off
    one_line += [await turn(messages, content, answer) for content in ONE_LINE_TURNS[1:]]
    long = [] if quick else await conversation(LONG_TURNS, answer)
    decode = await revoked_card("decode")
    mid_prefill = await revoked_card("prefill")
    engine = (await astatus())["engine"]
    return {"single": single, "one_line": one_line, "long": long, "decode": decode, "prefill": mid_prefill,
            "engine": engine, "history_mb": history_mb}


def run(kv_cache_mb: str | None, work) -> dict:
    """``work()`` on a fresh local Ray whose ModelActor has this UNIUN_KV_CACHE_MB (None: the
    default), with one slot (a chat then revokes the card it arrives beside)."""
    os.environ["UNIUN_SLOTS"] = "1"
    if kv_cache_mb is None:
        os.environ.pop("UNIUN_KV_CACHE_MB", None)
    else:
        os.environ["UNIUN_KV_CACHE_MB"] = kv_cache_mb
    with local_cluster():
        start()
        return asyncio.run(work())


def uncached(runs: list[dict], cell) -> str:
    """The same figure from the run without the cache, where there was one."""
    return f"; without the cache: {cell(runs[1])}" if len(runs) > 1 else ""


def turn_rows(record: Record, name: str, key: str, runs: list[dict]) -> None:
    for turn in range(len(runs[0][key])):
        def cell(r: dict) -> str:
            t = r[key][turn]
            return f"{t['ttft']:.2f} s ({t['prefilled']} prefilled in {t['prefill_s']:.2f} s)"
        record.row(f"{name}, turn {turn + 1}: TTFT ({runs[0][key][turn]['prompt']:,} prompt tokens)",
                   cell(runs[0]) + uncached(runs, cell))
    if runs[0][key]:
        ratio = runs[0][key][-1]["ttft"] / runs[0]["single"]
        record.row(f"{name}: the last turn's TTFT / a one-message chat's", f"{ratio:.2f}×"
                   + uncached(runs, lambda r: f"{r[key][-1]['ttft'] / r['single']:.2f}×"),
                   **({"goal": "≤ 1.2× (issue 11)", "met": ratio <= 1.2} if key == "one_line" else {}))


def card_row(record: Record, name: str, key: str, runs: list[dict], **goal) -> None:
    def cell(r: dict) -> str:
        card, step_ms = r[key], r["engine"]["decode_ms"]
        seconds = "" if card["prefill_s"] is None else f", {card['prefill_s'] * 1000:.0f} ms = " \
                                                        f"{card['prefill_s'] * 1000 / step_ms:.1f} decode steps"
        return f"{card['prefilled']} of {card['prompt']} tokens{seconds} ({card['revokes']} revoke, {card['landed']})"
    record.row(name, cell(runs[0]) + uncached(runs, cell), **goal)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="short answers, one conversation, no uncached run: proves the script works")
    args = ap.parse_args()
    runs = [run(None, lambda: measure(args.quick))] + ([] if args.quick else [run("0", lambda: measure(args.quick))])
    budget = str(math.ceil(1.5 * runs[0]["history_mb"]))
    tiers = run(budget, lambda: taking_turns(2 if args.quick else 3, 8 if args.quick else 48))
    engine = runs[0]["engine"]
    record = Record("kv-cache", quick=args.quick)
    record.runs_on(threads=engine["threads"], dtype=engine["dtype"], engine=f"transformers, KV tiers: "
                   f"{engine['kv_cache']['tiers'].split(':')[0]}")
    record.row(f"one-message chat TTFT, {engine['model']} (p50)",
               f"{runs[0]['single']:.2f} s" + uncached(runs, lambda r: f"{r['single']:.2f} s"))
    turn_rows(record, "one-line turns", "one_line", runs)
    turn_rows(record, "long turns (~200 new tokens each)", "long", runs)
    decode = runs[0]["decode"]
    card_row(record, "a Nataraj card revoked by a chat mid-decode (one slot): what its resume prefilled", "decode", runs,
             goal="≤ one decode step (issue 11)",
             met=decode["prefill_s"] is not None and decode["prefill_s"] * 1000 <= engine["decode_ms"])
    card_row(record, "a card with a ~750-token prompt revoked 0.5 s in (one slot): what its resume prefilled", "prefill",
             runs)
    kv = tiers["kv"]
    record.row(f"two conversations taking turns, UNIUN_KV_CACHE_MB={budget} (~1.5 histories of "
               f"{runs[0]['history_mb']:.0f} MB): prefilled per turn",
               ", ".join(f"{'AB'[n % 2]}{n // 2 + 1} {t['prefilled']} of {t['prompt']}" for n, t in enumerate(tiers["turns"]))
               + f"; {kv['offloads']} offloads, {kv['restores']} restores, {kv['evictions']} evictions")
    record.save()


if __name__ == "__main__":
    main()
