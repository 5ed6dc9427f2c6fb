"""Runtime measurements on a real local Ray with the embedded models (issue 3):

    .venv/bin/python benchmarks/runtime_bench.py --repeat 5           # section "runtime" of BENCHMARKS.md
    .venv/bin/python benchmarks/runtime_bench.py --control-only
    .venv/bin/python benchmarks/runtime_bench.py --stream-only --repeat 3
    .venv/bin/python benchmarks/runtime_bench.py --swaps-only                # section "swaps" (issue 37)
    ... --quick                                                        # fewer runs, no Gemma

- swap time per model and kind (load into the ModelActor from another resident model, cache warm:
  the first of each cold, then a switch to the model kept beside the other; `--swaps-only`: SmolLM2
  <-> Gemma, also as warm copies with co-residency off, issue 37);
- revoke-to-stop latency (chat arrives while Natarajes fill every slot of the device on smollm2,
  so that R22 revokes one: from the ModelActor's revoke to the generation's end; with free
  slots a chat joins beside them and nothing is revoked);
- chat TTFT with the device idle vs while Natarajes fill its slots (smollm2, submit to first piece);
- embedding throughput with one caller vs two (the actor's max_concurrency=2);
- with --control-only: the control-plane cost per job (submit + grant + release, `run` with
  empty work) next to a bare actor call, and the request check before queueing;
- with --stream-only: a fast model's stream, 1,800 tokens of `tiny` through the runtime (per
  token from the first piece on, and how many pieces carried them) against the bare engine
  in this process, with the same cluster beside it.

Records a row per figure (`record.py`); numbers are medians (p50) and p99/max where noted.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from record import Record  # noqa: E402

from uniun_ray.client import agenerate, arun, astatus, astream, await_generating  # noqa: E402
from uniun_ray.runtime.launch import local_cluster, start  # noqa: E402
from uniun_ray.runtime.releases import RELEASES  # noqa: E402

CHAT = "smollm2-135m-instruct"
MODELS = ("tiny", "smollm2-135m-instruct", "gemma-3-270m")
SWAP_PAIR = (CHAT, "gemma-3-270m")   # issue 37's pair, back and forth


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def control_plane(h, n: int = 300, warmup: int = 20, checks_n: int = 50) -> dict:
    """Per job, through the client: `arun` with empty work (submit + grant + release, the
    lease loop's whole protocol), interleaved with a bare actor call (`ping`) so all see the
    same machine load. A release is one-way (`runtime.releases`), so each figure is a job
    right after another, the cost of the other's release included: `control`, started at
    once, takes that release along in its own call; `alone`, started a loop turn later, finds
    it on its way (the scheduler applies it before the submit); `awaited` is the old path,
    the release's answer awaited (an A/B in one run). The ping waits for the releases first."""
    async def empty(lease):
        return None

    async def job() -> float:
        t = time.perf_counter()
        await arun("gana", "tiny", empty)
        return time.perf_counter() - t
    await h.model.load.remote("tiny")
    control, alone, awaited, bare = [], [], [], []
    for i in range(warmup + n):
        t = time.perf_counter()
        await arun("gana", "tiny", empty)
        await RELEASES.settled()
        a = time.perf_counter() - t
        await job()
        await asyncio.sleep(0)     # its release leaves on its own
        o = await job()
        c = await job()            # takes the release of the one before along
        await RELEASES.settled()
        t = time.perf_counter()
        await h.scheduler.ping.remote()
        b = time.perf_counter() - t
        if i >= warmup:
            control.append(c)
            alone.append(o)
            awaited.append(a)
            bare.append(b)
    # the request check before queueing: a round trip to the ModelActor, idle and while it generates
    from uniun_ray.models import GenerateRequest
    request = GenerateRequest(prompt="Say hello.", max_new_tokens=8)

    async def checks(k: int) -> list[float]:
        out = []
        for _ in range(k):
            t = time.perf_counter()
            await h.model.check.remote("tiny", request)
            out.append(time.perf_counter() - t)
        return out
    idle = await checks(checks_n)
    card = asyncio.ensure_future(agenerate("nataraj", "Write a long story about the sea.", model_id="tiny",
                                           max_new_tokens=1800))
    assert await await_generating("nataraj", min_held_s=0.2), "no nataraj job got the device"
    busy = await checks(checks_n)
    await card
    return {"control": control, "alone": alone, "awaited": awaited, "bare": bare, "check_idle": idle, "check_busy": busy}


async def stream(h, tokens: int = 1800, repeat: int = 3) -> dict:
    await agenerate("nataraj", "warm up", model_id="tiny", max_new_tokens=200)  # the load, a first run
    runs = []
    for _ in range(repeat):
        generation, first, pieces = astream("nataraj", "a card", model_id="tiny", max_new_tokens=tokens), None, 0
        async for _ in generation:
            first, pieces = first or time.perf_counter(), pieces + 1
        runs.append(((time.perf_counter() - first) / (generation.completion.tokens - 1), pieces))
    return {"runtime": runs, "runtime_engine": (await h.model.state.remote())["engine"]}


def bare_stream(tokens: int = 1800, repeat: int = 3) -> dict:
    import threading

    from uniun_ray.models.decode.engine import Engine
    from uniun_ray.models.decode.generation import generate
    from uniun_ray.models.requests.request import GenerateRequest

    engine = Engine()
    engine.load("tiny")
    runs = []
    for trial in range(repeat + 1):
        generation, first = generate(engine, GenerateRequest(prompt="a card", max_new_tokens=tokens), threading.Event()), None
        for _ in generation:
            first = first or time.perf_counter()
        if trial:  # the first is the warm-up run
            runs.append((time.perf_counter() - first) / (generation.result.tokens - 1))
    return {"bare": runs, "bare_engine": engine.describe()}


async def measure(h, repeat: int, models: tuple[str, ...]) -> dict:
    out = {}
    # swaps: cycle through the models so each load replaces another one (the first of each is
    # cold, the rest as the engine kept the model: a switch by default, issue 37)
    out["swap"] = await cycle(h, models, repeat)

    await agenerate("chat", "warm up", max_new_tokens=2)
    idle = [(await agenerate("chat", "Say hello.", max_new_tokens=8)).ttft_s for _ in range(repeat)]
    slots = (await astatus())["devices"][0]["slots"]     # the chat model's, as the device chose them
    busy = []
    for _ in range(repeat):
        cards = [asyncio.ensure_future(agenerate("nataraj", "Write a long story about the sea.", max_new_tokens=200,
                                                 producer=f"nataraj:{i}")) for i in range(slots)]
        await filled("nataraj", slots)
        busy.append((await agenerate("chat", "Say hello.", max_new_tokens=8)).ttft_s)
        await asyncio.gather(*cards)
    out["ttft_idle"], out["ttft_busy"], out["slots"] = idle, busy, slots
    state = await h.model.state.remote()
    out["stop"], out["engine"] = state["stop_latency_s"], state["engine"]
    if not out["stop"]:
        raise RuntimeError(f"no revoke-to-stop sample: the chat revoked no Nataraj of the {slots} filling the slots")

    texts = [f"note number {i} about the weather and the sea" for i in range(256)]
    batches = [texts[i:i + 8] for i in range(0, len(texts), 8)]
    await h.embedder.embed.remote(batches[0])
    t = time.perf_counter()
    for b in batches:
        await h.embedder.embed.remote(b)
    one = len(texts) / (time.perf_counter() - t)

    async def caller(part):
        for b in part:
            await h.embedder.embed.remote(b)
    t = time.perf_counter()
    await asyncio.gather(caller(batches[0::2]), caller(batches[1::2]))
    two = len(texts) / (time.perf_counter() - t)
    out["embed"] = (one, two)
    return out


async def filled(kind: str, jobs: int, timeout_s: float = 120.0) -> None:
    """Until `jobs` jobs of `kind` generate at once (every slot of the device taken)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await astatus()
        running = [j for d in status["devices"] for j in d["jobs"] if j["kind"] == kind
                   and status["leases"].get(j["id"], {}).get("held_s", 0.0) >= 0.2]
        if len(running) >= jobs:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{len(running)} of {jobs} {kind} jobs generate after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


def on(engine: dict) -> dict:
    """What an engine's figures ran on, from its own report (`Engine.describe`)."""
    return {"threads": engine["threads"], "dtype": engine.get("dtype"), "engine": "transformers"}


def ms(values, q: float) -> str:
    return f"{pct(values, q) * 1e3:.1f}"


def record_stream(r: dict, quick: bool) -> None:
    record = Record("runtime", quick=quick, name="runtime_bench-stream")
    per_token = [t for t, _ in r["runtime"]]
    record.row(f"{r['tokens']:,} tokens of `tiny` through the runtime: ms/token p50 / max (pieces)",
               f"{statistics.median(per_token) * 1e3:.2f} / {max(per_token) * 1e3:.2f} "
               f"({statistics.median(p for _, p in r['runtime']):.0f} pieces)", **on(r["runtime_engine"]))
    record.row("the same, the bare engine in the driver process: ms/token p50 / max",
               f"{statistics.median(r['bare']) * 1e3:.2f} / {max(r['bare']) * 1e3:.2f}", **on(r["bare_engine"]))
    record.row("runtime / bare engine, per token (p50)",
               f"{statistics.median(per_token) / statistics.median(r['bare']):.2f}×", **on(r["runtime_engine"]))
    record.save()


def record_control(r: dict, quick: bool) -> None:
    record = Record("runtime", quick=quick, name="runtime_bench-control")
    bare = pct(r["bare"], .5)
    ratio = pct(r["control"], .5) / bare
    record.row(f"control plane per job: submit + grant + release, p50 / p99 (n={len(r['control'])}; "
               f"the job before's release taken along)", f"{ms(r['control'], .5)} / {ms(r['control'], .99)} ms")
    for key, what in (("alone", "the job before's release sent one-way on its own"),
                      ("awaited", "the release's answer awaited (the path before issue 25's one-way release)")):
        record.row(f"the same, {what}: p50 / p99; / bare call (p50)",
                   f"{ms(r[key], .5)} / {ms(r[key], .99)} ms; {pct(r[key], .5) / bare:.1f}×")
    record.row("a bare actor call beside it, p50 / p99", f"{ms(r['bare'], .5)} / {ms(r['bare'], .99)} ms")
    record.row("control plane / bare call (p50)", f"{ratio:.1f}×", goal="≤ 3× (issue 12)", met=ratio <= 3)
    for key, what in (("check_idle", "device idle"), ("check_busy", "while a Nataraj generates")):
        record.row(f"request check `ModelActor.check`, {what}, p50 / p99", f"{ms(r[key], .5)} / {ms(r[key], .99)} ms")
    record.save()


async def cycle(h, models: tuple[str, ...], repeat: int) -> dict[tuple[str, str], list[float]]:
    """`ModelActor.load` of each model in turn, `repeat` rounds: seconds by (model, swap kind)."""
    swaps: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeat):
        for model in models:
            swap = await h.model.load.remote(model)
            if swap.kind != "none":   # the warm start's model, already resident
                swaps.setdefault((model, swap.kind), []).append(swap.seconds)
    return swaps


def warm_copies(models: tuple[str, ...], repeat: int) -> dict[tuple[str, str], list[float]]:
    """The same cycle on an engine in this process with co-residency off (`UNIUN_CORESIDENT=0`):
    every swap back is a warm copy from host memory (on a CPU an empty one)."""
    from uniun_ray.models.decode.engine import Engine
    from uniun_ray.models.decode.generation import generate
    from uniun_ray.settings import EngineSettings

    engine, swaps = Engine(settings=EngineSettings(coresident=False)), {}
    for _ in range(repeat):
        for model in models:
            swap = engine.load(model)
            swaps.setdefault((model, swap.kind), []).append(swap.seconds)
    engine.unload()
    return swaps


def swap_rows(record: Record, swaps: dict[tuple[str, str], list[float]], where: str, goal: bool) -> None:
    for (model, kind), seconds in sorted(swaps.items()):
        p50 = statistics.median(seconds)
        record.row(f"swap to `{model}`, {kind} ({where}): p50 / max (n={len(seconds)})",
                   f"{p50 * 1e3:.1f} / {max(seconds) * 1e3:.1f} ms",
                   **(dict(goal="≤ 50 ms p50 (issue 37)", met=p50 <= 0.05) if goal and kind != "cold" else {}))


def record_swaps(r: dict, quick: bool) -> None:
    record = Record("swaps", quick=quick, name="runtime_bench-swaps")
    swap_rows(record, r["actor"], "`ModelActor.load`, co-resident: the default", goal=True)
    swap_rows(record, r["engine"], "the engine in the driver process, `UNIUN_CORESIDENT=0`", goal=True)
    record.save()


def record_runtime(r: dict, quick: bool) -> None:
    record = Record("runtime", quick=quick)
    swap_rows(record, r["swap"], "`ModelActor.load`", goal=False)
    record.runs_on(**on(r["engine"]))
    stop = r["stop"]
    full = f"its {r['slots']} slot{'s' * (r['slots'] > 1)} full of Natarajes"
    record.row(f"revoke to stop, {CHAT} decoding, {full} (p50 / max, n={len(stop)})",
               f"{statistics.median(stop) * 1e3:.0f} / {max(stop) * 1e3:.0f} ms")
    record.row("chat TTFT, submit to first piece, device idle (p50 / max)",
               f"{statistics.median(r['ttft_idle']):.2f} / {max(r['ttft_idle']):.2f} s")
    record.row(f"chat TTFT, {full} (p50 / max)",
               f"{statistics.median(r['ttft_busy']):.2f} / {max(r['ttft_busy']):.2f} s")
    one, two = r["embed"]
    record.row("embeddings, 1 caller / 2 callers (batches of 8)", f"{one:.0f} / {two:.0f} texts/s",
               threads=None, dtype=None, engine="sentence-transformers")
    record.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--control-only", action="store_true", help="only the control plane against a bare call")
    ap.add_argument("--stream-only", action="store_true", help="only a fast model's stream against the bare engine")
    ap.add_argument("--swaps-only", action="store_true",
                    help=f"only swaps {CHAT} <-> {SWAP_PAIR[1]} by kind (co-resident switch, warm copy)")
    ap.add_argument("--quick", action="store_true", help="fewer runs and jobs; swaps without Gemma")
    args = ap.parse_args()
    repeat = 1 if args.quick else args.repeat
    with local_cluster():
        h = start()
        if args.swaps_only:
            rounds = 3 if args.quick else 10
            r = {"actor": asyncio.run(cycle(h, SWAP_PAIR, rounds)), "engine": warm_copies(SWAP_PAIR, rounds)}
        elif args.stream_only:
            tokens = 400 if args.quick else 1800
            r = asyncio.run(stream(h, tokens, repeat)) | bare_stream(tokens, repeat) | {"tokens": tokens}
        elif args.control_only:
            r = asyncio.run(control_plane(h, *((50, 5, 10) if args.quick else ())))
        else:
            r = asyncio.run(measure(h, max(repeat, 2), MODELS[:2] if args.quick else MODELS))
    if args.swaps_only:
        record_swaps(r, args.quick)
    elif args.stream_only:
        record_stream(r, args.quick)
    elif args.control_only:
        record_control(r, args.quick)
    else:
        record_runtime(r, args.quick)


if __name__ == "__main__":
    main()
