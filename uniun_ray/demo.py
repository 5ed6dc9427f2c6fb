"""`make demo`: the issue-118 moment on real Ray and the embedded models.

First measures the bare engine's best time to first token for the chat prompt, in this
process, before Ray starts (the floor the runtime is judged against). Then starts a private
local Ray (dashboard on 127.0.0.1, printed), creates the actors, measures chat's time to first
token with the device idle, then again while Nataraj fills its deck on the same model, and
prints them beside what the simulator predicts for the old two-lane queue on the issue-118
workload. It stops only the Ray it started.
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import threading

import ray

from .client import agenerate, await_generating
from .models import DEFAULT_CHAT_MODEL
from .settings import ENGINES, Settings
from .producers import spawn_producer
from .runtime.launch import local_cluster, start
from .runtime.protocol import model_actor_name

PROMPT = "Reply with one friendly sentence about {topic}."
TOPICS = ("the sea", "lighthouses", "autumn", "bread", "trains", "owls", "rain", "maps", "tea", "bees")


def prompts(turns: int) -> list[str]:
    """A new message each turn, as in a conversation: the chat template's prefix is cached (the
    prefix cache), the message itself is prefilled. The bare engine gets the same list."""
    return [PROMPT.format(topic=TOPICS[i % len(TOPICS)]) for i in range(turns)]


async def measure(turns: int, deck: int, card_tokens: int, chat_tokens: int, http_url: str | None = None) -> dict:
    await agenerate("chat", "warm up", max_new_tokens=2)   # the first load is not what we measure
    idle_runs = [await agenerate("chat", prompt, max_new_tokens=chat_tokens) for prompt in prompts(turns)]
    idle = [done.ttft_s for done in idle_runs]
    idle_prefill = [done.prefills[0]["prefill_s"] for done in idle_runs]
    producer = spawn_producer("nataraj", "demo", deck_size=deck, max_new_tokens=card_tokens, parallel=deck)
    await producer.open_page.remote()                      # the user is on the deck page
    busy, shared = [], []
    try:
        for prompt in prompts(turns):
            if not await await_generating("nataraj"):
                break
            done = await agenerate("chat", prompt, max_new_tokens=chat_tokens)
            busy.append(done.ttft_s)
            shared.append(max(run["mean_batch"] or 1.0 for run in done.prefills))
        http = None   # one chat over the OpenAI-compatible endpoint, as any HTTP client sends it
        if http_url and await await_generating("nataraj"):
            from .http.measure import stream_ttft
            http = (await asyncio.to_thread(stream_ttft, http_url, {
                "messages": [{"role": "user", "content": prompts(1)[0]}], "max_tokens": chat_tokens}))[0]
        card = await producer.take_card.remote() if await producer.wait_deck.remote(1, timeout_s=300) else None
        state = await producer.state.remote()
    finally:
        await producer.stop.remote()
    return {"idle": idle, "idle_prefill": idle_prefill, "busy": busy, "shared": shared, "nataraj": state,
            "card": card, "http": http}


def bare_engine(turns: int, chat_tokens: int, settings: Settings) -> dict:
    """The engine alone, as the ModelActor configures it (``settings``: UNIUN_DTYPE, UNIUN_THREADS...,
    else the host's measured choice): its TTFTs for the demo's chat prompt, and its host choices."""
    import gc

    from .models import Engine, GenerateRequest, generate

    engine = Engine(settings=settings.engine_settings)
    engine.load(DEFAULT_CHAT_MODEL)
    ttfts, prefills = [], []
    for prompt in ["warm up"] + prompts(turns):
        generation = generate(engine, GenerateRequest(prompt=prompt, max_new_tokens=chat_tokens),
                              cancel=threading.Event(), revocable=False)   # as a chat lease runs
        for _piece in generation:
            pass
        ttfts.append(generation.result.ttft_s)
        prefills.append(generation.result.prefill_s)
    described = engine.describe()
    engine.unload()
    del engine
    gc.collect()
    return {"ttft": ttfts[1:], "prefill": prefills[1:], "engine": described}


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


def main(argv: list[str] | None = None) -> dict:
    """Prints the figures, and returns them (benchmarks/demo_bench.py records them)."""
    args = _arguments(argv)
    settings = Settings.load(flags={"engine": args.engine})   # a bad setting fails here, before anything runs
    print("Measuring the bare engine on this host (the first run converts the chat model once, "
          "~20 s, and measures its dtypes)...", flush=True)
    bare = bare_engine(args.turns, args.chat_tokens, settings)
    host = bare["engine"]
    print(f"host: {platform.machine()}, torch CPU capability {host['cpu_capability']}, "
          f"{host['threads']} threads; {DEFAULT_CHAT_MODEL} runs in {host['dtype']} "
          f"(decode {host['decode_ms']:.0f} ms/token, prefill chunk {host['prefill_chunk']} tokens)")
    runtime, pool, steps = _on_ray(args, settings)
    _report(bare, runtime, pool, steps, simulated_two_lane())
    return {"bare": bare, "runtime": runtime}


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--deck", type=int, default=3)
    ap.add_argument("--card-tokens", type=int, default=96)
    ap.add_argument("--chat-tokens", type=int, default=12)
    ap.add_argument("--devices", type=int, default=1,
                    help="stand-in devices on a CPU machine (every GPU is a device anyway); with 2 or more, "
                         "Nataraj fills on one while chat takes another")
    ap.add_argument("--engine", choices=ENGINES,
                    help="what runs the device's forward passes (UNIUN_ENGINE; vllm needs `make install-vllm` "
                         "and starts a server at the first load: minutes on a CPU). The bare figures stay "
                         "the transformers engine's (default: UNIUN_ENGINE, else transformers)")
    return ap.parse_args(argv)


def _on_ray(args: argparse.Namespace, settings: Settings) -> tuple[dict, list[dict], dict]:
    """The runtime's figures on a local Ray (`measure`), then each device's status and the
    step profile the first one served (`settings`: `start` hands them to the ModelActors)."""
    with local_cluster(dashboard=True, devices=args.devices) as context:
        status = ray.get(start(settings=settings).scheduler.status.remote())
        devices = [d["device"] for d in status["devices"]]
        models = ", ".join(model_actor_name(d) for d in devices)
        print(f"Ray dashboard: http://{context.dashboard_url}  (actors: scheduler, {models}, "
              f"embedder, producer:nataraj:demo)")
        events = status["event_log"]
        print(f"watch it: uniun-ray status --watch --address {context.address_info['gcs_address']}\n"
              f"event log: {events}  (uniun-ray explain JOB_ID)")
        from .http import deploy
        from .http.measure import free_port
        http_url = deploy(port=free_port())
        print(f"OpenAI-compatible endpoint and live page: {http_url}/v1, {http_url}/")
        print(f"Loading the chat model into the ModelActor ({args.engine} engine)...", flush=True)
        r = asyncio.run(measure(args.turns, args.deck, args.card_tokens, args.chat_tokens, http_url))
        pool = ray.get(start().scheduler.status.remote())["devices"]
        steps = ray.get(start().model.state.remote())["slots"]["steps_by_batch"]
    return r, pool, steps


def _show(values: list[float]) -> str:
    return f"p50 {statistics.median(values):6.2f} s   max {max(values):6.2f} s   (n={len(values)})"


def _report(bare: dict, r: dict, pool: list[dict], steps: dict, sim: dict) -> None:
    host = bare["engine"]
    print()
    print(f"chat TTFT, bare engine (no Ray):      {_show(bare['ttft'])}   best {min(bare['ttft']):.2f} s")
    print(f"chat TTFT, device idle:               {_show(r['idle'])}   "
          f"{statistics.median(r['idle']) / min(bare['ttft']):.2f}x the bare best (goal <= 1.3x)")
    model_s, bare_model_s = statistics.median(r["idle_prefill"]), statistics.median(bare["prefill"])
    print(f"  of which the model's prefill:      p50 {model_s * 1000:4.0f} ms in the ModelActor, "
          f"{bare_model_s * 1000:.0f} ms bare; the rest (check, queue, lease, stream) "
          f"p50 {statistics.median(t - m for t, m in zip(r['idle'], r['idle_prefill'])) * 1000:.0f} ms")
    if r["busy"]:
        extra = statistics.median(r["busy"]) - statistics.median(r["idle"])
        print(f"chat TTFT, while Nataraj fills:       {_show(r['busy'])}   +{extra * 1000:.0f} ms over idle "
              f"(goal <= one decode step {host['decode_ms']:.0f} ms + 50 ms)")
    if r["http"] is not None:
        print(f"chat TTFT over HTTP, while Nataraj fills: {r['http']:6.2f} s   (POST /v1/chat/completions, "
              f"streamed, as the HTTP client sees it)")
    card = r["card"]
    if card:
        print(f"Nataraj's first card: {len(card['text'])} characters, revoked {card['revokes']}× by those chats "
              f"and resumed each time from its own tokens; deck {r['nataraj']['deck']}")
    slots = ", ".join(f"{d['device']} {d['slots']}" for d in pool)
    print(f"slots: {slots} "
          f"({'auto, measured at load' if pool[0].get('slots_auto') else 'set'}; uniun-ray up --slots N); "
          f"decode steps by jobs decoding together: {steps}")
    if r["shared"]:
        print(f"chats decoded beside other jobs: {max(r['shared']):.1f} jobs per step at most (mean per chat)")
    print(f"devices ({len(pool)}): " + ", ".join(f"{d['device']} holds {d['loaded_model'] or 'nothing'}" for d in pool)
          + ("   (with a device free, chat never needed to revoke Nataraj)" if len(pool) > 1 else ""))
    print()
    print("The same moment, simulated on the issue-118 workload (uniun-ray bench):")
    print(f"  old two-lane queue: chat TTFT p50 {sim['two-lane']:6.2f} s   "
          f"this scheduler: {sim['uniun']:6.2f} s")


if __name__ == "__main__":
    main()
