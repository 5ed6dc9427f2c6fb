"""Embedding flood: many embed calls at once (a relay flood of new notes). The embedder runs
beside the scheduler with two calls at a time; the LLM queue never sees them.

    python jobs/embed_flood.py [--texts 256] [--batch 8] [--concurrency 8] [--address ADDR]
    ray job submit --working-dir . -- python jobs/embed_flood.py

See jobs/README.md for running it under `ray job submit`.
"""
from __future__ import annotations

import asyncio
import statistics
import time

import uniun_ray
from common import job_parser, session


async def flood(texts: list[str], batch: int, concurrency: int) -> list[float]:
    """Embed `texts` in batches, `concurrency` calls in flight; returns each call's latency."""
    gate = asyncio.Semaphore(concurrency)

    async def one(chunk: list[str]) -> float:
        async with gate:
            started = time.perf_counter()
            vectors = await uniun_ray.aembed(chunk)
            assert len(vectors) == len(chunk)
            return time.perf_counter() - started
    return await asyncio.gather(*(one(texts[i:i + batch]) for i in range(0, len(texts), batch)))


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--texts", type=int, default=256, help="texts to embed (default 256)")
    parser.add_argument("--batch", type=int, default=8, help="texts per call (default 8)")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight (default 8)")
    args = parser.parse_args(argv)

    session(args)
    uniun_ray.embed(["warm up"])
    texts = [f"note {i}: the river project meeting moved to {i % 7 + 1} pm" for i in range(args.texts)]
    queued_before = uniun_ray.status()["queued"]
    started = time.perf_counter()
    latencies = asyncio.run(flood(texts, args.batch, args.concurrency))
    elapsed = time.perf_counter() - started
    p95 = sorted(latencies)[max(0, round(0.95 * len(latencies)) - 1)]
    print(f"embedded {args.texts} texts in {len(latencies)} calls: {elapsed:.2f}s, {args.texts / elapsed:.0f} texts/s; "
          f"call latency p50 {statistics.median(latencies) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms")
    print(f"LLM scheduler queue: {queued_before} jobs before, {uniun_ray.status()['queued']} after "
          f"(embeddings are never scheduled)")


if __name__ == "__main__":
    main()
