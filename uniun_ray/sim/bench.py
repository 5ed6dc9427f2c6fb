"""The benchmark: every policy on every workload, scored from the event logs.

``main(argv)`` writes, under the output directory (default ``bench-out/``): the workloads
as JSON (``workloads/``), a markdown report (``bench.md``, also printed) with one table
per workload and the goals checked for the real policy, and PNGs: a device timeline and a
cumulative-service plot per workload and policy, and a chat TTFT CDF per workload.
With ``--logs`` it also keeps each run's event log as JSONL.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from uniun_ray.policy import SchedulerPolicy

from . import plots
from .baselines import BASELINES
from .device import PROFILES, DeviceProfile
from .events import write_jsonl
from .metrics import Metrics, jain_of, measure
from .simulator import simulate
from .trace import Trace
from .workload import Workload
from .workloads import CHAT_MODEL, WORKLOADS, generate

REAL = "uniun"
POLICIES = {REAL: SchedulerPolicy, **BASELINES}
#: Timelines longer than this are drawn around the first chat turn too, to be readable.
ZOOM_AFTER_S, ZOOM_S = 2 * 3600.0, 1800.0


@dataclass
class Outcome:
    """One policy on one workload."""

    trace: Trace
    metrics: Metrics
    wall_s: float


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
        write_jsonl(result.events, out / f"log-{workload.name}-{policy_name}.jsonl")
    trace = Trace(result.events)
    return Outcome(trace, measure(trace), result.wall_s)


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


def goals(all_results: dict[str, dict[str, Outcome]], workloads: dict[str, Workload], device: DeviceProfile) -> str:
    """The goals of issue 4 for the real policy, checked, not tuned for."""
    rows = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        rows.append(f"| {name} | {'n/a' if ok is None else 'PASS' if ok else 'FAIL'} | {detail} |")

    if "issue118" in all_results:
        res = all_results["issue118"]
        real, old = res[REAL].metrics, res["two-lane"].metrics
        ratio = old.ttft_p99 / real.ttft_p99
        check("issue118: chat p99 TTFT >= 100x lower than two-lane", ratio >= 100,
              f"{old.ttft_p99:.2f} s / {real.ttft_p99:.2f} s = {ratio:.0f}x")
        bound = device.speed(CHAT_MODEL).decode_s + 0.05
        check("issue118: chat p99 TTFT within one decode step + 50 ms of idle TTFT",
              real.chat_delay_p99 <= bound,
              f"p99 TTFT - idle TTFT (= chat delay) {real.chat_delay_p99:.3f} s vs {bound:.3f} s")
    if "mixed_day" in all_results:
        m = all_results["mixed_day"][REAL].metrics
        check("mixed_day: swaps <= 1.2x the T0/T1-forced minimum", m.swaps <= 1.2 * m.forced_swaps,
              f"{m.swaps} swaps vs {m.forced_swaps} forced ({m.swaps / m.forced_swaps:.1f}x)")
    for name, workload in workloads.items():
        for group in workload.equal_flows:
            j = jain_of(all_results[name][REAL].trace, group)
            check(f"{name}: Jain >= 0.99 over equal backlogged flows {', '.join(group)}",
                  None if j is None else j >= 0.99, _fmt(j, 4))
    for name, res in all_results.items():
        share = res[REAL].metrics.t2_share_max_t34_backlogged
        check(f"{name}: T2 <= 60 % of every window with T3/T4 backlogged",
              None if share is None else share <= 0.60, _fmt(share, 3))
    for name, res in all_results.items():
        idle = res[REAL].metrics.idle_while_waiting_s
        check(f"{name}: no device idle while work waited", idle == 0.0, f"{idle:.3f} s")
    return "\n".join(["| goal (policy `uniun`) | result | measured |", "|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="uniun-ray bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default: 1)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu", help="device speeds (default: cpu)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--logs", action="store_true", help="also write each run's event log as JSONL")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)

    out = Path(args.out)
    (out / "workloads").mkdir(parents=True, exist_ok=True)
    device = PROFILES[args.profile]
    report = [f"# uniun-ray bench (profile `{device.name}`, seed {args.seed})", ""]
    workloads: dict[str, Workload] = {}
    all_results: dict[str, dict[str, Outcome]] = {}
    for name in args.workloads:
        workload = workloads[name] = generate(name, args.seed)
        workload.save(out / "workloads" / f"{name}.json")
        results = all_results[name] = {p: run_one(p, workload, device, out, args.logs) for p in POLICIES}
        if not args.no_plots:
            draw(workload, results, out)
        report += [f"## {name}: {workload.description}", "", table(results), ""]
    report += ["## Goals", "", goals(all_results, workloads, device), ""]
    text = "\n".join(report)
    (out / "bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
