"""Batched decode (issue 25): SmolLM2's decode tokens/s at 1, 2, 4 and 8 rows through ``Batch``.

    .venv/bin/python benchmarks/batch_bench.py                 # 64 steps per batch size
    .venv/bin/python benchmarks/batch_bench.py --quick         # 8 steps per batch size
    .venv/bin/python benchmarks/batch_bench.py --library       # and transformers' ContinuousBatchingManager

Per batch size B: B jobs with different prompts join (their prefills interleaved with the steps),
then the steps in which all B rows decode together are timed; tokens/s is B tokens per such step.
The prefix cache is off (each run starts cold) and every job asks for more tokens than are timed,
so no row leaves during the timed steps. ``--library`` runs the same prompts through
``model.generate_batch``-style continuous batching of transformers (paged KV) for comparison.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from record import Record  # noqa: E402

from uniun_ray.models import Engine, GenerateRequest  # noqa: E402
from uniun_ray.settings import EngineSettings  # noqa: E402
from uniun_ray.models.decode.batch import Batch  # noqa: E402
from uniun_ray.models.requests.vocabulary import context_of  # noqa: E402

MODEL = "smollm2-135m-instruct"
TOPICS = ["rivers", "mountains", "bridges", "clocks", "lighthouses", "gardens", "trains", "libraries"]


def requests(count: int, tokens: int) -> list[GenerateRequest]:
    """Different prompts (different lengths); the greedy output never stops before ``tokens``."""
    return [GenerateRequest(prompt=f"Write a long essay about {topic}, with {3 + i} sections.",
                            max_new_tokens=tokens, stop=(), temperature=0)
            for i, topic in enumerate(TOPICS[:count])]


def batch_tokens_per_s(engine: Engine, rows: int, steps: int) -> tuple[float, float]:
    """Tokens/s and the median step time while ``rows`` jobs decode together."""
    batch = Batch(engine, slots=rows)
    jobs = [batch.add(request, threading.Event()) for request in requests(rows, 4 * steps + 64)]
    while batch.rows < rows:
        batch.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - started)
        if batch.rows < rows:
            raise SystemExit(f"a row left early ({[job.result for job in jobs if job.result]})")
    batch.close()
    return rows * len(times) / sum(times), statistics.median(times)


def library_tokens_per_s(engine: Engine, rows: int, tokens: int) -> float:
    """transformers' own continuous batching over the same prompts: generated tokens / wall time."""
    from transformers import GenerationConfig

    loaded = engine._loaded
    tokenizer = loaded.vocabulary.tokenizer
    inputs = [context_of(loaded.vocabulary, request) for request in requests(rows, tokens)]
    config = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=tokenizer.pad_token_id or 0)
    started = time.perf_counter()
    outputs = loaded.model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - started
    return sum(len(output.generated_tokens) for output in outputs.values()) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 timed steps per batch size")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--library", action="store_true", help="also transformers' ContinuousBatchingManager")
    args = ap.parse_args()
    steps = 8 if args.quick else args.steps
    engine = Engine(args.device, EngineSettings(dtype=args.dtype, kv_cache_mb=0))
    engine.load(MODEL)
    described = engine.describe()
    record = Record("slots", quick=args.quick)
    record.runs_on(threads=described["threads"], dtype=described["dtype"], engine="uniun Batch")
    batch_tokens_per_s(engine, 2, 4)     # warm-up, not recorded: the first steps of a process are slow
    alone = None
    for rows in map(int, args.sizes.split(",")):
        rate, step = batch_tokens_per_s(engine, rows, steps)
        alone = rate if rows == 1 else alone
        record.row(f"{MODEL} decode through Batch, rows={rows}: tokens/s (step p50), vs rows=1",
                   f"{rate:.1f} tok/s ({step * 1e3:.0f} ms)" + (f", {rate / alone:.2f}×" if alone else ""))
        if args.library:
            library = library_tokens_per_s(engine, rows, steps)
            record.row(f"{MODEL}, {rows} requests through transformers generate_batch: tokens/s (prefill included)",
                       f"{library:.1f} tok/s", engine="transformers ContinuousBatchingManager")
    record.save()


if __name__ == "__main__":
    main()
