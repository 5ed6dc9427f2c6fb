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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="batch 1 and 4, one round: proves it runs")
    args = ap.parse_args()
    batches = (1, 4) if args.quick else tuple(int(b) for b in args.batches.split(","))
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    folder = materialize(resolve(DEFAULT_CHAT_MODEL))
    copies = {(dtype, packed): load(folder, getattr(torch, dtype), packed)
              for dtype in ("bfloat16", "float32") for packed in (False, True)}
    ids = torch.tensor([list(range(1, 65))])
    with torch.inference_mode():
        drift = {dtype: float((copies[dtype, True](input_ids=ids).logits - copies[dtype, False](input_ids=ids).logits)
                              .abs().max()) for dtype in ("bfloat16", "float32")}
    steps = {copy: {batch: [] for batch in batches} for copy in copies}
    for _ in range(rounds):
        for copy, model in copies.items():
            for batch, seconds in decode_steps(model, batches).items():
                steps[copy][batch].append(seconds)
    record = Record("slots", quick=args.quick, note=f"{DEFAULT_CHAT_MODEL}, median of {rounds} rounds")
    for dtype in ("bfloat16", "float32"):
        record.runs_on(threads=args.threads, dtype=dtype, engine="transformers")
        plain = {b: statistics.median(steps[dtype, False][b]) * 1e3 for b in batches}
        packed = {b: statistics.median(steps[dtype, True][b]) * 1e3 for b in batches}
        record.row(f"decode step, ms by batch: plain `nn.Linear` / packed for oneDNN ({dtype})",
                   "; ".join(f"{b}: {plain[b]:.0f} / {packed[b]:.0f}" for b in batches))
        big = max(batches)
        record.row(f"packed / plain step at batch {big} ({dtype}); logits' largest difference",
                   f"{packed[big] / plain[big]:.2f}×; {drift[dtype]:.1e}")
    record.save()


if __name__ == "__main__":
    main()
