"""The anchor of the GPU benchmark: transformers' own `generate` with a static cache, compiled.

    python3 benchmarks/gpu_anchor.py FOLDER --rows 1,64 [--prompt-tokens 256] [--new-tokens 128] [--device cuda]
                                            [--vocabulary N]

On a GPU `generate` with ``cache_implementation="static"`` compiles the model's forward
(``torch.compile``, mode reduce-overhead: CUDA graphs) and replays it each decode step: what
transformers itself reaches on this machine, in this run. On a CPU it does not compile (the
benchmark's own test runs it there). Each row count is run twice, the first to compile and
warm up; the second is timed per step by a streamer, which `generate` hands every new token
after the step's host sync (it syncs each step anyway to check for the end): the steps after
the first token are the steady decode steps, the prefill is the time to the first.

One JSON line per row count, ``ANCHOR {...}``, as each ends: the benchmark runs this in a
process of its own (its compiled graphs and memory go with it) with a time limit, and keeps the
lines printed before it. The prompts are ``prompt_ids``: the project is measured on the same.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

#: Token ids below this are left out of the prompts: the special ids sit at the start of a vocabulary.
FIRST_ORDINARY_ID = 64


def prompt_ids(row: int, tokens: int, vocabulary: int, seed: int = 0) -> tuple[int, ...]:
    """The ``row``-th prompt: ``tokens`` seeded random ids, a different one per row (no prefix shared)."""
    draw = random.Random(seed * 1_000_003 + row)
    return tuple(draw.randrange(FIRST_ORDINARY_ID, vocabulary) for _ in range(tokens))


class StepClock:
    """A `generate` streamer that notes when each put arrives: the prompt, then one per token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def measure(model, rows: int, prompt_tokens: int, new_tokens: int, device: str, vocabulary: int) -> dict:
    """One row count: a warm-up `generate` (the compile), then a timed one."""
    import torch

    ids = torch.tensor([prompt_ids(row, prompt_tokens, vocabulary) for row in range(rows)], device=device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static")
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(**kwargs)
    sync(device)
    first_call_s = time.perf_counter() - started
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(**kwargs, streamer=clock)
    sync(device)
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    step = statistics.median(steps)
    return {"rows": rows, "step_ms": step * 1e3, "tok_s": rows / step,
            "p90_step_ms": sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3, "timed_steps": len(steps),
            "prefill_ms": (clock.times[1] - clock.times[0]) * 1e3, "first_call_s": first_call_s,
            "new_tokens": out.shape[1] - prompt_tokens, "compiled": hasattr(model, "_compiled_call")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocabulary", type=int, help="prompt ids are drawn below this (default: the model's vocabulary)")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype, device_map=args.device,
                                                 use_kernels=False).eval()
    print("ANCHOR", json.dumps({"load_s": time.perf_counter() - started,
                                "attention": model.config._attn_implementation}), flush=True)
    for rows in map(int, args.rows.split(",")):
        try:
            result = measure(model, rows, args.prompt_tokens, args.new_tokens, args.device,
                             args.vocabulary or model.config.vocab_size)
        except Exception as error:  # noqa: BLE001 - a row count the anchor cannot run is a finding too
            result = {"rows": rows, "error": f"{type(error).__name__}: {error}"[:400]}
        print("ANCHOR", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
