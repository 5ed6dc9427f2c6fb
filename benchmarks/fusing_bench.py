"""Fused Llama layers (`uniun_ray/models/load/fusing.py`) against transformers' own, in one run.

    .venv/bin/python benchmarks/fusing_bench.py [--batches 1,4,8,16] [--rounds 3] [--threads 1] [--quick]

SmolLM2-135M-Instruct is loaded four times, packed for oneDNN as the engine runs it on a CPU:
bf16 and float32, each with transformers' layers and fused. Each round takes the engine's own
step profile (`measure_profile`, as `packing_bench.py` does) of every copy in turn, so a load
that comes and goes stretches them all alike; a figure is the median over rounds. One thread by
default: the engine's loop serves at one thread beside the HTTP front end on two cores
(docs/tuning.md). Also prints the largest difference between the two copies' logits.
Writes its rows through `record.py` (section "slots", `benchmarks/results/fusing_bench.json`).
Measure alone: two programs on two cores measure nothing.
"""
from __future__ import annotations

import torch

from packing_bench import arguments, largest_difference, load, median_steps
from record import Record
from uniun_ray.models.load import fusing
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, materialize, resolve

DTYPES = ("bfloat16", "float32")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], threads=1)
    batches = args.batches
    folder = materialize(resolve(DEFAULT_CHAT_MODEL))
    copies = {(dtype, fused): load(folder, getattr(torch, dtype), packed=True, fused=fused)
              for dtype in DTYPES for fused in (False, True)}
    drift = {dtype: largest_difference(copies[dtype, True], copies[dtype, False]) for dtype in DTYPES}
    steps = median_steps(copies, batches, args.rounds)
    record = Record("slots", quick=args.quick, note=f"{DEFAULT_CHAT_MODEL}, packed, median of {args.rounds} rounds")
    for dtype in DTYPES:
        record.runs_on(threads=args.threads, dtype=dtype, engine="transformers")
        own, fused = steps[dtype, False], steps[dtype, True]
        record.row(f"decode step, ms by batch: transformers' layers / fused ({dtype})",
                   "; ".join(f"{b}: {own[b]:.1f} / {fused[b]:.1f}" for b in batches))
        record.row(f"fused / transformers' step at batch 4 ({dtype}); logits' largest difference",
                   f"{fused[4] / own[4]:.2f}×; {drift[dtype]:.1e}")
    record.save()


if __name__ == "__main__":
    main()
