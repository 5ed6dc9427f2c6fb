"""Packed linear weights (`uniun_ray/models/load/packing.py`) against plain `nn.Linear`, in one run.

    .venv/bin/python benchmarks/packing_bench.py [--batches 1,4,8,16] [--rounds 3] [--threads 2] [--quick]

SmolLM2-135M-Instruct (the converted copy in ``UNIUN_CACHE_DIR``) is loaded four times: bf16 and
float32, each plain and packed. Each round takes the engine's own step profile
(`uniun_ray/models/host/steps.measure_profile`: decode steps of B rows as a batch keeps them) of every copy in
turn, so a load that comes and goes stretches them all alike; a figure is the median over rounds.
Also checks that the packed copy's logits are the plain copy's (bf16: bit-identical here).
Writes its rows through `record.py` (section "slots", `benchmarks/results/packing_bench.json`).
Measure alone: two programs on two cores measure nothing.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from record import Record
from uniun_ray.models.load import fusing, packing
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, materialize, resolve
from uniun_ray.models.runner.profile import measure_profile
from uniun_ray.models.runner.forward import Runner


def load(folder, dtype: torch.dtype, packed: bool, fused: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_kernels=False).eval()
    if fused:
        fusing.fuse(model)
    if packed:
        packing.pack(model)
    return model


def decode_steps(model, batches: tuple[int, ...]) -> dict[int, float]:
    """Seconds of one decode step of ``model`` at each batch size, as the engine's probe times it."""
    return measure_profile(Runner(model, "cache", {"logits_to_keep": 1}), model.config.vocab_size,
                           torch.device("cpu"), batches)[0]


def arguments(description: str, threads: int):
    """The options both this bench and ``fusing_bench`` take; ``quick`` already applied."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 4, one round: proves it runs")
    args = ap.parse_args()
    args.batches = (1, 4) if args.quick else tuple(int(b) for b in args.batches.split(","))
    args.rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    return args


def largest_difference(one, other) -> float:
    """The largest difference between two copies' logits over one 64-token prompt."""
    ids = torch.tensor([list(range(1, 65))])
    with torch.inference_mode():
        return float((one(input_ids=ids).logits - other(input_ids=ids).logits).abs().max())


def median_steps(copies: dict, batches: tuple[int, ...], rounds: int) -> dict:
    """Per copy and batch, the median step in ms over ``rounds`` rounds, the copies in turn each round."""
    steps = {copy: {batch: [] for batch in batches} for copy in copies}
    for _ in range(rounds):
        for copy, model in copies.items():
            for batch, seconds in decode_steps(model, batches).items():
                steps[copy][batch].append(seconds)
    return {copy: {b: statistics.median(times) * 1e3 for b, times in by_batch.items()}
            for copy, by_batch in steps.items()}


def main() -> None:
    args = arguments(__doc__.splitlines()[0], torch.get_num_threads())
    batches = args.batches
    folder = materialize(resolve(DEFAULT_CHAT_MODEL))
    copies = {(dtype, packed): load(folder, getattr(torch, dtype), packed)
              for dtype in ("bfloat16", "float32") for packed in (False, True)}
    drift = {dtype: largest_difference(copies[dtype, True], copies[dtype, False]) for dtype in ("bfloat16", "float32")}
    steps = median_steps(copies, batches, args.rounds)
    record = Record("slots", quick=args.quick, note=f"{DEFAULT_CHAT_MODEL}, median of {args.rounds} rounds")
    for dtype in ("bfloat16", "float32"):
        record.runs_on(threads=args.threads, dtype=dtype, engine="transformers")
        plain, packed = steps[dtype, False], steps[dtype, True]
        record.row(f"decode step, ms by batch: plain `nn.Linear` / packed for oneDNN ({dtype})",
                   "; ".join(f"{b}: {plain[b]:.0f} / {packed[b]:.0f}" for b in batches))
        big = max(batches)
        record.row(f"packed / plain step at batch {big} ({dtype}); logits' largest difference",
                   f"{packed[big] / plain[big]:.2f}×; {drift[dtype]:.1e}")
    record.save()


if __name__ == "__main__":
    main()
