"""Engine benchmark: what a swap, a token and a revoke cost for each embedded model.

    .venv/bin/python benchmarks/engine_bench.py --trials 5       # section "engine" of BENCHMARKS.md
    .venv/bin/python benchmarks/engine_bench.py --models tiny --device cuda
    .venv/bin/python benchmarks/engine_bench.py --quick          # tiny and SmolLM2, two trials

Per model it measures, in a fresh temporary cache (so the one-time GGUF conversion is timed,
and the user's cache is left alone):

* first load: GGUF -> safetensors conversion + load, what a clean machine pays once;
* cached load: the median of three loads from the converted copy (an unload between each);
* decode tok/s: greedy, 128 new tokens, excluding the time to the first token;
* prefill: time to first token for a ~1000-token prompt;
* cancel-to-stop latency: a consumer thread streams, the main thread sets the cancel flag at a
  random moment, and the time until the iterator ends is taken; during decode and during a
  long prompt's chunked prefill, median and max over the trials;
* the dtype the engine chose on this host (``--dtype auto``: bf16 and float32 measured) and
  its prefill chunk, sized by time (``models/tune/tuning.py``).

The prefix KV cache is off here (every prefill is a cold one); ``kv_cache_bench.py`` measures it.

Records a row per model and figure (section "engine" of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from record import Record  # noqa: E402

from uniun_ray.models import Engine, GenerateRequest, generate, known_ids  # noqa: E402
from uniun_ray.settings import EngineSettings  # noqa: E402
from uniun_ray.models.registry import CACHE_ENV  # noqa: E402

LONG_PROMPT = " ".join(f"Item {i} costs {i * 7 % 50} coins." for i in range(110))


def cancel_latency(
    engine: Engine, request: GenerateRequest, wait_s: tuple[float, float], in_prefill: bool
) -> float | None:
    """Seconds from setting the cancel flag to the end of the stream; None if the cancel did
    not land in the phase asked for (the run ended first, or prefill was already over)."""
    cancel, started, ended = threading.Event(), threading.Event(), {}
    generation = generate(engine, request, cancel)

    def consume() -> None:
        started.set()
        for _ in generation:
            pass
        ended["at"] = time.perf_counter()

    consumer = threading.Thread(target=consume)
    consumer.start()
    started.wait()
    time.sleep(random.uniform(*wait_s))
    cancelled_at = time.perf_counter()
    cancel.set()
    consumer.join()
    result = generation.result
    if not result.stopped_by_cancel or (result.tokens == 0) != in_prefill:
        return None
    return ended["at"] - cancelled_at


def summary(latencies: list[float | None]) -> str:
    landed = [latency for latency in latencies if latency is not None]
    if not landed:
        return "n/a"
    return f"{statistics.median(landed) * 1e3:.0f} / {max(landed) * 1e3:.0f} (n={len(landed)})"


def bench_model(engine: Engine, model_id: str, trials: int) -> dict:
    first_load = engine.load(model_id).seconds
    cached = []
    for _ in range(3):
        engine.unload()
        cached.append(engine.load(model_id).seconds)
    prompt = "Write a short story about a lighthouse keeper."
    warm = GenerateRequest(prompt=prompt, max_new_tokens=8)
    list(generate(engine, warm, threading.Event()))
    generation = generate(engine, GenerateRequest(prompt=prompt, max_new_tokens=128), threading.Event())
    list(generation)
    decoded = generation.result
    decode_tok_s = (decoded.tokens - 1) / (decoded.total_s - decoded.ttft_s)
    long = GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=1)
    prefill = generate(engine, long, threading.Event())
    list(prefill)
    prefill_s = prefill.result.ttft_s
    per_token = 1 / decode_tok_s
    decode_window = (prefill_s + 2 * per_token, prefill_s + 40 * per_token)
    in_decode = [
        cancel_latency(engine, GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=100), decode_window, False)
        for _ in range(trials)
    ]
    in_prefill = [
        cancel_latency(engine, GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=1), (0.0, prefill_s), True)
        for _ in range(trials)
    ]
    described = engine.describe()
    return {
        "on": {"threads": described["threads"], "dtype": described["dtype"], "engine": "transformers"},
        "first load (GGUF conversion + load)": f"{first_load:.2f} s",
        "cached load (median of 3)": f"{statistics.median(cached):.2f} s",
        "decode": f"{decode_tok_s:.2f} tok/s",
        f"prefill of {prefill.result.prompt_tokens} tokens, one cold run "
        f"(chunks of {described['prefill_chunk']})": f"{prefill_s:.2f} s",
        "cancel to stop while decoding, ms (median / max)": summary(in_decode),
        "cancel to stop inside a prefill, ms (median / max)": summary(in_prefill),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct", "gemma-3-270m"],
                        choices=known_ids())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto (default: measured per host and model), "
                        "bfloat16, float16 or float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: this process's cores)")
    parser.add_argument("--trials", type=int, default=10, help="cancel trials per model and phase")
    parser.add_argument("--quick", action="store_true", help="tiny and SmolLM2, two trials")
    args = parser.parse_args()
    models, trials = (["tiny", "smollm2-135m-instruct"], 2) if args.quick else (args.models, args.trials)
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="uniun-bench-cache-")
    engine = Engine(args.device, EngineSettings(dtype=args.dtype, threads=args.threads, kv_cache_mb=0))
    record = Record("engine", quick=args.quick)
    for model_id in models:
        figures = bench_model(engine, model_id, trials)
        engine.unload()
        record.runs_on(**figures.pop("on"))
        for figure, measured in figures.items():
            record.row(f"`{model_id}`: {figure}", measured)
    record.save()


if __name__ == "__main__":
    main()
