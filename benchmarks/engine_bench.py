"""Engine benchmark: what a swap, a token and a revoke cost for each embedded model.

    .venv/bin/python benchmarks/engine_bench.py                  # all embedded models, CPU
    .venv/bin/python benchmarks/engine_bench.py --models tiny --device cuda

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
  its prefill chunk, sized by time (``models/tuning.py``).

The prefix KV cache is off here (every prefill is a cold one); ``kv_cache_bench.py`` measures it.

Prints a markdown table (the one in uniun_ray/models/MEASURED.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from uniun_ray.models import Engine, GenerateRequest, known_ids  # noqa: E402
from uniun_ray.models.registry import CACHE_ENV  # noqa: E402
from uniun_ray.models.tuning import cpu_model  # noqa: E402

LONG_PROMPT = " ".join(f"Item {i} costs {i * 7 % 50} coins." for i in range(110))


def cancel_latency(
    engine: Engine, request: GenerateRequest, wait_s: tuple[float, float], in_prefill: bool
) -> float | None:
    """Seconds from setting the cancel flag to the end of the stream; None if the cancel did
    not land in the phase asked for (the run ended first, or prefill was already over)."""
    cancel, started, ended = threading.Event(), threading.Event(), {}
    generation = engine.generate(request, cancel)

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
    first_load = engine.load(model_id)
    cached = []
    for _ in range(3):
        engine.unload()
        cached.append(engine.load(model_id))
    prompt = "Write a short story about a lighthouse keeper."
    warm = GenerateRequest(prompt=prompt, max_new_tokens=8)
    list(engine.generate(warm, threading.Event()))
    generation = engine.generate(GenerateRequest(prompt=prompt, max_new_tokens=128), threading.Event())
    list(generation)
    decoded = generation.result
    decode_tok_s = (decoded.tokens - 1) / (decoded.total_s - decoded.ttft_s)
    long = GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=1)
    prefill = engine.generate(long, threading.Event())
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
        "model": model_id,
        "dtype (chunk)": f"{described['dtype']} ({described['prefill_chunk']})",
        "first load s": first_load,
        "cached load s": statistics.median(cached),
        "decode tok/s": decode_tok_s,
        "prefill s (prompt tokens)": f"{prefill_s:.2f} ({prefill.result.prompt_tokens})",
        "cancel in decode ms (med / max)": summary(in_decode),
        "cancel in prefill ms (med / max)": summary(in_prefill),
    }


def table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row[key]:.2f}" if isinstance(row[key], float) else str(row[key]) for key in header]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct", "gemma-3-270m"],
                        choices=known_ids())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto (default: measured per host and model), "
                        "bfloat16, float16 or float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: this process's cores)")
    parser.add_argument("--trials", type=int, default=10, help="cancel trials per model and phase")
    args = parser.parse_args()
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="uniun-bench-cache-")
    engine = Engine(device=args.device, dtype=args.dtype, num_threads=args.threads, kv_cache_mb=0)
    rows = []
    for model_id in args.models:
        rows.append(bench_model(engine, model_id, args.trials))
        engine.unload()
    print(f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"device {engine.device}, dtype setting {args.dtype}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
