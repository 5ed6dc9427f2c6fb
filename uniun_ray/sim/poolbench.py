"""The pool benchmark: one saturating workload on 1, 2, 4, ... devices of the
same profile, under the real policy, scored from the event logs.

Background throughput is the output tokens of the non-chat jobs that completed before the
producers stopped, per hour: with every producer backlogged it measures how much work the
pool does, not how much was asked. Its goals are checked against the first
device count given (1 by default), not tuned for.
"""
from __future__ import annotations

from dataclasses import dataclass

from uniun_ray.policy import SchedulerPolicy

from .device import DeviceProfile
from .metrics import Goal, Metrics, goals_table, measure
from .simulator import AUTO, Slots, simulate
from ..events.trace import Trace
from .workload import Workload

#: Goals, as (device count, minimum background throughput against the base).
SPEEDUP_GOALS = {2: 1.8, 4: 3.5}


@dataclass(frozen=True)
class PoolOutcome:
    devices: int
    background_tok_h: float
    chat_ttft_p99: float | None
    swaps: int
    swaps_per_device_h: float
    revokes: int
    idle_while_waiting_s: float
    wall_s: float
    slots: int | str = 1            # or "auto": each model's own (`ModelSpeed.auto_slots`)
    trace: Trace | None = None      # the run's log and its scores, for more figures (`slotbench`)
    metrics: Metrics | None = None


def run(workload: Workload, profile: DeviceProfile, n: int, slots: Slots = 1) -> PoolOutcome:
    """`workload` on `n` devices of `profile` with `slots` slots each (SPEC §5, §6)."""
    names = tuple(f"dev{i}" for i in range(n))
    policy = SchedulerPolicy(devices=names, slots=1 if slots == AUTO else slots)
    result = simulate(policy, workload, profile, names, slots)
    trace = Trace(result.events)
    m = measure(trace)
    horizon = max(f.stop for f in workload.flows if f.stop is not None)
    tokens = sum(ev["tokens"] for ev in result.events
                 if ev["ev"] == "finish" and ev["outcome"] == "done" and ev["kind"] != "chat" and ev["t"] <= horizon)
    device_h = n * (trace.end - trace.start) / 3600.0
    return PoolOutcome(n, tokens / (horizon / 3600.0), m.ttft_p99, m.swaps, m.swaps / device_h, m.revokes,
                       m.idle_while_waiting_s, result.wall_s, slots, trace, m)


def report(workload: Workload, profile: DeviceProfile, counts: list[int]) -> str:
    outcomes = [run(workload, profile, n) for n in counts]
    base = outcomes[0]
    lines = [f"## {workload.name} on a pool (profile `{profile.name}`, seed {workload.seed}): {workload.description}",
             "", "| devices | background tok/h | vs first | chat TTFT p99 s | swaps | swaps per device-hour | "
             "revokes | idle while waiting s | sim wall s |", "|---" * 9 + "|"]
    for o in outcomes:
        lines.append(f"| {o.devices} | {o.background_tok_h:.0f} | {o.background_tok_h / base.background_tok_h:.2f}x | "
                     f"{fmt(o.chat_ttft_p99)} | {o.swaps} | {o.swaps_per_device_h:.2f} | {o.revokes} | "
                     f"{o.idle_while_waiting_s:.3f} | {o.wall_s:.2f} |")
    return "\n".join(lines + ["", goals_table(goals(outcomes), "goal (against the first row)")])


def goals(outcomes: list[PoolOutcome]) -> list[Goal]:
    """The goals, each pool against the first."""
    base, checked = outcomes[0], []
    for o in outcomes[1:]:
        ratio = o.background_tok_h / base.background_tok_h
        goal = SPEEDUP_GOALS.get(o.devices)
        if goal is not None:
            checked.append(Goal(f"background throughput >= {goal}x at {o.devices} devices", ratio >= goal,
                                f"{ratio:.2f}x"))
        if o.chat_ttft_p99 is not None and base.chat_ttft_p99 is not None:
            checked.append(Goal(f"chat TTFT p99 at {o.devices} devices no worse", o.chat_ttft_p99 <= base.chat_ttft_p99,
                                f"{o.chat_ttft_p99:.3f} s vs {base.chat_ttft_p99:.3f} s"))
        checked.append(Goal(f"swaps per device-hour at {o.devices} devices no more",
                            o.swaps_per_device_h <= base.swaps_per_device_h,
                            f"{o.swaps_per_device_h:.2f} vs {base.swaps_per_device_h:.2f}"))
    return checked


def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"
