"""R15 benchmark: the cost of one finish -> dispatch -> submit cycle with N queued jobs,
for SchedulerPolicy and for the notes' scan-and-sort picker, in the same run.

    .venv/bin/python benchmarks/pick_cost.py            # prints a markdown table

The queue holds a mix of kinds, models, producers and deadlines; every cycle finishes the
running job (which dispatches the next) and submits one new job, so the queue length
stays at N.
"""
from __future__ import annotations

import argparse
import gc
import platform
import time

from notes_picker import NotesJob, NotesScheduler

from uniun_ray.policy import Job, SchedulerPolicy

KINDS = ("nataraj", "gana", "extract", "nataraj", "gana")


def _fields(i: int) -> dict:
    kind = KINDS[i % len(KINDS)]
    return dict(kind=kind, model_id=("m", "y")[i % 2 if kind != "extract" else 0],
                deadline=(1e9 + i) if kind == "gana" and i % 7 == 0 else None)


def _settle() -> None:
    """Move the queue built during setup out of the cyclic GC's way, for both pickers
    alike: otherwise a full collection, which walks every live object, is charged to
    whichever cycle happens to trigger it and the figure measures the heap, not the
    picker."""
    gc.collect()
    gc.freeze()


def _policy_cycle_cost(n: int, cycles: int) -> float:
    p = SchedulerPolicy()
    for i in range(n):
        f = _fields(i)
        p.submit(Job(f"j{i}", producer=f"{f['kind']}:{i % 50}", **f), 0.0)
    now, i = 1.0, n
    _settle()
    start = time.perf_counter()
    for _ in range(cycles):
        now += 0.001
        p.finish(p.running_job.id, now, "done")
        f = _fields(i)
        p.submit(Job(f"j{i}", producer=f"{f['kind']}:{i % 50}", **f), now)
        i += 1
    return (time.perf_counter() - start) / cycles


def _notes_cycle_cost(n: int, cycles: int) -> float:
    s = NotesScheduler()
    for i in range(n):
        s.run(NotesJob(f"j{i}", **_fields(i)), 0.0)
    now, i = 1.0, n
    _settle()
    start = time.perf_counter()
    for _ in range(cycles):
        now += 0.001
        s.finish_running(now)
        s.run(NotesJob(f"j{i}", **_fields(i)), now)
        i += 1
    return (time.perf_counter() - start) / cycles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="100,1000,10000,100000")
    args = ap.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}\n")
    print("| queued jobs | SchedulerPolicy (µs/cycle) | notes' picker (µs/cycle) | speed-up |")
    print("|---:|---:|---:|---:|")
    for n in map(int, args.sizes.split(",")):
        ours = _policy_cycle_cost(n, cycles=2000)
        notes = _notes_cycle_cost(n, cycles=max(3, 200_000 // n))
        print(f"| {n:,} | {ours * 1e6:,.1f} | {notes * 1e6:,.0f} | {notes / ours:,.0f}× |")


if __name__ == "__main__":
    main()
