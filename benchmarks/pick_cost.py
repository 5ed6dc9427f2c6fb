"""R15 benchmark: the cost of one finish -> dispatch -> submit cycle with N queued jobs,
for SchedulerPolicy on pools of 1, 4 and 16 devices, on one device of 1, 8 and 32 slots
(issue 24: a slot decision), and for the notes' scan-and-sort picker (one device), in the
same run.

    .venv/bin/python benchmarks/pick_cost.py            # section "policy cost" of BENCHMARKS.md
    .venv/bin/python benchmarks/pick_cost.py --quick    # two queue sizes, fewer cycles

The queue holds a mix of kinds, models, producers and deadlines; every cycle finishes one
running job (the devices take turns), which dispatches the next onto the freed device, and
submits one new job, so the queue length stays at N and every device stays busy. Times
are this process's CPU time (`time.process_time`), so that other work on a shared machine
is not counted.
"""
from __future__ import annotations

import argparse
import gc
import time
from collections import deque

from notes_picker import NotesJob, NotesScheduler
from record import Record

from uniun_ray.policy import Dispatch, Job, SchedulerPolicy

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


def _policy_cycle_cost(n: int, cycles: int, devices: int, slots: int = 1) -> float:
    """One cycle: the oldest running job finishes (its slot takes the next job) and one job
    is submitted. Every slot of every device stays busy."""
    names = tuple(f"dev{d}" for d in range(devices))
    p = SchedulerPolicy(devices=names, slots=slots)
    for i in range(n):
        f = _fields(i)
        p.submit(Job(f"j{i}", producer=f"{f['kind']}:{i % 50}", **f), 0.0)
    running = deque(job.id for jobs in p.slot_jobs.values() for job in jobs)
    now, i = 1.0, n
    _settle()
    start = time.process_time()
    for _ in range(cycles):
        now += 0.001
        actions = p.finish(running.popleft(), now, "done")
        f = _fields(i)
        actions += p.submit(Job(f"j{i}", producer=f"{f['kind']}:{i % 50}", **f), now)
        running.extend(a.job_id for a in actions if isinstance(a, Dispatch))
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
    ap.add_argument("--slots", default="1,8,32", help="slot counts of one device (default: 1,8,32)")
    ap.add_argument("--quick", action="store_true", help="100 and 10,000 queued jobs, 1 and 4 devices, fewer cycles")
    args = ap.parse_args()
    sizes = [100, 10_000] if args.quick else [int(n) for n in args.sizes.split(",")]
    pools = [1, 4] if args.quick else [int(d) for d in args.devices.split(",")]
    slot_counts = [int(c) for c in args.slots.split(",")]
    cycles = 500 if args.quick else 2000
    record = Record("policy-cost", quick=args.quick)
    one_device = {}
    for n in sizes:
        ours = [_policy_cycle_cost(n, cycles=cycles, devices=d) for d in pools]
        notes = _notes_cycle_cost(n, cycles=max(3, cycles * 100 // n))
        one_device[n] = ours[0]
        record.row(f"finish → dispatch → submit cycle, {n:,} queued: SchedulerPolicy on "
                   f"{' / '.join(map(str, pools))} device(s)", " / ".join(f"{c * 1e6:,.1f}" for c in ours) + " µs")
        record.row(f"the same, {n:,} queued: the notes' picker (rescans and sorts), 1 device",
                   f"{notes * 1e6:,.0f} µs ({notes / ours[0]:,.{0 if notes >= 10 * ours[0] else 1}f}× SchedulerPolicy)")
    growth = one_device[max(sizes)] / one_device[min(sizes)]
    record.row(f"SchedulerPolicy's cycle at {max(sizes):,} queued / at {min(sizes):,}, 1 device",
               f"{growth:.2f}×", goal="flat in queued jobs (R15): ≤ 2×", met=growth <= 2)
    slotted = {n: [_policy_cycle_cost(n, cycles=cycles, devices=1, slots=s) for s in slot_counts] for n in sizes}
    for n in sizes:
        record.row(f"the same cycle (one slot decision), {n:,} queued: 1 device of "
                   f"{' / '.join(map(str, slot_counts))} slots", " / ".join(f"{c * 1e6:,.1f}" for c in slotted[n]) + " µs")
    for k, count in enumerate(slot_counts):
        growth = slotted[max(sizes)][k] / slotted[min(sizes)][k]
        record.row(f"at {count} slots: the cycle at {max(sizes):,} queued / at {min(sizes):,}",
                   f"{growth:.2f}×", goal="flat in queued jobs per slot decision (R15, issue 24): ≤ 2×",
                   met=growth <= 2)
    record.save()


if __name__ == "__main__":
    main()
