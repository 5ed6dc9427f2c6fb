"""Padded against static KV rows: the engine's own decode step, per model and rows, on this host.

    .venv/bin/python benchmarks/kv_rows_bench.py                  # tiny and SmolLM2, 1, 4 and 8 rows
    .venv/bin/python benchmarks/kv_rows_bench.py --quick          # tiny only, 1 and 4 rows, few steps: it runs
    .venv/bin/python benchmarks/kv_rows_bench.py --threads 1 --clock cpu   # on a busy machine: CPU seconds
    .venv/bin/python benchmarks/kv_rows_bench.py --device cuda --dtype bfloat16 --rows 1,8,64

What ``runner.rows.rows_kind`` chooses per device (issue 36). For each model, kind ("padded"; "static",
exact shapes; "buckets", the fixed-shape steps CUDA graphs replay, here run without a capture;
"graphs" on a GPU) and row count B: B jobs of ``--prompt``-token prompts (each its own, so no
prefix-cache hit; each read in one pass) join a ``Batch`` on the engine's loaded model, then the steps where all B rows
decode together are timed one by one (``Batch.step``: the forward pass, the logits to the host,
every row's choice of token); the figure is the median step. Kinds take turns round by round
(``--repeats``), so a load that comes and goes beside it stretches each alike. No row stops at
an end-of-sequence token (the engine's EOS ids are set to none). Measure alone:
other work on the cores stretches every figure. The rows go to BENCHMARKS.md, section "kv-rows".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from record import Record  # noqa: E402

from uniun_ray.models import GenerateRequest  # noqa: E402
from uniun_ray.models.decode.batch import Batch  # noqa: E402
from uniun_ray.models.decode.engine import Engine  # noqa: E402
from uniun_ray.settings import EngineSettings  # noqa: E402
from uniun_ray.models.runner import rows as kv_rows  # noqa: E402
from uniun_ray.memory import plan  # noqa: E402
from uniun_ray.models.decode.engine import device_memory  # noqa: E402
from uniun_ray.models.load.parked import weight_bytes  # noqa: E402
from uniun_ray.models.runner.static import gpu_spare  # noqa: E402

KINDS = {"padded": ("padded", "exact"), "static": ("static", "exact"), "buckets": ("static", "buckets"),
         "graphs": ("static", "graphs")}


def use(engine: Engine, kind: str) -> None:
    """The engine's batches keep their KV in rows of ``kind`` from now on."""
    loaded = engine.resident
    loaded.rows = None          # the last kind's store freed before the next is allocated
    budget = plan(device_memory(engine.device), EngineSettings(), weight_bytes(loaded), static_rows=True).kv_rows
    if engine.device.type == "cuda":   # as the engine sizes them: at most what is free
        budget = min(budget, gpu_spare(engine.device, loaded.prefix.budget_bytes))
    loaded.rows = kv_rows.store_for(loaded.runner, engine.device, loaded.vocabulary.context_length,
                                    kv_rows.RowChoice(*KINDS[kind]), budget)


def prompt_of(engine: Engine, tokens: int, seed: int) -> tuple[int, ...]:
    """``tokens`` token ids no other row's prompt shares."""
    vocab = len(engine.resident.vocabulary.tokenizer)
    return tuple((seed * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(tokens))


def step_times(engine: Engine, rows: int, prompt: int, new: int, seed: int, clock) -> list[float]:
    """Seconds of each step in which all ``rows`` rows decoded together."""
    engine.resident.prefix.clear()
    engine.resident.eos_ids = frozenset({-1})    # no row ends early
    engine.prefill_chunk = prompt                  # a prompt joins in one step: all rows overlap `new` steps
    batch = Batch(engine, slots=rows)
    for row in range(rows):
        batch.add(GenerateRequest(prompt=prompt_of(engine, prompt, seed + row), max_new_tokens=new + rows),
                  threading.Event())
    times = []
    while batch.busy:
        started = clock()
        batch.step()
        if batch.last_step_rows == rows:
            times.append(clock() - started)
    return times[1:]      # the first full step follows the last join in the same step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,4,8", help="row counts, comma-separated")
    parser.add_argument("--kinds", default=None, help="of padded, static, buckets, graphs (default: "
                                                      "padded,static,buckets; graphs too on a GPU)")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=48, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every kind (median of all steps)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed (default); cpu: the process's CPU seconds, which other work on "
                             "the cores does not stretch (with --threads 1 on a busy machine)")
    parser.add_argument("--quick", action="store_true", help="tiny, 1 and 4 rows, 12 new tokens, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.rows, args.new, args.repeats = "tiny", "1,4", 12, 1
    kinds = (args.kinds or ("padded,static,buckets,graphs" if args.device.startswith("cuda")
                            else "padded,static,buckets")).split(",")
    rows = [int(n) for n in args.rows.split(",")]
    record = Record("kv-rows", quick=args.quick,
                    note=f"{args.prompt}-token prompts, {args.new} new tokens, {args.clock} clock")
    engine = Engine(args.device, EngineSettings(dtype=args.dtype, threads=args.threads))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    record.runs_on(threads=torch.get_num_threads(), dtype=args.dtype, engine="transformers")
    for model in args.models.split(","):
        engine.load(model)
        seconds: dict[tuple[str, int], list[float]] = {(kind, n): [] for kind in kinds for n in rows}
        for repeat in range(args.repeats):
            for kind in kinds:
                use(engine, kind)
                for n in rows:
                    seconds[(kind, n)] += step_times(engine, n, args.prompt, args.new, 1000 * repeat, clock)
        for n in rows:
            padded = statistics.median(seconds[(kinds[0], n)])
            for kind in kinds:
                step = statistics.median(seconds[(kind, n)])
                record.row(f"`{model}`, {n} rows, {kind} rows: one decode step",
                           f"{step * 1000:.2f} ms ({n / step:.0f} tok/s), {step / padded:.2f}× {kinds[0]}")
        engine.unload()
    record.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
