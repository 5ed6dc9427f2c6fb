"""A live thread's OpenMP team against the decode loop's kernels (`cores.in_own_thread`), in one run.

    .venv/bin/python benchmarks/loader_thread.py [--passes 8] [--quick]

SmolLM2-135M-Instruct is loaded by the engine (its load runs in a thread that ends). Then, in a
process of its own each: "none" runs nothing else; "live team" first reads a prompt in the main
thread, which then stays alive with its OpenMP team, as a loading thread that outlived the load
did. Each then reads fresh prompts in a new thread at 2 torch threads, as the decode loop does,
and the figure is the median prefill pass (wall) and the process's CPU over wall in those passes
(2.0: both threads working). Measure alone. Writes `benchmarks/results/loader_thread.json`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

from record import Record

MODES = ("none", "live team")


def passes(mode: str, count: int) -> dict:
    """In this process: ``count`` prefill passes at 2 threads in a new thread, after ``mode``."""
    import torch

    from uniun_ray.models import DEFAULT_CHAT_MODEL, Engine, GenerateRequest, generate
    from uniun_ray.models.decode import batch
    from uniun_ray.settings import Settings

    engine = Engine(settings=Settings.load(flags={"engine": None}).engine_settings)
    engine.load(DEFAULT_CHAT_MODEL)
    timed, prefill = [], batch.Batch._prefill

    def timing(self, job):
        wall, cpu = time.perf_counter(), time.process_time()
        prefill(self, job)
        timed.append((time.perf_counter() - wall, time.process_time() - cpu))

    def read(number: int) -> None:
        engine.resident.prefix.clear()
        request = GenerateRequest(prompt=f"Question {number}: name a sea animal and say why it is interesting.",
                                  max_new_tokens=2)
        for _ in generate(engine, request, cancel=threading.Event(), revocable=False):
            pass

    if mode == "live team":
        torch.set_num_threads(2)
        read(0)
    batch.Batch._prefill = timing

    def loop() -> None:
        torch.set_num_threads(2)
        for number in range(1, count + 1):
            read(number)

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    walls, cpus = [w for w, _ in timed], [c for _, c in timed]
    return {"pass_s": statistics.median(walls), "cores": sum(cpus) / sum(walls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=8, help="prompts read in the new thread (two passes each in bf16)")
    ap.add_argument("--quick", action="store_true", help="2 prompts")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)   # one process's part
    args = ap.parse_args()
    count = 2 if args.quick else args.passes
    if args.mode:
        print(json.dumps(passes(args.mode, count)))
        return
    record = Record("slots", quick=args.quick, note=f"smollm2-135m-instruct, {count} prompts a mode, 2 threads")
    record.runs_on(threads=2, engine="transformers")
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--passes", str(count)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        figures = json.loads(out)
        record.row(f"a prefill pass in the loop's thread, other OpenMP team: {mode} (median; cores busy)",
                   f"{figures['pass_s'] * 1e3:.1f} ms; {figures['cores']:.2f}")
    record.save()


if __name__ == "__main__":
    main()
