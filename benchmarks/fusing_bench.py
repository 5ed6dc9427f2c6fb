"""Fused Llama layers (`uniun_ray/models/load/fusing.py`) against transformers' own, in one run.

    .venv/bin/python benchmarks/fusing_bench.py [--batches 1,4,8,16] [--rounds 3] [--threads 1] [--quick]

SmolLM2-135M-Instruct is loaded four times, packed for oneDNN as the engine runs it on a CPU:
bf16 and float32, each with transformers' layers and fused. Each round takes the engine's own
step profile (`measure_profile`, as `packing_bench.py` does) of every copy in turn, so a load
that comes and goes stretches them all alike; a figure is the median over rounds. One thread by
default: the engine's loop serves at one thread beside the HTTP front end on two cores
(docs/tuning.md). Also checks that the fused copy's logits are the other's (the same bits).
Writes its rows through `record.py` (section "slots", `benchmarks/results/fusing_bench.json`).
Measure alone: two programs on two cores measure nothing.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from packing_bench import decode_steps, load
from record import Record
from uniun_ray.models.load import fusing
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, materialize, resolve

DTYPES = ("bfloat16", "float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 4, one round: proves it runs")
    args = ap.parse_args()
    batches = (1, 4) if args.quick else tuple(int(b) for b in args.batches.split(","))
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    folder = materialize(resolve(DEFAULT_CHAT_MODEL))
    copies = {(dtype, fused): load(folder, getattr(torch, dtype), packed=True, fused=fused)
              for dtype in DTYPES for fused in (False, True)}
    ids = torch.tensor([list(range(1, 65))])
    with torch.inference_mode():
        drift = {dtype: float((copies[dtype, True](input_ids=ids).logits - copies[dtype, False](input_ids=ids).logits)
                              .abs().max()) for dtype in DTYPES}
    steps = {copy: {batch: [] for batch in batches} for copy in copies}
    for _ in range(rounds):
        for copy, model in copies.items():
            for batch, seconds in decode_steps(model, batches).items():
                steps[copy][batch].append(seconds)
    record = Record("slots", quick=args.quick, note=f"{DEFAULT_CHAT_MODEL}, packed, median of {rounds} rounds")
    for dtype in DTYPES:
        record.runs_on(threads=args.threads, dtype=dtype, engine="transformers")
        own = {b: statistics.median(steps[dtype, False][b]) * 1e3 for b in batches}
        fused = {b: statistics.median(steps[dtype, True][b]) * 1e3 for b in batches}
        record.row(f"decode step, ms by batch: transformers' layers / fused ({dtype})",
                   "; ".join(f"{b}: {own[b]:.1f} / {fused[b]:.1f}" for b in batches))
        record.row(f"fused / transformers' step at batch 4 ({dtype}); logits' largest difference",
                   f"{fused[4] / own[4]:.2f}×; {drift[dtype]:.1e}")
    record.save()


if __name__ == "__main__":
    main()
