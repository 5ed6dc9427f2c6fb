"""The benchmark: every policy on every workload, scored from the event logs.

``main(argv)`` writes, under the output directory (default ``bench-out/``): the workloads
as JSON (``workloads/``), a markdown report (``bench.md``, also printed) with one table
per workload and the goals checked for the real policy, and PNGs: a device timeline and a
cumulative-service plot per workload and policy, and a chat TTFT CDF per workload.
With ``--logs`` it also keeps each run's event log as JSONL. With ``--real`` it plays the
short workloads on the real runtime instead, beside their simulation (`replay`). With
``--devices 1,2,4`` it runs the pool benchmark instead (`poolbench`, ``pool.md``); with
``--slots 1,4,8,16`` the slots benchmark (`slotbench`, ``slots.md``).
"""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from uniun_ray.policy import PolicyConfig, SchedulerPolicy

from . import plots, poolbench, slotbench
from .baselines import BASELINES
from .device import PROFILES, DeviceProfile
from ..events import log
from ..events.schema import COLD
from .metrics import Goal, Metrics, goals_table, jain_of, measure, swap_s_per_device_h, t2_windows
from .simulator import simulate
from ..events.trace import Trace
from .workload import Workload
from .workloads import CHAT_MODEL, POOL_WORKLOADS, SHORT_WORKLOADS, SLOT_WORKLOADS, WORKLOADS, generate

REAL = "uniun"
T2_SHARE = PolicyConfig().t2_share  # R11's limit, the goal's 60 %
POLICIES = {REAL: SchedulerPolicy, **BASELINES}
#: Timelines longer than this are drawn around the first chat turn too, to be readable.
ZOOM_AFTER_S, ZOOM_S = 2 * 3600.0, 1800.0


@dataclass
class Outcome:
    """One policy on one workload."""

    trace: Trace
    metrics: Metrics
    wall_s: float
    prefill_s: float = 0.0   # device seconds spent prefilling (what the prefix cache saves)


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


COLUMNS = (
    ("jobs", lambda o: o.metrics.jobs),
    ("TTFT p50 s", lambda o: o.metrics.ttft_p50),
    ("TTFT p99 s", lambda o: o.metrics.ttft_p99),
    ("TTFT max s", lambda o: o.metrics.ttft_max),
    ("chat delay p99 s", lambda o: o.metrics.chat_delay_p99),
    ("chats failed", lambda o: o.metrics.chat_failed),
    ("revokes", lambda o: o.metrics.revokes),
    ("swaps (forced)", lambda o: f"{o.metrics.swaps} ({o.metrics.forced_swaps})"),
    ("swap s", lambda o: o.metrics.swap_s),
    ("Jain T4", lambda o: o.metrics.jain_t4),
    ("T2 max", lambda o: o.metrics.t2_share_max),
    ("T2 max, T3/T4 backlogged", lambda o: o.metrics.t2_share_max_t34_backlogged),
    ("T3 late max s", lambda o: o.metrics.t3_late_max),
    ("idle while waiting s", lambda o: o.metrics.idle_while_waiting_s),
    ("prefill s", lambda o: o.prefill_s),
    ("longest wait s (flow)", lambda o: _longest(o.metrics)),
    ("sim wall s", lambda o: o.wall_s),
)


def _longest(m: Metrics) -> str:
    if not m.longest_wait:
        return "–"
    flow, wait = max(m.longest_wait.items(), key=lambda kv: kv[1])
    return f"{wait:.0f} ({flow})"


def table(results: dict[str, Outcome]) -> str:
    lines = ["| policy | " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    for policy, outcome in results.items():
        lines.append(f"| {policy} | " + " | ".join(_fmt(get(outcome)) for _, get in COLUMNS) + " |")
    return "\n".join(lines)


def run_one(policy_name: str, workload: Workload, device: DeviceProfile, out: Path, logs: bool) -> Outcome:
    result = simulate(POLICIES[policy_name](), workload, device)
    if logs:
        log.write(result.events, out / f"log-{workload.name}-{policy_name}.jsonl")
    trace = Trace(result.events)
    prefill = sum(e.get("prefill_s", 0.0) for e in result.events if e["ev"] == "dispatch")
    return Outcome(trace, measure(trace), result.wall_s, prefill)


def without_cache(workloads: dict[str, Workload], device: DeviceProfile, out: Path) -> dict[str, Outcome]:
    """The real policy on each workload with no prefix KV cache: what the cache buys it."""
    return {name: run_one(REAL, workload, replace(device, kv_cache_tokens=0), out, logs=False)
            for name, workload in workloads.items()}


def cache_table(results: dict[str, dict[str, Outcome]], uncached: dict[str, Outcome]) -> str:
    lines = ["| workload | chat TTFT p99 s, with / without | prefill s, with / without | saved |", "|---|---|---|---|"]
    for name, bare in uncached.items():
        cached = results[name][REAL]
        lines.append(f"| {name} | {_fmt(cached.metrics.ttft_p99)} / {_fmt(bare.metrics.ttft_p99)} | "
                     f"{cached.prefill_s:.0f} / {bare.prefill_s:.0f} | {saved(cached, bare):.0%} |")
    return "\n".join(lines)


def saved(cached: Outcome, bare: Outcome) -> float:
    """The share of the prefill time the cache saved."""
    return 1 - cached.prefill_s / bare.prefill_s if bare.prefill_s else 0.0


def draw(workload: Workload, results: dict[str, Outcome], out: Path) -> None:
    for policy, outcome in results.items():
        trace, stem = outcome.trace, f"{workload.name}-{policy}"
        plots.timeline(trace, out / f"timeline-{stem}.png", f"{workload.name}: {policy}")
        chats = [r.submit for r in trace.jobs.values() if r.kind == "chat"]
        if trace.end - trace.start > ZOOM_AFTER_S and chats:
            span = (min(chats) - ZOOM_S / 3, min(chats) + 2 * ZOOM_S / 3)
            plots.timeline(trace, out / f"timeline-{stem}-zoom.png", f"{workload.name}: {policy} (zoom)", span)
        plots.service(trace, out / f"service-{stem}.png", f"{workload.name}: {policy}")
    if any(o.metrics.chat_n for o in results.values()):
        plots.ttft_cdf({p: o.trace for p, o in results.items()}, out / f"ttft-{workload.name}.png", workload.name)


def goals(all_results: dict[str, dict[str, Outcome]], workloads: dict[str, Workload], device: DeviceProfile) -> list[Goal]:
    """The workloads' goals for the real policy, checked, not tuned for."""
    checked: list[Goal] = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        checked.append(Goal(name, ok, detail))

    if "issue118" in all_results:
        res = all_results["issue118"]
        real, old = res[REAL].metrics, res["two-lane"].metrics
        ratio = old.ttft_p99 / real.ttft_p99
        check("issue118: chat p99 TTFT >= 100x lower than two-lane", ratio >= 100,
              f"{old.ttft_p99:.2f} s / {real.ttft_p99:.2f} s = {ratio:.0f}x; the queueing part alone (chat delay "
              f"p99) {old.chat_delay_p99:.2f} s / {real.chat_delay_p99:.3f} s = "
              f"{old.chat_delay_p99 / real.chat_delay_p99:.0f}x, the rest is the chat's own prefill")
        bound = device.speed(CHAT_MODEL).decode_s + 0.05
        check("issue118: chat p99 TTFT within one decode step + 50 ms of idle TTFT",
              real.chat_delay_p99 <= bound,
              f"p99 TTFT - idle TTFT (= chat delay) {real.chat_delay_p99:.3f} s vs {bound:.3f} s")
    if "mixed_day" in all_results:   # a swap count against the forced minimum said nothing of what swaps cost: a figure
        m = all_results["mixed_day"][REAL].metrics
        by_tier = Counter(run.tier for run in all_results["mixed_day"][REAL].trace.runs if run.swap_s > 0)
        check("mixed_day: swaps against the T0/T1-forced minimum (a figure: `swap_goals` has the goals)", None,
              f"{m.swaps} swaps vs {m.forced_swaps} forced ({m.swaps / m.forced_swaps:.1f}x), {m.swap_s:.0f} s; by "
              f"the tier of the run that swapped: " + ", ".join(f"T{t} {n}" for t, n in sorted(by_tier.items())))
    for name, workload in workloads.items():
        for group in workload.equal_flows:
            j = jain_of(all_results[name][REAL].trace, group)
            check(f"{name}: Jain >= 0.99 over equal backlogged flows {', '.join(group)}",
                  None if j is None else j >= 0.99, _fmt(j, 4))
    for name, res in all_results.items():
        windows = [w for w in t2_windows(res[REAL].trace) if w.backlogged]
        if not windows:
            check(f"{name}: T2 <= 60 % of every window with T3/T4 backlogged", None, "no such window")
            continue
        worst = max(windows, key=lambda w: w.t2 - T2_SHARE * w.held)
        over_one_job = sum(w.t2 - T2_SHARE * w.held > w.longest_t2_run for w in windows)
        ok = worst.share <= T2_SHARE
        check(f"{name}: T2 <= 60 % of every window with T3/T4 backlogged", ok, f"max {worst.share:.3f}" + (
            "" if ok else f": {worst.t2 - T2_SHARE * worst.held:.1f} s over 60 % in the window at "
            f"{worst.start:.0f} s, whose longest T2 run is {worst.longest_t2_run:.1f} s; windows over by more "
            f"than one T2 run: {over_one_job} of {len(windows)}"))
    for name, res in all_results.items():
        idle = res[REAL].metrics.idle_while_waiting_s
        check(f"{name}: no device idle while work waited", idle == 0.0, f"{idle:.3f} s")
    return checked


def swap_goals(workload: Workload, device: DeviceProfile) -> list[Goal]:
    """The swap goals, which replace a swap count (a count said what swaps cost while
    every swap was a cold load; a switch costs milliseconds): the real policy on `workload`
    with `device` (whose models come back as it `keeps` them) against the same device where
    every swap is a cold load: swap seconds per device-hour >= 10x lower, with background
    (T2-T4) tokens and chat TTFT p99 no worse."""
    runs = {keeps: simulate(SchedulerPolicy(), workload, replace(device, keeps=keeps)).events
            for keeps in (device.keeps, COLD)}
    warm, cold = (measure(runs[keeps]) for keeps in (device.keeps, COLD))
    tokens = {keeps: sum(e["tokens"] for e in events if e["ev"] == "finish" and e["outcome"] == "done"
                         and e["kind"] != "chat") for keeps, events in runs.items()}
    per_h = swap_s_per_device_h(warm), swap_s_per_device_h(cold)
    kinds = ", ".join(f"{kind} {n} ({warm.swap_s_by_kind[kind]:.1f} s)" for kind, n in sorted(warm.swaps_by_kind.items()))
    name = f"{workload.name} on `{device.name}` (models kept: {device.keeps}) vs every swap cold"
    return [Goal(f"{name}: swap seconds per device-hour >= 10x lower", per_h[0] * 10 <= per_h[1],
                 f"{per_h[0]:.2f} vs {per_h[1]:.2f} s/h ({per_h[1] / per_h[0]:.0f}x); swaps {kinds}"
                 if per_h[0] else f"0 vs {per_h[1]:.2f} s/h"),
            Goal(f"{name}: background tokens no fewer", tokens[device.keeps] >= tokens[COLD],
                 f"{tokens[device.keeps]:,} vs {tokens[COLD]:,}"),
            Goal(f"{name}: chat TTFT p99 no worse", warm.ttft_p99 <= cold.ttft_p99,
                 f"{warm.ttft_p99:.2f} s vs {cold.ttft_p99:.2f} s")]


def main(argv: list[str] | None = None, real=None) -> int:
    """`real(out, seed, device, names)` plays `--real` on the runtime; the simulator does not
    import the runtime, so the caller above it (the CLI: `uniun_ray.replay.main`) passes it."""
    parser = argparse.ArgumentParser(prog="uniun-ray bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default: 1)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu", help="device speeds (default: cpu)")
    parser.add_argument("--workloads", nargs="+", choices=list({**WORKLOADS, **SHORT_WORKLOADS, **SLOT_WORKLOADS}),
                        help=f"default: {' '.join(WORKLOADS)}; with --real: {' '.join(SHORT_WORKLOADS)}; "
                             f"with --slots: {' '.join(SLOT_WORKLOADS)}")
    parser.add_argument("--logs", action="store_true", help="also write each run's event log as JSONL")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--real", action="store_true",
                        help="instead, play the workloads on the real runtime (a private local Ray, minutes "
                             "each) beside their simulation: real-vs-sim.md, event logs, timelines")
    parser.add_argument("--devices", type=_counts, metavar="N,N,...",
                        help="instead, the pool benchmark: the saturating `pool` workload on each number of "
                             "devices, the goals checked against the first (e.g. 1,2,4): pool.md")
    parser.add_argument("--slots", type=_counts, metavar="N,N,...",
                        help="instead, the slots benchmark: each workload on one device with each number of "
                             "slots, the goals checked against the first (e.g. 1,4,8,16): slots.md")
    args = parser.parse_args(argv)

    out = Path(args.out)
    device = PROFILES[args.profile]
    if args.devices:
        out.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(poolbench.report(generate(name, args.seed), device, args.devices)
                            for name in POOL_WORKLOADS)
        (out / "pool.md").write_text(text + "\n")
        print(text)
        return 0
    if args.slots:
        out.mkdir(parents=True, exist_ok=True)
        names = args.workloads or list(SLOT_WORKLOADS)
        text = slotbench.report([generate(name, args.seed) for name in names], device, args.slots)
        (out / "slots.md").write_text(text + "\n")
        print(text)
        return 0
    if args.real:
        if real is None:
            parser.error("--real plays on the real runtime: run it as `uniun-ray bench --real`")
        return real(out, args.seed, device, args.workloads or list(SHORT_WORKLOADS))
    (out / "workloads").mkdir(parents=True, exist_ok=True)
    report = [f"# uniun-ray bench (profile `{device.name}`, seed {args.seed})", ""]
    workloads: dict[str, Workload] = {}
    all_results: dict[str, dict[str, Outcome]] = {}
    for name in args.workloads or list(WORKLOADS):
        workload = workloads[name] = generate(name, args.seed)
        workload.save(out / "workloads" / f"{name}.json")
        results = all_results[name] = {p: run_one(p, workload, device, out, args.logs) for p in POLICIES}
        if not args.no_plots:
            draw(workload, results, out)
        report += [f"## {name}: {workload.description}", "", table(results), ""]
    report += ["## Goals", "", goals_table(goals(all_results, workloads, device), "goal (policy `uniun`)"), ""]
    report += [f"## The prefix KV cache ({device.kv_cache_tokens} tokens per device)", "",
               cache_table(all_results, without_cache(workloads, device, out)), ""]
    text = "\n".join(report)
    (out / "bench.md").write_text(text)
    print(text)
    return 0


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2,4, got {text!r}")
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
