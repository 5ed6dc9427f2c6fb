"""A mixed soak over HTTP (issue 35): does the runtime's memory stop growing?

    .venv/bin/python benchmarks/soak.py --minutes 10    # the figures (section "soak" of BENCHMARKS.md)
    .venv/bin/python benchmarks/soak.py --quick         # 90 s on a 48 MB prefix cache: proves it runs

A local Ray with the runtime and its OpenAI-compatible endpoint; for the soak's length, through
HTTP only: a chat turn every 2 s (four conversations in turn, each started anew after eight
turns, so the prefix cache keeps meeting new histories), three Nataraj streams back to back, an
extract every 5 s and an embedding request every 3 s. Every `--every` seconds it samples the
resident memory (RSS) of each process of the runtime (the scheduler, each ModelActor, the
embedder, the Serve replica and proxy) and each device's prefix KV cache (held bytes against
its budget). The rows: per process its RSS after the first minute, at the end, the most, and its
growth over the last third of the soak (MB/min; a plateau is about 0); the cache's bytes against
the budget, how much of each ModelActor's growth the cache does not explain, and its RSS beyond
what its memory plan's parts use (``status``: weights, rows, cache, warm models), whose growth
over the last third says whether the rest is flat. Every sample
goes to `results/soak-samples.jsonl` (a sample a line) beside the record. `--quick` gives the cache a small budget
(`--kv-cache-mb`), so that it fills, and the plateau shows, within its 90 s.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import aiohttp  # noqa: E402
import psutil  # noqa: E402
from record import RESULTS, Record  # noqa: E402

from uniun_ray.runtime.launch import local_cluster, start  # noqa: E402
from uniun_ray.settings import Settings  # noqa: E402

CHAT_EVERY_S, EXTRACT_EVERY_S, EMBED_EVERY_S = 2.0, 5.0, 3.0
NATARAJ_STREAMS, CONVERSATIONS, TURNS_PER_CONVERSATION = 3, 4, 8
#: The processes whose memory is followed, by their Ray actor class (Serve's are named by Serve).
FOLLOWED = ("SchedulerActor", "ModelActor", "EmbeddingActor", "ServeReplica", "ProxyActor")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Load:
    """The soak's clients, all over HTTP; counts what each kind was answered."""

    def __init__(self, url: str, until: float) -> None:
        self.url, self.until = url, until
        self.answers: dict[str, dict[int, int]] = {}

    def count(self, kind: str, status: int) -> None:
        by_status = self.answers.setdefault(kind, {})
        by_status[status] = by_status.get(status, 0) + 1

    async def post(self, session, kind: str, path: str, body: dict) -> dict | None:
        async with session.post(self.url + path, json=body) as response:
            self.count(kind, response.status)
            if body.get("stream"):
                async for _ in response.content:
                    pass
                return None
            return await response.json() if response.status == 200 else None

    async def every(self, period_s: float, act) -> None:
        for n in itertools.count():
            if time.time() >= self.until:
                return
            started = time.monotonic()
            await act(n)
            await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            histories = [[] for _ in range(CONVERSATIONS)]

            async def chat(n: int) -> None:
                history = histories[n % CONVERSATIONS]
                if len(history) >= 2 * TURNS_PER_CONVERSATION:
                    history.clear()
                history.append({"role": "user", "content": f"Note {n}: tell me one thing about the sea."})
                answer = await self.post(session, "chat", "/v1/chat/completions",
                                         {"messages": history, "max_tokens": 24})
                history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]
                                if answer else "(no answer)"})

            async def nataraj(stream: int) -> None:
                for n in itertools.count():
                    if time.time() >= self.until:
                        return
                    await self.post(session, "nataraj", "/v1/completions",
                                    {"kind": "nataraj", "producer": f"nataraj:{stream}", "stream": True,
                                     "prompt": f"Card {stream}.{n}: a short story about the harbour.",
                                     "max_tokens": 64})

            async def extract(n: int) -> None:
                await self.post(session, "extract", "/v1/completions",
                                {"kind": "extract", "prompt": f"Extract the names from note {n}: Ada met Bo.",
                                 "max_tokens": 16})

            async def embed(n: int) -> None:
                await self.post(session, "embeddings", "/v1/embeddings",
                                {"input": [f"note {n} about the weather", f"note {n} about the tide"]})
            await asyncio.gather(self.every(CHAT_EVERY_S, chat), self.every(EXTRACT_EVERY_S, extract),
                                 self.every(EMBED_EVERY_S, embed), *(nataraj(i) for i in range(NATARAJ_STREAMS)))


def processes(dashboard: str) -> dict[str, int]:
    """The runtime's processes (name -> pid) from the actor table of this soak's Ray (its
    dashboard: others may run on the host), the ones it follows; Serve's by their role (their
    names carry ids)."""
    from ray.util.state import list_actors

    found = {}
    for actor in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000):
        if actor.class_name.startswith(FOLLOWED) and actor.pid:
            serve = {"ServeReplica": "serve replica", "ProxyActor": "serve proxy"}
            found[next((v for k, v in serve.items() if actor.class_name.startswith(k)), actor.name)] = actor.pid
    return found


async def sample(url: str, dashboard: str, started: float) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/status") as response:
            status = await response.json()
    rss = {}
    for name, pid in (await asyncio.to_thread(processes, dashboard)).items():   # asked anew: an actor may start late
        try:
            rss[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            rss[name] = None
    kv = {d["device"]: {k: (d.get("engine") or {}).get("kv_cache", {}).get(k) for k in ("held_mb", "budget_mb",
                                                                                       "entries", "evictions")}
          for d in status["devices"]}
    accounted = {d["device"]: round(sum(part["used_mb"] or 0 for part in
                                        ((d.get("engine") or {}).get("memory") or {}).get("parts", {}).values()), 1)
                 for d in status["devices"]}   # what the device's memory plan says its parts use
    return {"t": round(time.time() - started, 1), "rss_mb": rss, "kv": kv, "plan_used_mb": accounted}


async def soak(url: str, dashboard: str, seconds: float, every_s: float) -> tuple[list[dict], dict]:
    started = time.time()
    load = Load(url, started + seconds)
    clients = asyncio.ensure_future(load.run())
    samples = []
    while not clients.done():
        samples.append(await sample(url, dashboard, started))
        print(f"t={samples[-1]['t']:.0f}s rss={samples[-1]['rss_mb']} kv={samples[-1]['kv']}", flush=True)
        await asyncio.wait({clients}, timeout=every_s)
    await clients
    samples.append(await sample(url, dashboard, started))
    return samples, load.answers


def growth(samples: list[dict], name: str, value=None) -> float | None:
    """MB per minute over the last third of the samples (a least-squares slope) of process
    ``name``'s RSS, or of ``value(sample)``."""
    value = value or (lambda s: s["rss_mb"].get(name))
    points = [(s["t"], value(s)) for s in samples[len(samples) * 2 // 3:]]
    points = [(t, v) for t, v in points if v is not None]
    if len(points) < 2:
        return None
    mean_t, mean_v = sum(t for t, _ in points) / len(points), sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else None


def record(samples: list[dict], answers: dict, minutes: float, quick: bool) -> None:
    rec = Record("soak", quick=quick)
    rec.row(f"requests answered in {minutes:g} min (by kind: status -> count)",
            "; ".join(f"{kind} {dict(sorted(by.items()))}" for kind, by in sorted(answers.items())))
    warm = next((s for s in samples if s["t"] >= 60), samples[0])
    for name in sorted(samples[-1]["rss_mb"]):
        values = [s["rss_mb"].get(name) for s in samples if s["rss_mb"].get(name) is not None]
        slope = growth(samples, name)
        rec.row(f"{name}: RSS at {warm['t']:.0f} s / at the end / most; growth over the last third",
                f"{warm['rss_mb'].get(name)} / {values[-1]} / {max(values)} MB; "
                + ("-" if slope is None else f"{slope:+.1f} MB/min"))
    for device, kv in samples[-1]["kv"].items():
        most = max(s["kv"][device]["held_mb"] or 0 for s in samples)
        rec.row(f"prefix KV cache of {device}: held at the end / most / budget (entries, evictions)",
                f"{kv['held_mb']} / {most} / {kv['budget_mb']} MB ({kv['entries']}, {kv['evictions']})",
                goal="≤ budget", met=most <= (kv["budget_mb"] or 0))
        actor = f"model:{device}"
        if warm["rss_mb"].get(actor) is not None and samples[-1]["rss_mb"].get(actor) is not None:
            rss = samples[-1]["rss_mb"][actor] - warm["rss_mb"][actor]
            cached = (kv["held_mb"] or 0) - (warm["kv"][device]["held_mb"] or 0)
            rec.row(f"{actor}: RSS growth from {warm['t']:.0f} s to the end / of it the cache's / the rest",
                    f"{rss:+.0f} / {cached:+.0f} / {rss - cached:+.0f} MB")
            beyond = lambda s: None if s["rss_mb"].get(actor) is None else s["rss_mb"][actor] - s["plan_used_mb"][device]  # noqa: E731
            slope = growth(samples, actor, beyond)
            rec.row(f"{actor}: RSS beyond what its memory plan's parts use, at {warm['t']:.0f} s / at the end; "
                    "growth over the last third", f"{beyond(warm):.0f} / {beyond(samples[-1]):.0f} MB; "
                    + ("-" if slope is None else f"{slope:+.1f} MB/min"))
    rec.save()
    # one sample a line, as .jsonl: results/*.json are the records render.py reads
    (RESULTS / "soak-samples.jsonl").write_text("".join(json.dumps(sample) + "\n" for sample in samples))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples (default 10)")
    ap.add_argument("--kv-cache-mb", help="the prefix cache's budget (UNIUN_KV_CACHE_MB; default: the "
                    "device's, 48 with --quick)")
    ap.add_argument("--quick", action="store_true", help="90 s, a sample every 5 s, a 48 MB cache: proves it runs")
    args = ap.parse_args()
    minutes, every = (1.5, 5.0) if args.quick else (args.minutes, args.every)
    settings = Settings.load(flags={"kv_cache_mb": args.kv_cache_mb or ("48" if args.quick else None)})
    with local_cluster(dashboard=True) as context:   # the dashboard's state API lists the actors' pids
        from ray import serve

        from uniun_ray.http import deploy

        start(settings=settings)
        url = deploy(port=free_port())
        try:
            samples, answers = asyncio.run(soak(url, f"http://{context.dashboard_url}", 60 * minutes, every))
        finally:
            serve.shutdown()
    record(samples, answers, minutes, args.quick)


if __name__ == "__main__":
    main()
