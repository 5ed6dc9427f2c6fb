"""Runtime measurements on a real local Ray with the embedded models (issue 3):

    .venv/bin/python benchmarks/runtime_bench.py [--repeat 5]

- swap time per model (load into the ModelActor from another resident model, cache warm);
- revoke-to-stop latency (chat arrives while Nataraj generates on smollm2: from the
  ModelActor's revoke to the generation's end);
- chat TTFT with the device idle vs while Nataraj generates (smollm2, submit to first piece);
- control-plane cost per job (submit + grant + release, `run` with empty work) next to a
  bare actor call;
- embedding throughput with one caller vs two (the actor's max_concurrency=2).

Prints a markdown table; numbers are medians (p50) and p99/max where noted.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from uniun_ray.client import agenerate, arun, await_generating  # noqa: E402
from uniun_ray.runtime.launch import local_cluster, start  # noqa: E402

CHAT = "smollm2-135m-instruct"
MODELS = ("tiny", "smollm2-135m-instruct", "gemma-3-270m")


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


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

    async def empty(lease):
        return None
    control, bare = [], []
    for _ in range(100):
        t = time.perf_counter()
        await arun("gana", "tiny", empty)
        control.append(time.perf_counter() - t)
        t = time.perf_counter()
        await h.scheduler.ping.remote()
        bare.append(time.perf_counter() - t)
    out["control"], out["bare"] = control, bare

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
    args = ap.parse_args()
    with local_cluster():
        r = asyncio.run(measure(start(), args.repeat))
    print(f"{platform.machine()}, {os.cpu_count()} cores, CPU only; --repeat {args.repeat}\n")
    print("| measurement | result |")
    print("|---|---|")
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
    one, two = r["embed"]
    print(f"| embeddings, 1 caller / 2 callers (batches of 8) | {one:.0f} / {two:.0f} texts/s |")


if __name__ == "__main__":
    main()
