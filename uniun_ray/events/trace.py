"""An event log replayed into what the metrics and pictures need: jobs, device runs,
swaps, the foreground over time, and each job's tier over time.

Tiers are recomputed from the log with the policy's own R1 function (`tier_of`), from
the job's fields, the foreground then in force and the time, so any policy's log (a
baseline's, or a runtime's that does not record tiers) is classified the same way. A
``dispatch`` that carries ``tier`` is taken at its word.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from uniun_ray.policy import Foreground, Job, Kind, tier_of

from .schema import COLD, Event


@dataclass
class Run:
    """A slot of a device held by one job from dispatch to finish (R7's charge)."""

    job: str
    kind: str
    producer: str
    model: str
    start: float
    tier: int
    device: str = "dev0"
    slot: int = 0
    batch: int = 1        # jobs on the device at the dispatch, this one included (SPEC §6)
    prefill_tokens: int | None = None   # context it had to read (not in the prefix cache), where logged
    swap_s: float = 0.0
    end: float | None = None
    outcome: str | None = None
    revoked_at: float | None = None
    revoke_batch: int | None = None   # jobs on the device at the revoke, this one included
    revoke_cause: str | None = None   # the policy's RevokeCause, where the log names it

    @property
    def held(self) -> float:
        return self.end - self.start


@dataclass
class JobRecord:
    job: Job
    submit: float
    prompt_tokens: int | None = None
    first_token: float | None = None
    end: float | None = None      # when the job was over for good
    outcome: str | None = None    # its last outcome, once over
    runs: list[Run] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.job.kind.value

    @property
    def producer(self) -> str:
        return self.job.producer


@dataclass(frozen=True)
class Swap:
    start: float
    end: float
    model: str
    kind: str = COLD      # cold load, warm copy, switch (``schema.SWAP_KINDS``)


def _ends_the_job(finish: Event, job: Job) -> bool:
    """Whether a run's finish is its job's end: the runtime's ``requeued`` says so where it
    wrote one (a revoked job its caller withdrew is not re-queued; a job whose device was lost
    is); without it (a simulator's log), a revoked chat fails as preempted and any other kind
    is re-queued (R6)."""
    if "requeued" in finish:
        return not finish["requeued"]
    return finish["outcome"] != "revoked" or job.kind is Kind.CHAT


class Trace:
    def __init__(self, events: Iterable[Event]) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.runs: list[Run] = []
        self.swaps: list[Swap] = []
        self.revokes: list[tuple[float, str]] = []
        self.foreground: list[tuple[float, Foreground]] = []  # (time, what is in front from then on)
        self.devices: dict[str, None] = {}  # the devices runs went to, in order of first use
        self._fg_times: list[float] = []
        self.start = self.end = None
        swap_started: dict[str, float] = {}
        for ev in events:
            t = ev["t"]
            self.start = t if self.start is None else self.start
            self.end = t
            kind = ev["ev"]
            if kind == "foreground":
                self._fg_times.append(t)
                self.foreground.append((t, Foreground(None if ev["kind"] is None else Kind.parse(ev["kind"]), ev["subject"])))
            elif kind == "submit":
                job = Job(ev["job"], Kind.parse(ev["kind"]), ev["model"], ev["producer"], ev["deadline"],
                          ev["foreground_hint"], ev["subject"])
                self.jobs[job.id] = JobRecord(job, t, ev.get("prompt_tokens"))
            elif kind == "dispatch":
                rec = self.jobs[ev["job"]]
                tier = ev.get("tier")
                tier = int(tier_of(rec.job, self.foreground_at(t), t)) if tier is None else tier
                run = Run(rec.job.id, rec.kind, rec.producer, ev["model"], t, tier, ev.get("device", "dev0"),
                          ev.get("slot", 0), ev.get("batch", 1), ev.get("prefill_tokens"))
                self.devices.setdefault(run.device, None)
                rec.runs.append(run)
                self.runs.append(run)
            elif kind == "swap_start":
                swap_started[ev["job"]] = t
            elif kind == "swap_end":
                began = swap_started.pop(ev["job"])
                self.swaps.append(Swap(began, t, ev["model"], ev.get("swap_kind", COLD)))
                self.jobs[ev["job"]].runs[-1].swap_s = t - began
            elif kind == "first_token":
                self.jobs[ev["job"]].first_token = t
            elif kind == "revoke":
                self.revokes.append((t, ev["job"]))
                run = self.jobs[ev["job"]].runs[-1]
                run.revoked_at, run.revoke_batch, run.revoke_cause = t, ev.get("batch", 1), ev.get("cause")
            elif kind == "finish":
                rec = self.jobs[ev["job"]]
                run = rec.runs[-1]
                run.end, run.outcome = t, ev["outcome"]
                if _ends_the_job(ev, rec.job):
                    rec.end, rec.outcome = t, ev["outcome"]
        # A run still open when the log ends held the device until then.
        for run in self.runs:
            if run.end is None:
                run.end = self.end

    # -- foreground and tiers ------------------------------------------------------------
    def foreground_at(self, t: float) -> Foreground:
        i = bisect.bisect_right(self._fg_times, t)
        return self.foreground[i - 1][1] if i else Foreground()

    def tier_pieces(self, rec: JobRecord, a: float, b: float) -> Iterator[tuple[float, float, int]]:
        """[a, b) cut where the job's tier may change (a foreground change, its deadline),
        each piece with the tier it has throughout."""
        cuts = self._fg_times[bisect.bisect_right(self._fg_times, a):bisect.bisect_left(self._fg_times, b)]
        deadline = rec.job.deadline
        if deadline is not None and a < deadline < b:
            cuts = sorted(cuts + [deadline])
        for lo, hi in zip([a] + cuts, cuts + [b]):
            if hi > lo:
                yield lo, hi, int(tier_of(rec.job, self.foreground_at(lo), lo))

    # -- waiting and outstanding intervals -----------------------------------------------
    def waits(self, rec: JobRecord) -> Iterator[tuple[float, float]]:
        """When the job sat queued: from its submit, or a revoked run's end, to its next
        dispatch (or to its end / the log's end if it never ran again)."""
        ready = rec.submit
        for run in rec.runs:
            if run.start > ready:
                yield ready, run.start
            ready = run.end
        if rec.end is None and self.end > ready and (not rec.runs or rec.runs[-1].outcome == "revoked"):
            yield ready, self.end

    def outstanding(self, rec: JobRecord) -> tuple[float, float]:
        """From submit until the job is over (queued or running all along)."""
        return rec.submit, rec.end if rec.end is not None else self.end
