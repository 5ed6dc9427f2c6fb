"""R15 benchmark: the cost of one finish -> dispatch -> submit cycle with N queued jobs,
for SchedulerPolicy on pools of 1, 4 and 16 devices and for the notes' scan-and-sort
picker (one device), in the same run.

    .venv/bin/python benchmarks/pick_cost.py            # prints a markdown table

The queue holds a mix of kinds, models, producers and deadlines; every cycle finishes one
running job (the devices take turns), which dispatches the next onto the freed device, and
submits one new job, so the queue length stays at N and every device stays busy. Times
are this process's CPU time (`time.process_time`), so that other work on a shared machine
is not counted.
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


def _policy_cycle_cost(n: int, cycles: int, devices: int) -> float:
    names = tuple(f"dev{d}" for d in range(devices))
    p = SchedulerPolicy(devices=names)
    for i in range(n):
        f = _fields(i)
        p.submit(Job(f"j{i}", producer=f"{f['kind']}:{i % 50}", **f), 0.0)
    on = {device: job.id for device, job in p.running_jobs.items()}
    now, i = 1.0, n
    _settle()
    start = time.process_time()
    for k in range(cycles):
        now += 0.001
        (d,) = p.finish(on[names[k % devices]], now, "done")
        on[d.device] = d.job_id
        f = _fields(i)
        p.submit(Job(f"j{i}", producer=f"{f['kind']}:{i % 50}", **f), now)
        i += 1
    return (time.process_time() - start) / cycles


def _notes_cycle_cost(n: int, cycles: int) -> float:
    s = NotesScheduler()
    for i in range(n):
        s.run(NotesJob(f"j{i}", **_fields(i)), 0.0)
    now, i = 1.0, n
    _settle()
    start = time.process_time()
    for _ in range(cycles):
        now += 0.001
        s.finish_running(now)
        s.run(NotesJob(f"j{i}", **_fields(i)), now)
        i += 1
    return (time.process_time() - start) / cycles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="100,1000,10000,100000")
    ap.add_argument("--devices", default="1,4,16", help="pool sizes for SchedulerPolicy (default: 1,4,16)")
    args = ap.parse_args()
    pools = [int(d) for d in args.devices.split(",")]
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}\n")
    print("| queued jobs | " + " | ".join(f"SchedulerPolicy, {d} device{'s' * (d > 1)} (µs/cycle)" for d in pools)
          + " | notes' picker, 1 device (µs/cycle) | speed-up, 1 device |")
    print("|---:" * (len(pools) + 3) + "|")
    for n in map(int, args.sizes.split(",")):
        ours = [_policy_cycle_cost(n, cycles=2000, devices=d) for d in pools]
        notes = _notes_cycle_cost(n, cycles=max(3, 200_000 // n))
        print(f"| {n:,} | " + " | ".join(f"{c * 1e6:,.1f}" for c in ours)
              + f" | {notes * 1e6:,.0f} | {notes / ours[0]:,.0f}× |")


if __name__ == "__main__":
    main()
