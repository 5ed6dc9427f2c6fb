"""The slots benchmark: each workload on one device with 1, 4, 8, 16 slots (SPEC §6),
under the real policy, scored from the event logs; its goals checked against the first
slot count given, not tuned for.

Figures per run: background throughput (`poolbench`: output tokens of the non-chat jobs done
before the producers stop, per hour), chat TTFT p99, the drain time of the backfill (the jobs
of ``extract:backfill``, first submit to last end), swaps per device-hour (over the producers'
span, the same for every slot count: the log of a faster run ends sooner), revokes (those of
R23, cause "step", in brackets), the mean batch a dispatch joined, idle time while work waited.

Goals, per profile: background throughput at the best slot count >= 1.8x one slot's
on ``cpu``, >= 10x on ``gpu``, on the saturating workload (elsewhere the producers' own depth
caps the batch); chat TTFT p99 no worse than one slot's plus one step (the chat model's step at
that slot count: a chat joins at the end of the step under way); the backfill drained in <= 1/2
(``cpu``) and <= 1/8 (``gpu``) of one slot's time at the best slot count; swaps per device-hour
no more than one slot's.
"""
from __future__ import annotations

from .device import DeviceProfile
from .metrics import Goal, drain_s, goals_table
from .poolbench import PoolOutcome, fmt, run
from .workload import Workload
from .workloads import CHAT_MODEL

BACKFILL = "extract:backfill"
SATURATING = "saturate"
#: Per profile name: the least background throughput at the best slot count, against the first.
THROUGHPUT_GOALS = {"cpu": 1.8, "gpu": 10.0}
#: Per profile name: the largest backfill drain time at the best slot count, against the first.
DRAIN_GOALS = {"cpu": 1 / 2, "gpu": 1 / 8}


def outcomes(workload: Workload, profile: DeviceProfile, counts: list[int]) -> list[PoolOutcome]:
    return [run(workload, profile, 1, slots) for slots in counts]


def swaps_per_hour(workload: Workload, o: PoolOutcome) -> float:
    """Swaps per device-hour over the producers' span (one device)."""
    return o.swaps / (max(f.stop for f in workload.flows if f.stop is not None) / 3600.0)


def figures(workload: Workload, o: PoolOutcome, base: PoolOutcome) -> list[tuple[str, str]]:
    """One run's figures, named, the ratios against `base` (the first slot count)."""
    drain = drain_s(o.trace, BACKFILL)
    return [
        ("background tok/h", f"{o.background_tok_h:,.0f}"),
        ("throughput vs first", f"{o.background_tok_h / base.background_tok_h:.2f}x"),
        ("chat TTFT p99 s", fmt(o.chat_ttft_p99)),
        ("backfill drain s", fmt(drain, 0)),
        ("drain vs first", _ratio(drain, drain_s(base.trace, BACKFILL))),
        ("swaps per device-hour", f"{swaps_per_hour(workload, o):.2f}"),
        ("revokes (R23's of them)", f"{o.revokes} ({sum(1 for r in o.trace.runs if r.revoke_cause == 'step')})"),
        ("mean batch", fmt(o.metrics.batch_mean, 2)),
        ("idle while waiting s", f"{o.idle_while_waiting_s:.3f}"),
    ]


def table(workload: Workload, profile: DeviceProfile, runs: list[PoolOutcome]) -> str:
    names = [name for name, _ in figures(workload, runs[0], runs[0])] + ["sim wall s"]
    lines = [f"### {workload.name} (profile `{profile.name}`, seed {workload.seed}): {workload.description}", "",
             "| slots | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for o in runs:
        values = [value for _, value in figures(workload, o, runs[0])] + [f"{o.wall_s:.1f}"]
        lines.append(f"| {o.slots} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def summary(workload: Workload, runs: list[PoolOutcome]) -> list[tuple[str, str]]:
    """The figures of every slot count side by side ("a / b / c"), those the workload has."""
    runs_figures = [dict(figures(workload, o, runs[0])) for o in runs]

    def side_by_side(*names: str) -> str:
        return " / ".join(f"{f[names[0]]} ({f[names[1]]})" if len(names) > 1 else f[names[0]] for f in runs_figures)
    rows = [("background throughput, tok/h (vs first)", side_by_side("background tok/h", "throughput vs first")),
            ("chat TTFT p99, s", side_by_side("chat TTFT p99 s")),
            ("backfill drain, s (vs first)", side_by_side("backfill drain s", "drain vs first")),
            ("revokes (R23's of them)", side_by_side("revokes (R23's of them)")),
            ("mean batch", side_by_side("mean batch"))]
    return [(name, value) for name, value in rows if not value.startswith("–")]


def goals(workloads: list[Workload], results: dict[str, list[PoolOutcome]], profile: DeviceProfile) -> list[Goal]:
    """The study's goals, the slot counts against the first."""
    checked: list[Goal] = []
    throughput, drain = THROUGHPUT_GOALS.get(profile.name), DRAIN_GOALS.get(profile.name)
    if SATURATING in results:
        runs = results[SATURATING]
        best = max(runs, key=lambda o: o.background_tok_h)
        ratio = best.background_tok_h / runs[0].background_tok_h
        checked.append(Goal(f"{SATURATING}: background throughput at the best slot count >= {fmt(throughput, 1)}x",
                            None if throughput is None else ratio >= throughput, f"{ratio:.2f}x at {best.slots} slots"))
    for name, runs in results.items():
        drains = [(drain_s(o.trace, BACKFILL), o.slots) for o in runs]
        if drains[0][0] is None:
            continue
        fastest, slots = min((d, s) for d, s in drains if d is not None)
        checked.append(Goal(f"{name}: backfill drains in <= {fmt(drain, 3)} of the first's time at the best slot count",
                            None if drain is None else fastest <= drain * drains[0][0],
                            f"{fastest:.0f} s at {slots} slots vs {drains[0][0]:.0f} s ({fastest / drains[0][0]:.3f})"))
    for workload in workloads:
        base, others = results[workload.name][0], results[workload.name][1:]
        counts = " / ".join(str(o.slots) for o in others)
        if base.chat_ttft_p99 is not None and others:
            steps = [profile.speed(CHAT_MODEL).step_s(o.slots) for o in others]
            checked.append(Goal(
                f"{workload.name}: chat TTFT p99 <= the first's + one step, at {counts} slots",
                all(o.chat_ttft_p99 <= base.chat_ttft_p99 + step for o, step in zip(others, steps)),
                f"{' / '.join(fmt(o.chat_ttft_p99) for o in others)} s vs {base.chat_ttft_p99:.3f} s + "
                f"{' / '.join(f'{step:.3f}' for step in steps)} s"))
        if others:
            checked.append(Goal(f"{workload.name}: swaps per device-hour no more, at {counts} slots",
                                all(o.swaps <= base.swaps for o in others),
                                f"{' / '.join(f'{swaps_per_hour(workload, o):.2f}' for o in others)} vs "
                                f"{swaps_per_hour(workload, base):.2f}"))
    return checked


def report(workloads: list[Workload], profile: DeviceProfile, counts: list[int]) -> str:
    results = {w.name: outcomes(w, profile, counts) for w in workloads}
    tables = [table(w, profile, results[w.name]) for w in workloads]
    return "\n\n".join([f"## Slots on one device (profile `{profile.name}`)", *tables,
                        f"### Goals (profile `{profile.name}`)\n\n"
                        + goals_table(goals(workloads, results, profile),
                                      "goal (against the first slot count)")])


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.3f}"
