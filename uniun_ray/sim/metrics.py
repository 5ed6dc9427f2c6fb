"""Scores computed from an event log alone, so a simulation and a real run's JSONL log
are judged by the same code. ``measure(events_or_trace) -> Metrics``.

Definitions (times in seconds; tiers are R1's, at dispatch for a run, see `trace`):

* Chat TTFT: first token minus submit, per chat job that produced one. *Chat delay*:
  the part of it that is not the chat's own prefill, i.e. from submit to the moment the
  chat's compute starts (queueing, the revoked job's stop, a swap). A chat on an idle
  device with its model loaded has delay 0, so delay = TTFT minus the idle TTFT.
  Percentiles are nearest-rank (p99 of 10 values is the largest).
* Swaps: the number of model loads and the time they took. *Forced swaps*: the loads
  that serving the T0/T1 runs alone needs, in dispatch order, from an empty device: the
  number of model changes in that sequence (the first load counts; at least 1 if
  anything ran). A policy cannot do with fewer without delaying chat or the foreground.
  By kind (cold load, warm copy, switch: the log's ``swap_kind``), their count and seconds;
  swap seconds per device-hour: the time swapping over the run's device-hours.
* Service of a flow (a producer): the device time its runs held, dispatch to finish,
  swaps included (what R7 charges).
* Backlogged: a T4 flow (nataraj or gana producer) is backlogged while it has at least
  one job submitted and not over (queued, running, or revoked and queued again) whose
  tier at that moment is T4. Jain's index J = (sum x)^2 / (n sum x^2) is taken per set B
  of two or more flows backlogged together: x is each flow's service from its T4 runs
  during the time in which exactly B is backlogged. ``jain_t4`` averages J over the sets,
  weighted by the T4 service they saw; ``jain_of(flows)`` is J over the time in which all
  of `flows` (and maybe others) are backlogged.
* T2 share: over consecutive windows of `window_s` from the log's start, T2 runs' held
  time over all held time in the window (windows where nothing held the device are left
  out). ``t2_share_max_t34_backlogged`` only looks at windows throughout which some job
  at T3 or T4 was outstanding (queued or running): there R11 must hold T2 to its share,
  give or take the job that was running when the budget ran out.
* T3 lateness: for each job with a deadline, its first dispatch minus its deadline
  (negative: started early; never dispatched: the log's end counts as its start).
* Idle while waiting: time with a device holding no job while some job was queued (the
  devices are those the log's runs went to). A device with slots (SPEC §6) is idle only
  when all of its slots are.
* Batch: the jobs on a device when one is dispatched there, this one included (the
  ``batch`` of the log's dispatches, SPEC §6): the mean over the dispatches and the largest.
* Drain time of a producer (e.g. a backfill): from its first job's submit to its last job's
  end; None while one of its jobs is not over.
* Longest wait of a flow: the longest stretch one of its jobs stayed queued, from submit
  or from a revoked run's end to its next dispatch.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..events.schema import Event
from ..events.trace import JobRecord, Run, Trace

POOL_KINDS = ("nataraj", "gana")


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100.0 * len(ordered)) - 1)]


def jain(values: Iterable[float]) -> float | None:
    xs = list(values)
    total, squares = sum(xs), sum(x * x for x in xs)
    return total * total / (len(xs) * squares) if squares > 0 else None


@dataclass
class Metrics:
    jobs: int
    unfinished: int
    makespan_s: float
    chat_n: int
    chat_failed: int
    ttft_p50: float | None
    ttft_p99: float | None
    ttft_max: float | None
    chat_delay_p99: float | None
    chat_delay_max: float | None
    revokes: int
    swaps: int
    swap_s: float
    forced_swaps: int
    jain_t4: float | None
    t2_share_max: float | None
    t2_share_max_t34_backlogged: float | None
    t3_jobs: int
    t3_late_p50: float | None
    t3_late_max: float | None
    idle_while_waiting_s: float
    swaps_by_kind: dict[str, int] = field(default_factory=dict)     # cold load, warm copy, switch
    swap_s_by_kind: dict[str, float] = field(default_factory=dict)
    batch_mean: float | None = None
    batch_max: int | None = None
    service: dict[str, float] = field(default_factory=dict)
    longest_wait: dict[str, float] = field(default_factory=dict)


def measure(log: Iterable[Event] | Trace, window_s: float = 300.0) -> Metrics:
    trace = log if isinstance(log, Trace) else Trace(log)
    recs = list(trace.jobs.values())
    chats = [r for r in recs if r.kind == "chat"]
    ttft = [r.first_token - r.submit for r in chats if r.first_token is not None]
    delays = [_chat_delay(r) for r in chats if r.first_token is not None]
    late = [(r.runs[0].start if r.runs else trace.end) - r.job.deadline for r in recs if r.job.deadline is not None]
    t2_all, t2_backlogged = _t2_shares(trace, window_s)
    service: Counter = Counter()
    for run in trace.runs:
        service[run.producer] += run.held
    longest: dict[str, float] = defaultdict(float)
    for rec in recs:
        for a, b in trace.waits(rec):
            longest[rec.producer] = max(longest[rec.producer], b - a)
    return Metrics(
        jobs=len(recs),
        unfinished=sum(1 for r in recs if r.end is None),
        makespan_s=(trace.end - trace.start) if recs else 0.0,
        chat_n=len(chats),
        chat_failed=sum(1 for r in chats if r.outcome != "done"),
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99), ttft_max=max(ttft, default=None),
        chat_delay_p99=percentile(delays, 99), chat_delay_max=max(delays, default=None),
        revokes=len(trace.revokes),
        swaps=len(trace.swaps),
        swap_s=sum(s.end - s.start for s in trace.swaps),
        forced_swaps=forced_swaps(trace),
        swaps_by_kind=dict(Counter(s.kind for s in trace.swaps)),
        swap_s_by_kind=_seconds_by_kind(trace),
        jain_t4=_jain_t4(trace),
        t2_share_max=max(t2_all, default=None),
        t2_share_max_t34_backlogged=max(t2_backlogged, default=None),
        t3_jobs=len(late), t3_late_p50=percentile(late, 50), t3_late_max=max(late, default=None),
        idle_while_waiting_s=idle_while_waiting(trace),
        batch_mean=sum(run.batch for run in trace.runs) / len(trace.runs) if trace.runs else None,
        batch_max=max((run.batch for run in trace.runs), default=None),
        service=dict(service),
        longest_wait=dict(longest),
    )


def _seconds_by_kind(trace: Trace) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for swap in trace.swaps:
        seconds[swap.kind] += swap.end - swap.start
    return dict(seconds)


def swap_s_per_device_h(m: Metrics, devices: int = 1) -> float:
    """Device seconds spent swapping per device-hour of the run."""
    return m.swap_s / (devices * m.makespan_s / 3600.0) if m.makespan_s else 0.0


def drain_s(log: Iterable[Event] | Trace, producer: str) -> float | None:
    trace = log if isinstance(log, Trace) else Trace(log)
    recs = [rec for rec in trace.jobs.values() if rec.producer == producer]
    if not recs or any(rec.end is None for rec in recs):
        return None
    return max(rec.end for rec in recs) - min(rec.submit for rec in recs)


def _first_token_run(rec: JobRecord) -> Run:
    return next(r for r in rec.runs if r.start <= rec.first_token <= r.end)


def _chat_delay(rec: JobRecord) -> float:
    run = _first_token_run(rec)
    return run.start + run.swap_s - rec.submit


@dataclass(frozen=True)
class ChatWait:
    """What one chat's time to first token was made of: queued from its submit to its dispatch
    (behind the jobs that held its device's slots meanwhile, by kind), its swap, then its own
    compute to the first token (the prefill of `prefill_tokens`, beside `batch` - 1 others)."""

    job: str
    ttft: float
    queued: float
    behind: tuple[str, ...]
    swap: float
    compute: float
    prefill_tokens: int | None
    batch: int

    def describe(self) -> str:
        behind = f" behind {', '.join(self.behind)}" if self.behind else ""
        tokens = "" if self.prefill_tokens is None else f" of {self.prefill_tokens} uncached tokens"
        return (f"{self.job} {self.ttft:.2f} s: queued {self.queued:.2f} s{behind}, swap {self.swap:.3f} s, "
                f"own prefill {self.compute:.2f} s{tokens} (batch {self.batch})")


def chat_waits(log: Iterable[Event] | Trace) -> list[ChatWait]:
    """Every chat that got a first token, slowest first: what it waited for."""
    trace = log if isinstance(log, Trace) else Trace(log)
    waits = []
    for rec in trace.jobs.values():
        if rec.kind != "chat" or rec.first_token is None:
            continue
        run = _first_token_run(rec)
        behind = Counter(other.kind for other in trace.runs if other.device == run.device and other is not run
                         and other.start < run.start and other.end > rec.submit)
        waits.append(ChatWait(rec.job.id, rec.first_token - rec.submit, run.start - rec.submit,
                              tuple(f"{n} {kind}" for kind, n in sorted(behind.items())), run.swap_s,
                              rec.first_token - run.start - run.swap_s, run.prefill_tokens, run.batch))
    return sorted(waits, key=lambda w: -w.ttft)


def p99_chat(log: Iterable[Event] | Trace) -> ChatWait | None:
    """The chat at the p99 of TTFT (nearest rank, as `percentile`)."""
    waits = chat_waits(log)
    return waits[len(waits) - max(1, math.ceil(0.99 * len(waits)))] if waits else None


def forced_swaps(trace: Trace) -> int:
    models = [run.model for run in trace.runs if run.tier <= 1]
    changes = sum(1 for prev, cur in zip([None] + models, models) if cur != prev)
    return max(changes, 1 if trace.runs else 0)


def _sweep(points: list[tuple[float, object]]):
    """Group change points by time: yield (t, the next change's time, the payloads at t).
    The state a caller builds from the payloads at t holds on [t, next)."""
    points.sort(key=lambda p: p[0])
    i = 0
    while i < len(points):
        t = points[i][0]
        batch = []
        while i < len(points) and points[i][0] == t:
            batch.append(points[i][1])
            i += 1
        yield t, points[i][0] if i < len(points) else t, batch


def idle_while_waiting(trace: Trace) -> float:
    points = []
    for rec in trace.jobs.values():
        for a, b in trace.waits(rec):
            points += [(a, (None, 1)), (b, (None, -1))]
    for run in trace.runs:
        points += [(run.start, (run.device, 1)), (run.end, (run.device, -1))]
    waiting, jobs = 0, Counter()   # queued jobs; jobs on each device
    idle = 0.0
    for a, b, batch in _sweep(points):
        for device, delta in batch:
            if device is None:
                waiting += delta
            else:
                jobs[device] += delta
        busy = sum(1 for n in jobs.values() if n > 0)
        if waiting > 0 and busy < max(len(trace.devices), 1):
            idle += b - a
    return idle


def _t4_segments(trace: Trace):
    """(backlogged set, T4 service per flow) for each stretch of constant state."""
    points = []
    for rec in trace.jobs.values():
        if rec.kind in POOL_KINDS:
            for a, b, tier in trace.tier_pieces(rec, *trace.outstanding(rec)):
                if tier == 4:
                    points += [(a, ("backlog", rec.producer, 1)), (b, ("backlog", rec.producer, -1))]
    for run in trace.runs:
        if run.tier == 4:
            points += [(run.start, ("run", run.producer, 1)), (run.end, ("run", run.producer, -1))]
    backlog: Counter = Counter()
    running: Counter = Counter()
    for a, b, batch in _sweep(points):
        for what, flow, delta in batch:
            (backlog if what == "backlog" else running)[flow] += delta
        if b > a:
            members = frozenset(f for f, n in backlog.items() if n > 0)
            served = {f: b - a for f, n in running.items() if n > 0 and f in members}
            yield members, served


def _jain_t4(trace: Trace) -> float | None:
    per_set: dict[frozenset, Counter] = defaultdict(Counter)
    for members, served in _t4_segments(trace):
        if len(members) >= 2:
            per_set[members].update(dict.fromkeys(members, 0.0))
            per_set[members].update(served)
    weighted = [(sum(s.values()), jain(s.values())) for s in per_set.values()]
    weighted = [(w, j) for w, j in weighted if j is not None]
    total = sum(w for w, _ in weighted)
    return sum(w * j for w, j in weighted) / total if total > 0 else None


def jain_of(log: Iterable[Event] | Trace, flows: Iterable[str]) -> float | None:
    """J over `flows`' T4 service during the time in which all of them are backlogged."""
    trace = log if isinstance(log, Trace) else Trace(log)
    flows = frozenset(flows)
    service = Counter(dict.fromkeys(flows, 0.0))
    for members, served in _t4_segments(trace):
        if flows <= members:
            service.update({f: s for f, s in served.items() if f in flows})
    return jain(service.values())


def _window_parts(trace: Trace, window_s: float, a: float, b: float) -> Iterator[tuple[int, float]]:
    """(window index, overlap) for each window that [a, b) overlaps by a positive time."""
    k = int((a - trace.start) // window_s)
    while trace.start + k * window_s < b:
        lo = trace.start + k * window_s
        part = min(b, lo + window_s) - max(a, lo)
        if part > 0:
            yield k, part
        k += 1


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


@dataclass(frozen=True)
class T2Window:
    """One window of the T2 share: its start, the held and T2-held seconds in it, the
    longest part of one T2 run inside it, and whether T3/T4 work was outstanding (queued
    or running) throughout. R11 is checked when a job is picked, so a T2 job picked just
    under the budget runs to its end: a window can exceed the share by up to one T2 run."""

    start: float
    held: float
    t2: float
    longest_t2_run: float
    backlogged: bool

    @property
    def share(self) -> float:
        return self.t2 / self.held


def t2_windows(log: Iterable[Event] | Trace, window_s: float = 300.0) -> list[T2Window]:
    """The windows that saw held time, in order."""
    trace = log if isinstance(log, Trace) else Trace(log)
    held: Counter = Counter()
    t2: Counter = Counter()
    longest: Counter = Counter()
    for run in trace.runs:
        for k, part in _window_parts(trace, window_s, run.start, run.end):
            held[k] += part
            if run.tier == 2:
                t2[k] += part
                longest[k] = max(longest[k], part)
    lower = [(lo, hi) for rec in trace.jobs.values()
             for lo, hi, tier in trace.tier_pieces(rec, *trace.outstanding(rec)) if tier >= 3]
    covered: Counter = Counter()
    for a, b in _union(lower):
        for k, part in _window_parts(trace, window_s, a, b):
            covered[k] += part

    def length(k: int) -> float:
        lo = trace.start + k * window_s
        return min(trace.end, lo + window_s) - lo
    return [T2Window(trace.start + k * window_s, held[k], t2[k], longest[k], covered[k] >= length(k) - 1e-9)
            for k in sorted(held) if held[k] > 0]


def _t2_shares(trace: Trace, window_s: float) -> tuple[list[float], list[float]]:
    """T2 share of every window that saw held time, and of the backlogged ones."""
    windows = t2_windows(trace, window_s)
    return [w.share for w in windows], [w.share for w in windows if w.backlogged]


@dataclass(frozen=True)
class Goal:
    """A goal of an issue checked against the metrics: met (True), missed (False) or not
    applicable (None: nothing in the run to judge it by), and what was measured."""

    name: str
    ok: bool | None
    detail: str


def goals_table(goals: Iterable[Goal], heading: str = "goal") -> str:
    rows = [f"| {g.name} | {'n/a' if g.ok is None else 'PASS' if g.ok else 'FAIL'} | {g.detail} |" for g in goals]
    return "\n".join([f"| {heading} | result | measured |", "|---|---|---|", *rows])
