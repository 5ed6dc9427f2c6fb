"""int8 linear layers (``UNIUN_DTYPE=int8``, `uniun_ray/models/load/int8.py`) against float32, in one run:
what they cost in accuracy and what they buy in speed.

    .venv/bin/python benchmarks/int8_quality.py [--threads 1] [--quick]

SmolLM2-135M-Instruct (the converted copy in ``UNIUN_CACHE_DIR``) is loaded twice in float32:
packed for oneDNN (what float32 serves) and with int8 linears. Accuracy: perplexity over a fixed
English text (the module docstring of Python's ``argparse``, its first 1,024 tokens), and, for
five chat prompts, the first of 48 greedy tokens where int8 leaves float32's. Speed: the engine's
own step profile (`measure_profile`: decode steps of B rows as a batch keeps them) at 1, 4 and
8 rows, and a 64-token prefill, each the median over rounds that take both copies in turn.
Writes its rows through `record.py` (section "int8"). Measure alone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import packing_bench
from record import Record
from uniun_ray.models.load import int8
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, materialize, resolve

PROMPTS = ["Write a short story about a robot who learns to paint.", "What is the capital of France and why?",
           "Explain how a bicycle works.", "List three tips for learning a new language.",
           "Summarize the plot of Hamlet."]


def load(folder, quantized: bool):
    model = packing_bench.load(folder, torch.float32, packed=not quantized)
    if quantized:
        int8.quantize(model)
    return model


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        return float(torch.exp(model(ids, labels=ids).loss))


def divergence(models: dict, tokenizer) -> list[int]:
    """Per prompt, the first greedy token (of 48) where int8's differs from float32's."""
    firsts = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            outs = [model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
                    for model in models.values()]
        firsts.append(next((i for i, (a, b) in enumerate(zip(*outs)) if a != b), min(map(len, outs))))
    return firsts


def prefill_s(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: as the device serves on 2 cores)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round, two prompts: proves it runs")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    folder = materialize(resolve(DEFAULT_CHAT_MODEL))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    models = {"float32": load(folder, False), "int8": load(folder, True)}
    text = tokenizer(argparse.__doc__, return_tensors="pt").input_ids[:, :1024]
    batches, prompt = (1, 4, 8), torch.tensor([list(range(1, 65))])
    steps = {name: {batch: [] for batch in batches} for name in models}
    prefills: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            for batch, seconds in packing_bench.decode_steps(model, batches).items():
                steps[name][batch].append(seconds)
            prefills[name].append(prefill_s(model, prompt))
    if args.quick:
        PROMPTS[2:] = []
    firsts = divergence(models, tokenizer)
    record = Record("int8", quick=args.quick, note=f"{DEFAULT_CHAT_MODEL}, median of {rounds} rounds")
    record.runs_on(threads=args.threads, engine="transformers")
    ppl = {name: perplexity(model, text) for name, model in models.items()}
    record.row("perplexity over argparse's docstring (1,024 tokens): float32 / int8",
               f"{ppl['float32']:.2f} / {ppl['int8']:.2f} (+{ppl['int8'] / ppl['float32'] - 1:.1%})")
    record.row(f"greedy: the first of 48 tokens where int8 leaves float32, per prompt ({len(PROMPTS)})",
               ", ".join(map(str, firsts)))
    median = {name: {b: statistics.median(s) * 1e3 for b, s in by.items()} for name, by in steps.items()}
    record.row("decode step, ms by rows: float32 packed / int8",
               "; ".join(f"{b}: {median['float32'][b]:.0f} / {median['int8'][b]:.0f}" for b in batches))
    pre = {name: statistics.median(s) * 1e3 for name, s in prefills.items()}
    record.row("a 64-token prefill, ms: float32 packed / int8", f"{pre['float32']:.0f} / {pre['int8']:.0f}")
    record.save()


if __name__ == "__main__":
    main()
