"""Runtime measurements on a real local Ray with the embedded models (issue 3):

    .venv/bin/python benchmarks/runtime_bench.py [--repeat 5]

- swap time per model (load into the ModelActor from another resident model, cache warm);
- revoke-to-stop latency (chat arrives while Nataraj generates on smollm2: from the
  ModelActor's revoke to the generation's end);
- chat TTFT with the device idle vs while Nataraj generates (smollm2, submit to first piece);
- control-plane cost per job (submit + grant + release, `run` with empty work) next to a
  bare actor call;
- embedding throughput with one caller vs two (the actor's max_concurrency=2);
- with --stream-only: a fast model's stream, 1,800 tokens of `tiny` through the runtime (per
  token from the first piece on, and how many pieces carried them) against the bare engine
  in this process, with the same cluster beside it.

Prints a markdown table; numbers are medians (p50) and p99/max where noted.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from uniun_ray.client import agenerate, arun, astream, await_generating  # noqa: E402
from uniun_ray.runtime.launch import local_cluster, start  # noqa: E402

CHAT = "smollm2-135m-instruct"
MODELS = ("tiny", "smollm2-135m-instruct", "gemma-3-270m")


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def control_plane(h, n: int = 300, warmup: int = 20) -> dict:
    """Per job, through the client: `arun` with empty work (submit + grant + release, the
    lease loop's whole protocol), interleaved with a bare actor call (`ping`) so both see the
    same machine load."""
    async def empty(lease):
        return None
    await h.model.load.remote("tiny")
    control, bare = [], []
    for i in range(warmup + n):
        t = time.perf_counter()
        await arun("gana", "tiny", empty)
        c = time.perf_counter() - t
        t = time.perf_counter()
        await h.scheduler.ping.remote()
        b = time.perf_counter() - t
        if i >= warmup:
            control.append(c)
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
    idle = await checks(50)
    card = asyncio.ensure_future(agenerate("nataraj", "Write a long story about the sea.", model_id="tiny",
                                           max_new_tokens=1800))
    assert await await_generating("nataraj", min_held_s=0.2), "no nataraj job got the device"
    busy = await checks(50)
    await card
    return {"control": control, "bare": bare, "check_idle": idle, "check_busy": busy}


async def stream(h, tokens: int = 1800, repeat: int = 3) -> dict:
    await agenerate("nataraj", "warm up", model_id="tiny", max_new_tokens=200)  # the load, a first run
    runs = []
    for _ in range(repeat):
        generation, first, pieces = astream("nataraj", "a card", model_id="tiny", max_new_tokens=tokens), None, 0
        async for _ in generation:
            first, pieces = first or time.perf_counter(), pieces + 1
        runs.append(((time.perf_counter() - first) / (generation.completion.tokens - 1), pieces))
    engine = (await h.model.state.remote())["engine"]
    return {"runtime": runs, "runtime_engine": f"{engine['dtype']}, {engine['threads']} thread(s)"}


def bare_stream(tokens: int = 1800, repeat: int = 3) -> dict:
    import threading

    from uniun_ray.models.engine import Engine
    from uniun_ray.models.request import GenerateRequest

    engine = Engine()
    engine.load("tiny")
    runs = []
    for trial in range(repeat + 1):
        generation, first = engine.generate(GenerateRequest(prompt="a card", max_new_tokens=tokens), threading.Event()), None
        for _ in generation:
            first = first or time.perf_counter()
        if trial:  # the first is the warm-up run
            runs.append((time.perf_counter() - first) / (generation.result.tokens - 1))
    described = engine.describe()
    return {"bare": runs, "bare_engine": f"{described['dtype']}, {described['threads']} thread(s)"}


def host() -> str:
    """`lscpu`'s model name and the core count (what BENCHMARKS.md names the host by)."""
    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"{model}, {os.cpu_count()} cores"


async def measure(h, repeat: int) -> dict:
    out = {}
    # swaps: cycle through the models so each load replaces another one
    swaps = {m: [] for m in MODELS}
    for _ in range(repeat):
        for model in MODELS:
            swaps[model].append(await h.model.load.remote(model))
    out["swap"] = {m: statistics.median(v) for m, v in swaps.items()}

    await agenerate("chat", "warm up", max_new_tokens=2)
    idle = [(await agenerate("chat", "Say hello.", max_new_tokens=8)).ttft_s for _ in range(repeat)]
    busy = []
    for _ in range(repeat):
        card = asyncio.ensure_future(agenerate("nataraj", "Write a long story about the sea.", max_new_tokens=200))
        assert await await_generating("nataraj"), "no nataraj job got the device"
        busy.append((await agenerate("chat", "Say hello.", max_new_tokens=8)).ttft_s)
        await card
    out["ttft_idle"], out["ttft_busy"] = idle, busy
    out["stop"] = (await h.model.state.remote())["stop_latency_s"]

    out |= await control_plane(h)

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--control-only", action="store_true", help="only the control plane against a bare call")
    ap.add_argument("--stream-only", action="store_true", help="only a fast model's stream against the bare engine")
    args = ap.parse_args()
    with local_cluster():
        h = start()
        if args.stream_only:
            r = asyncio.run(stream(h, repeat=args.repeat)) | bare_stream(repeat=args.repeat)
        else:
            r = asyncio.run(control_plane(h) if args.control_only else measure(h, args.repeat))
    print(f"{host()}, CPU only; --repeat {args.repeat}\n")
    print("| measurement | result |")
    print("|---|---|")
    if args.stream_only:
        per_token = [t for t, _ in r["runtime"]]
        print(f"| 1,800 tokens of tiny through the runtime ({r['runtime_engine']}): ms/token p50 / max | "
              f"{statistics.median(per_token) * 1e3:.2f} / {max(per_token) * 1e3:.2f} "
              f"({statistics.median(p for _, p in r['runtime']):.0f} pieces) |")
        print(f"| the same, bare engine in this process ({r['bare_engine']}): ms/token p50 / max | "
              f"{statistics.median(r['bare']) * 1e3:.2f} / {max(r['bare']) * 1e3:.2f} |")
        print(f"| runtime / bare (p50) | {statistics.median(per_token) / statistics.median(r['bare']):.2f}x |")
        return
    ratio = pct(r["control"], .5) / pct(r["bare"], .5)
    if args.control_only:
        print(f"| control plane per job: submit+grant+release (p50 / p99, n={len(r['control'])}) | "
              f"{pct(r['control'], .5) * 1e3:.1f} / {pct(r['control'], .99) * 1e3:.1f} ms |")
        print(f"| bare actor call (p50 / p99) | {pct(r['bare'], .5) * 1e3:.1f} / {pct(r['bare'], .99) * 1e3:.1f} ms |")
        print(f"| control plane / bare call (p50) | {ratio:.1f}x (goal <= 3x) |")
        for key, what in (("check_idle", "device idle"), ("check_busy", "while Nataraj generates")):
            print(f"| request check `ModelActor.check`, {what} (p50 / p99) | "
                  f"{pct(r[key], .5) * 1e3:.1f} / {pct(r[key], .99) * 1e3:.1f} ms |")
        return
    for model, s in r["swap"].items():
        print(f"| swap in `{model}` (p50) | {s:.2f} s |")
    stop = r["stop"]
    print(f"| revoke-to-stop, smollm2 (p50 / max, n={len(stop)}) | "
          f"{statistics.median(stop) * 1e3:.0f} / {max(stop) * 1e3:.0f} ms |")
    print(f"| chat TTFT, device idle (p50 / max) | {statistics.median(r['ttft_idle']):.2f} / {max(r['ttft_idle']):.2f} s |")
    print(f"| chat TTFT, while Nataraj generates (p50 / max) | {statistics.median(r['ttft_busy']):.2f} / {max(r['ttft_busy']):.2f} s |")
    print(f"| control plane per job: submit+grant+release (p50 / p99) | "
          f"{pct(r['control'], .5) * 1e3:.1f} / {pct(r['control'], .99) * 1e3:.1f} ms |")
    print(f"| bare actor call (p50 / p99) | {pct(r['bare'], .5) * 1e3:.1f} / {pct(r['bare'], .99) * 1e3:.1f} ms |")
    print(f"| control plane / bare call (p50) | {ratio:.1f}x (goal <= 3x) |")
    one, two = r["embed"]
    print(f"| embeddings, 1 caller / 2 callers (batches of 8) | {one:.0f} / {two:.0f} texts/s |")


if __name__ == "__main__":
    main()
