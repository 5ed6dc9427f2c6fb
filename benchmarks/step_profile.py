"""The step-time profile of a model on this host: seconds per batched decode step, per batch size.

    .venv/bin/python benchmarks/step_profile.py                       # SmolLM2, batch 1..32, both cores
    .venv/bin/python benchmarks/step_profile.py --quick              # batch 1, 2, 4, one short round: it runs
    .venv/bin/python benchmarks/step_profile.py --threads 1 --clock cpu   # on a busy machine: see below
    .venv/bin/python benchmarks/step_profile.py --device cuda --dtype bfloat16 --batches 1,2,4,8,16,32,64,128

What SPEC §6 (R23, R25) and the simulator's step-time profiles (`uniun_ray/sim/device.py`)
need: one decode step of B sequences at once, as a continuous-batching engine runs it with
transformers. For each batch size B: one prompt of ``--prompt`` tokens is prefilled into a
``DynamicCache``, B copies of it cut to different lengths (the shortest 3/4 of it) join the rows
the engine's ``Batch`` keeps on the device (``runner.rows.rows_for``), then ``--steps`` decode
forwards of one token per row, each given what those rows give a batch's step (mask and position
ids for several rows, none for one, as ``Batch`` runs it),
timed one by one after ``--warmup`` untimed ones; the step time is the median over ``--repeats``
such rounds. The decode steps are those of the engine's own probe at load
(`uniun_ray/models/runner/profile.py`, ``Engine.step_profile()``); this one takes more steps and rounds,
and any prompt length. The rounds go round-robin over the batch sizes, so a load that comes and
goes beside the probe stretches every size alike.
``torch.inference_mode``; float32 by default (the dtype the engine chose on the 2-core AVX2
hosts, `uniun_ray/models/MEASURED.md`); the model from the embedded registry (the converted
copy in ``UNIUN_CACHE_DIR``, converted on first use); ``--device cuda`` on a GPU.

Writes the profile as JSON (``--out``, default ``docs/bench/step-profile-<model>-<device>.json``):
the host (CPU model, torch's ISA, threads, load average before and after), the date, the
settings, and ``steps_s`` {batch: seconds} with tokens per second beside it; and its rows for
BENCHMARKS.md (`record.py`, section "slots-sim"). The simulator's curves are copied from the
profile by hand (`uniun_ray/sim/device.py`, "Batches"), with its date and host.

Measure on a quiet machine: anything running beside it (other processes on the same cores)
stretches the steps by whatever share of the cores it takes, and the figures are then not the
host's. Where the machine cannot be had alone, ``--threads 1 --clock cpu`` times each step in the
CPU seconds the process spent (``time.process_time``), which time-slicing does not stretch: the
shape of the curve at one thread, not the host's wall-clock speed with every core.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from record import Record  # noqa: E402

from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, materialize, resolve  # noqa: E402
from uniun_ray.models.runner.profile import decode_times, device_clock, joined_rows  # noqa: E402
from uniun_ray.models.runner.rows import RowChoice  # noqa: E402
from uniun_ray.models.runner.forward import Runner  # noqa: E402
from uniun_ray.models.tune.tuning import cpu_model  # noqa: E402


def load(model_id: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    folder = materialize(resolve(model_id))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), device_map=device,
                                                 use_kernels=False)   # offline, as the engine loads
    return model.eval()


def clock_of(kind: str, device: str):
    """Seconds now: elapsed (after the GPU's queued work, on CUDA) or the process's CPU time."""
    return time.process_time if kind == "cpu" else device_clock(torch.device(device))


def round_of_steps(model, batch: int, prompt: int, steps: int, warmup: int, clock) -> list[float]:
    """Prefill one row, join `batch` copies of it cut to different lengths to the rows a batch
    keeps, then time `steps` decode forwards (after `warmup` untimed ones), as the engine's probe
    at load times them (`uniun_ray.models.runner.profile`)."""
    # the forward's keyword for the KV cache: transformers 5 renamed past_key_values (as the engine reads it)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    vocab = model.config.vocab_size - 1
    ids = torch.tensor([[(7919 * i) % vocab + 1 for i in range(prompt)]], device=model.device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: None})
    rows, lengths = joined_rows(Runner(model, cache_arg, {"logits_to_keep": 1}), getattr(out, cache_arg), batch,
                                prompt, model.device, warmup + steps, RowChoice.of(model.device))
    return decode_times(rows, lengths, steps, warmup, clock)


def profile(model, batches: list[int], prompt: int, steps: int, warmup: int, repeats: int,
            clock) -> dict[int, float]:
    rounds: dict[int, list[float]] = {batch: [] for batch in batches}
    for _ in range(repeats):
        for batch in batches:
            rounds[batch].append(statistics.median(round_of_steps(model, batch, prompt, steps, warmup, clock)))
            print(f"batch {batch:3d}: {rounds[batch][-1] * 1000:8.1f} ms/step", file=sys.stderr)
    return {batch: statistics.median(medians) for batch, medians in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_CHAT_MODEL)
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=256, help="tokens in the longest prompt of a batch")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per batch size (median of medians)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed seconds (default); cpu: the process's CPU seconds (with --threads 1)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", help="float32 (default: what the engine runs on these CPUs), "
                                                            "bfloat16, float16")
    parser.add_argument("--out", help="JSON file (default: docs/bench/step-profile-<model>-<device>.json)")
    parser.add_argument("--quick", action="store_true", help="batch 1, 2, 4, one round of 4 steps: proves it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.steps, args.repeats = "1,2,4", 4, 1

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc)
    model = load(args.model, args.dtype, args.device)
    clock = clock_of(args.clock, args.device)
    steps = profile(model, batches, args.prompt, args.steps, args.warmup, args.repeats, clock)
    record = {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "host": {"machine": platform.machine(), "cpu": cpu_model(), "cores": os.cpu_count(),
                 "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability(),
                 "threads": args.threads, "load_before": load_before, "load_after": os.getloadavg()},
        "settings": {"prompt": args.prompt, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                     "clock": args.clock},
        "steps_s": {str(b): s for b, s in steps.items()},
        "tok_s": {str(b): b / s for b, s in steps.items()},
    }
    out = Path(args.out or Path(__file__).resolve().parent.parent / "docs" / "bench"
               / f"step-profile-{args.model}-{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.model}, {record['date']}, {record['host']['cpu']} ({record['host']['isa']}), "
          f"{args.threads} threads, {args.clock} clock, "
          f"load {load_before[0]:.2f} -> {record['host']['load_after'][0]:.2f}\n")
    record = Record("slots-sim", quick=args.quick, note=f"{args.clock} clock")
    record.runs_on(threads=args.threads, dtype=args.dtype, engine="transformers")
    first = batches[0]
    for b, seconds in steps.items():
        record.row(f"`{args.model}`: one decode step of {b} sequences ({args.prompt}-token prompts)",
                   f"{seconds * 1000:.1f} ms: {b / seconds:.1f} tok/s, "
                   f"{(b / seconds) / (first / steps[first]):.2f}× batch {first}'s")
    record.save()
    print(f"\nprofile written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
