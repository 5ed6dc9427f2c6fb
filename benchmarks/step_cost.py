"""What one CPU decode step costs: the padded rows as they were against as they are, in one run.

    .venv/bin/python benchmarks/step_cost.py                    # SmolLM2, float32, 1, 4 and 16 rows, 1 and 2 threads
    .venv/bin/python benchmarks/step_cost.py --prompt 1024      # longer contexts: the KV copy grows with them
    .venv/bin/python benchmarks/step_cost.py --quick            # one round, 1 and 4 rows: proves it runs

The model is loaded as the engine loads it on a CPU (``prefer_grouped`` attention, linear
weights packed for oneDNN). One prompt of ``--prompt`` tokens is prefilled from nothing (so its
cache has transformers' plain layers, as a job's without a prefix hit); each round, for every
thread count and row count, that many copies of it cut to different lengths
(``runner.profile.row_lengths``) join fresh rows of each path, and the paths take ``--steps``
timed decode steps (one token per row, after two untimed) in turn, step by step, their contexts
growing, as ``runner/profile.py`` steps them.
Paths:

* ``concatenating``: the rows before their cache grew in place: the first row's cache as it came,
  its plain layers concatenating a copy of the batch's keys and values in every layer, every step;
* ``growing``: ``runner.rows.PaddedRows`` as it is.

Prints, per rows and threads, the median step (wall and the process's CPU seconds) over every
round's steps, tokens per second, the ratio to ``concatenating`` and whether both paths chose the
same greedy tokens at every step. Alternating the paths in one process, a host load that comes
and goes stretches both alike: read the ratios; on a shared host the absolute figures are not
the host's.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from uniun_ray.models.kv.prefix import crop_layers  # noqa: E402
from uniun_ray.models.load import packing  # noqa: E402
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, materialize, resolve  # noqa: E402
from uniun_ray.models.runner.attention import prefer_grouped  # noqa: E402
from uniun_ray.models.runner.forward import Inputs, Runner  # noqa: E402
from uniun_ray.models.runner.profile import row_lengths  # noqa: E402
from uniun_ray.models.runner.rows import PaddedRows  # noqa: E402

WARMUP = 2


class ConcatenatingRows(PaddedRows):
    """The padded rows as they were: the batch's cache is the first row's as it came."""

    def join(self, cache, tokens: int) -> None:
        first = len(self) == 0
        super().join(cache, tokens)
        if first:
            self._cache = cache


PATHS = {"concatenating": ConcatenatingRows, "growing": PaddedRows}


def load(model_id: str, dtype: str) -> Runner:
    from transformers import AutoModelForCausalLM

    folder = materialize(resolve(model_id))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), device_map="cpu",
                                                 use_kernels=False).eval()
    prefer_grouped(model)
    packing.pack(model)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return Runner(model, cache_arg, {"logits_to_keep": 1})


def prefilled(runner: Runner, prompt: int):
    vocab = runner.model.config.vocab_size - 1
    ids = [(7919 * i) % vocab + 1 for i in range(prompt)]
    return runner.prefill(ids, None, torch.device("cpu"))[1]


def joined(rows_class, runner: Runner, cache, batch: int, prompt: int):
    """Fresh rows of ``rows_class`` holding ``batch`` copies of ``cache`` cut to ``row_lengths``."""
    rows, lengths = rows_class(torch.device("cpu"), runner), row_lengths(batch, prompt)
    for length in lengths:
        row = copy.deepcopy(cache)
        crop_layers(row, length)
        rows.join(row, length)
    return rows, lengths


def steps_of(runner: Runner, cache, batch: int, prompt: int, steps: int) -> dict[str, tuple]:
    """Per path: wall and CPU seconds of each timed step, and the tokens every step chose. The
    paths take their steps in turn, step by step, so that a load that comes and goes beside
    them stretches each alike."""
    rows = {path: joined(rows_class, runner, cache, batch, prompt) for path, rows_class in PATHS.items()}
    tokens = {path: [1] * batch for path in PATHS}
    timed = {path: ([], [], []) for path in PATHS}
    for i in range(WARMUP + steps):
        for path, (kept, lengths) in rows.items():
            wall, cpu, chosen = timed[path]
            started, started_cpu = time.perf_counter(), time.process_time()
            tokens[path] = kept.decode(Inputs.of(tokens[path], [length + i for length in lengths], kept.device)).argmax(-1).tolist()
            if i >= WARMUP:
                wall.append(time.perf_counter() - started)
                cpu.append(time.process_time() - started_cpu)
            chosen.append(tokens[path])
    for kept, _ in rows.values():
        kept.clear()
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_CHAT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", default="1,4,16", help="row counts, comma-separated")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    parser.add_argument("--prompt", type=int, default=256, help="tokens of the longest row at the start")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round of 4 steps at 1 and 4 rows")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.steps, args.rounds = "1,4", 4, 1
    batches, threads = [int(b) for b in args.rows.split(",")], [int(n) for n in args.threads.split(",")]
    runner = load(args.model, args.dtype)
    cache = prefilled(runner, args.prompt)
    keys = [(path, n, batch) for batch in batches for n in threads for path in PATHS]
    wall, cpu, chosen = ({key: [] for key in keys} for _ in range(3))
    for _ in range(args.rounds):
        for n in threads:
            torch.set_num_threads(n)
            for batch in batches:
                for path, (seconds, cpu_seconds, tokens) in steps_of(runner, cache, batch, args.prompt,
                                                                     args.steps).items():
                    wall[path, n, batch] += seconds
                    cpu[path, n, batch] += cpu_seconds
                    chosen[path, n, batch].append(tokens)
    print(f"{args.model}, {args.dtype}, {args.prompt}-token prompts, {args.steps} steps x {args.rounds} rounds, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"{'rows':>4} {'threads':>7} {'path':>14} {'wall ms':>8} {'cpu ms':>7} {'tok/s':>7} {'ratio':>6}  same tokens")
    for path, n, batch in keys:
        step, base = statistics.median(wall[path, n, batch]), statistics.median(wall["concatenating", n, batch])
        same = chosen[path, n, batch] == chosen["concatenating", n, batch]
        print(f"{batch:4d} {n:7d} {path:>14} {step * 1e3:8.1f} {statistics.median(cpu[path, n, batch]) * 1e3:7.1f} "
              f"{batch / step:7.1f} {step / base:6.2f}  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
