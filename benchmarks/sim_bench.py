"""The simulator's figures for BENCHMARKS.md: this policy against the baselines (the goals of
issue 4), what the prefix KV cache saves, a pool of devices (the goals of issue 16), and one
device with slots on the cpu and gpu profiles (the goals of issue 24).

    .venv/bin/python benchmarks/sim_bench.py            # sections "simulator", "KV cache", "pool", "swaps", "slots-sim"
    .venv/bin/python benchmarks/sim_bench.py --quick    # issue118 and ganas only; pools of 1 and 2; 1 and 4 slots

Profile `cpu`, seed 1: every figure but a run's wall time is a function of the code, the
profile and the seed, not of the host. `uniun-ray bench` writes the whole tables and the
pictures (bench-out/).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from record import Record

from uniun_ray.sim import bench, poolbench, slotbench
from uniun_ray.sim.device import PROFILES
from uniun_ray.sim.metrics import p99_chat, swap_s_per_device_h
from uniun_ray.sim.simulator import AUTO
from uniun_ray.sim.workloads import POOL_WORKLOADS, SLOT_WORKLOADS, WORKLOADS, generate

SEED = 1
#: The load of the host moves a simulation's wall time only, which no row shows.
NOTE = "simulated: the host's load does not matter"
QUICK_WORKLOADS = ("issue118", "ganas")
SLOTS, QUICK_SLOTS = (1, 4, 8, 16), (1, 4)


def policies(results: dict, record: Record) -> None:
    """Per workload, the chat TTFT p99 and the swaps of every policy, side by side."""
    names = list(bench.POLICIES)
    for name, outcomes in results.items():
        if outcomes[bench.REAL].metrics.chat_n:
            record.row(f"{name}: chat TTFT p99, {' / '.join(names)}",
                       " / ".join(f"{outcomes[p].metrics.ttft_p99:.2f}" for p in names) + " s")
        record.row(f"{name}: swaps (forced), {' / '.join(names)}",
                   " / ".join(f"{outcomes[p].metrics.swaps} ({outcomes[p].metrics.forced_swaps})" for p in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"workloads {', '.join(QUICK_WORKLOADS)}; pools of 1 and 2")
    args = ap.parse_args()
    device, out = PROFILES["cpu"], Path(tempfile.mkdtemp(prefix="uniun-sim-bench-"))
    workloads = {name: generate(name, SEED) for name in (QUICK_WORKLOADS if args.quick else WORKLOADS)}
    results = {name: {p: bench.run_one(p, w, device, out, logs=False) for p in bench.POLICIES}
               for name, w in workloads.items()}

    record = Record("simulator", quick=args.quick, note=NOTE)
    for goal in bench.goals(results, workloads, device):
        record.row(goal.name, goal.detail, goal="issue 4", met=goal.ok)
    policies(results, record)
    record.save()

    cache = Record("kv-cache", quick=args.quick, name="sim_bench-kv", note=NOTE)
    for name, bare in bench.without_cache(workloads, device, out).items():
        cached = results[name][bench.REAL]
        ttft = "" if cached.metrics.ttft_p99 is None else \
            f"; chat TTFT p99 {cached.metrics.ttft_p99:.2f} / {bare.metrics.ttft_p99:.2f} s"
        cache.row(f"simulator, {name}: prefill with / without the prefix cache (policy `uniun`)",
                  f"{cached.prefill_s:,.0f} / {bare.prefill_s:,.0f} s ({bench.saved(cached, bare):.0%} saved){ttft}")
    cache.save()

    pool = Record("pool", quick=args.quick, name="sim_bench-pool", note=NOTE)
    for workload in map(lambda name: generate(name, SEED), POOL_WORKLOADS):
        outcomes = [poolbench.run(workload, device, n) for n in ((1, 2) if args.quick else (1, 2, 4))]
        for o in outcomes:
            pool.row(f"simulator, `{workload.name}` on {o.devices} device(s): background throughput; "
                     f"chat TTFT p99; swaps per device-hour",
                     f"{o.background_tok_h:,.0f} tok/h ({o.background_tok_h / outcomes[0].background_tok_h:.2f}×); "
                     f"{o.chat_ttft_p99:.2f} s; {o.swaps_per_device_h:.1f}")
        for goal in poolbench.goals(outcomes):
            pool.row(goal.name, goal.detail, goal="issue 16, against 1 device", met=goal.ok)
    pool.save()
    swaps()
    slots(args.quick)


def swaps() -> None:
    """Issue 37: models kept on the device (`cpu-warm`, the runtime's default) against every swap
    cold, on `mixed_day`; `pool_chats` (103 chats) on one device, with one slot and with the slots
    the runtime's "auto" gives each model, and what its p99 chat waited for."""
    record = Record("swaps", name="sim_bench-swaps", note=NOTE)
    warm = PROFILES["cpu-warm"]
    for goal in bench.swap_goals(generate("mixed_day", SEED), warm):
        record.row(goal.name, goal.detail, goal="issue 37", met=goal.ok)
    workload = generate("pool_chats", SEED)
    for profile in (PROFILES["cpu"], warm):
        for slots in (1, AUTO):
            o = poolbench.run(workload, profile, 1, slots)
            kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(o.metrics.swaps_by_kind.items()))
            record.row(f"simulator, `{workload.name}` on 1 device, slots {slots}, profile `{profile.name}`: chat "
                       f"TTFT p99 (of {o.metrics.chat_n} chats), what that chat waited for; chat delay p99; swaps "
                       f"by kind; swap s per device-hour",
                       f"{o.chat_ttft_p99:.2f} s ({p99_chat(o.trace).describe()}); {o.metrics.chat_delay_p99:.2f} s; "
                       f"{kinds}; {swap_s_per_device_h(o.metrics):.1f}",
                       goal="issue 37: chat TTFT p99 <= 1 s", met=o.chat_ttft_p99 <= 1.0)
    record.save()


def slots(quick: bool) -> None:
    """Each slot workload on one device with 1, 4, 8, 16 slots, per profile; issue 24's goals."""
    counts = QUICK_SLOTS if quick else SLOTS
    profiles = (PROFILES["cpu"], PROFILES["gpu"])
    record = Record("slots-sim", quick=quick, name="sim_bench-slots",
                    note="; ".join([NOTE, *(f"{p.name}: {p.batch_source}" for p in profiles)]))
    workloads = [generate(name, SEED) for name in (("issue118",) if quick else SLOT_WORKLOADS)]
    for profile in profiles:
        results = {w.name: slotbench.outcomes(w, profile, list(counts)) for w in workloads}
        for w in workloads:
            for figure, measured in slotbench.summary(w, results[w.name]):
                record.row(f"simulator, `{w.name}`, profile {profile.name}, {' / '.join(map(str, counts))} slots: "
                           f"{figure}", measured)
        for goal in slotbench.goals(workloads, results, profile):
            record.row(f"{goal.name} (profile {profile.name})", goal.detail, goal="issue 24, against 1 slot",
                       met=goal.ok)
    record.save()


if __name__ == "__main__":
    main()
