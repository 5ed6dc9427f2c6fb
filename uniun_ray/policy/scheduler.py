"""`SchedulerPolicy`: the state machine of SPEC §1, with explicit time.

It holds the queues, the running job, the foreground, the loaded model, the vruntime
ledger and the T2 window, and turns each event into actions (Dispatch, Revoke, Requeued).
It never sleeps or reads a clock: the SchedulerActor feeds it real time, the simulator
virtual time.

Every public method validates all of its input before it changes anything, so a
ValueError leaves the state exactly as it was.
"""
from __future__ import annotations

from collections import OrderedDict

from .budget import Run, T2Window
from .fairness import VruntimeLedger
from .picker import PickContext, pick, preemptor
from .queues import Entry, Queues
from .tiers import Foreground, Tier, tier_of
from .types import (WITHDRAWALS, Action, Dispatch, Job, Kind, Outcome, PolicyConfig, Requeued, Revoke,
                    RevokeCause, check_time)

#: How many ended job ids are remembered, only to tell "finished twice" from "unknown".
_ENDED_MEMORY = 10_000


class SchedulerPolicy:
    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._ledger = VruntimeLedger(self.config)
        self._queues = Queues(self._ledger)
        self._window = T2Window(self.config.window_s, self.config.t2_share)
        self._foreground = Foreground()
        self._loaded: str | None = None
        self._running: Entry | None = None
        self._now: float | None = None
        self._seq = 0
        self._ended: OrderedDict[str, Outcome] = OrderedDict()

    # -- public API ----------------------------------------------------------------------
    def submit(self, job: Job, now: float) -> list[Action]:
        now = self._check_now(now)
        if not isinstance(job, Job):
            raise ValueError(f"submit takes a Job, got {type(job).__name__}")
        if self._queues.get(job.id) is not None or self._is_running(job.id):
            raise ValueError(f"duplicate job id {job.id!r}: a job with this id is already queued or running")
        passed = self._advance(now)
        entry = Entry(job, self._seq, now)
        self._seq += 1
        self._ledger.arrive(entry.flow, now)
        self._queues.add(entry)
        # only the new job became eligible, so only a job outranking the runner can preempt
        outranks = self._running is not None and self.tier(job) < self.tier(self._running.job)
        return self._react(now, RevokeCause.ARRIVAL if outranks else passed)

    def finish(self, job_id: str, now: float, outcome: Outcome | str) -> list[Action]:
        now = self._check_now(now)
        outcome = Outcome.parse(outcome)
        entry = self._require_running(job_id, "finish")
        if outcome is Outcome.REVOKED and not entry.revoke_sent:
            raise ValueError(f"finish({job_id!r}, 'revoked'): the policy never revoked this job")
        self._advance(now)
        self._running = None
        held = now - entry.dispatched_at
        self._window.record(Run(entry.dispatched_at, now, entry.dispatch_tier is Tier.EXTRACT))
        self._ledger.charge(entry.flow, held)
        self._queues.pool.reprice(entry.flow)
        requeue = outcome is Outcome.REVOKED and not entry.cancelled and entry.job.kind is not Kind.CHAT
        if requeue:
            entry.dispatched_at = entry.dispatch_tier = None
            entry.revoke_sent = False
            self._queues.add(entry)  # same seq: its original place (R6)
            return [Requeued(job_id), *self._react(now, None)]
        self._end(entry, outcome, now)
        return self._react(now, None)

    def cancel(self, job_id: str, now: float, cause: RevokeCause | str = RevokeCause.CANCEL) -> list[Action]:
        """The caller withdrew the job: CANCEL, or RECLAIM when the runtime took back the
        lease of a holder that died. A running job gets its Revoke with that cause."""
        now = self._check_now(now)
        if cause not in WITHDRAWALS:  # a str Enum: "cancel" matches RevokeCause.CANCEL too
            raise ValueError(f"cancel({job_id!r}): cause must be one of "
                             f"{', '.join(c.value for c in WITHDRAWALS)}, got {cause!r}")
        cause = RevokeCause(cause)
        queued = self._queues.get(job_id)
        running = self._running if self._is_running(job_id) else None
        if queued is None and running is None:
            raise ValueError(self._unknown(job_id, "cancel"))
        passed = self._advance(now)
        if running is not None:
            running.cancelled = True
            return self._revoke(running, cause)
        self._queues.remove(queued)
        self._end(queued, Outcome.REVOKED, now)
        return self._react(now, passed)

    def set_foreground(self, kind: Kind | str | None, now: float, subject: str | None = None) -> list[Action]:
        now = self._check_now(now)
        if kind is not None:
            kind = Kind.parse(kind)
        if subject is not None and (not isinstance(subject, str) or not subject):
            raise ValueError(f"foreground subject must be a non-empty string or None, got {subject!r}")
        if kind is None and subject is not None:
            raise ValueError("a foreground subject needs a foreground kind (kind None means nothing is in front)")
        self._advance(now)
        self._foreground = Foreground(kind, subject)
        return self._react(now, RevokeCause.FOREGROUND)

    def tick(self, now: float) -> list[Action]:
        """R5: the runtime calls this at `next_wakeup()`; a deadline that passed since the
        last call may promote a queued job to T3 and preempt."""
        now = self._check_now(now)
        return self._react(now, self._advance(now))

    def set_loaded_model(self, model_id: str | None, now: float) -> list[Action]:
        """The runtime tells what the device really holds (after a failed load or a restart
        of the model actor), so the next Dispatch asks for a swap when needed."""
        now = self._check_now(now)
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"model_id must be a non-empty string or None, got {model_id!r}")
        passed = self._advance(now)
        self._loaded = model_id
        return self._react(now, passed)

    def next_wakeup(self) -> float | None:
        if self._now is None:
            return None
        return self._queues.next_deadline_after(self._now)

    def snapshot(self) -> dict:
        now = self._now if self._now is not None else 0.0
        tiers: dict[str, list[dict]] = {t.label: [] for t in Tier}
        for entry in sorted(self._queues, key=lambda e: e.seq):
            tiers[self.tier(entry.job).label].append(self._describe(entry, now))
        used, held = self._window.usage(now, self._running_run(now))
        running = None
        if self._running is not None:
            running = self._describe(self._running, now) | {
                "tier": self.tier(self._running.job).label,
                "held_s": now - self._running.dispatched_at,
                "revoked": self._running.revoke_sent,
            }
        return {
            "now": self._now,
            "loaded_model": self._loaded,
            "foreground": {
                "kind": self._foreground.kind.value if self._foreground.kind else None,
                "subject": self._foreground.subject,
            },
            "running": running,
            "tiers": tiers,
            "queued": len(self._queues),
            "vruntime": self._ledger.snapshot(),
            "t2": {"share": used / held if held else 0.0, "limit": self.config.t2_share,
                   "held_s": held, "t2_held_s": used, "over_budget": self._t2_over(now)},
            "next_wakeup": self.next_wakeup(),
        }

    # -- read-only helpers for callers ---------------------------------------------------
    def tier(self, job: Job) -> Tier:
        """The job's tier at the policy's current time (recomputed, never stored)."""
        return tier_of(job, self._foreground, self._now if self._now is not None else float("-inf"))

    def job_state(self, job_id: str) -> str | None:
        """"queued", "running", or None for a job the policy does not hold."""
        if self._is_running(job_id):
            return "running"
        return "queued" if self._queues.get(job_id) is not None else None

    @property
    def running_job(self) -> Job | None:
        return self._running.job if self._running else None

    @property
    def queued(self) -> int:
        return len(self._queues)

    @property
    def loaded_model(self) -> str | None:
        return self._loaded

    # -- internals -----------------------------------------------------------------------
    def _check_now(self, now: float) -> float:
        now = check_time(now, "now")
        if self._now is not None and now < self._now:
            raise ValueError(f"time went backwards: now={now} is before the last call's {self._now}")
        return now

    def _advance(self, now: float) -> RevokeCause | None:
        """Move the clock; DEADLINE when a queued deadline passed on the way (R4, R5)."""
        previous, self._now = self._now, now
        if self._ledger.decay(now):
            self._queues.pool.reprice_all()
        due = self._queues.next_deadline_after(previous) if previous is not None else None
        return RevokeCause.DEADLINE if due is not None and due <= now else None

    def _require_running(self, job_id: str, verb: str) -> Entry:
        if self._is_running(job_id):
            return self._running
        if self._queues.get(job_id) is not None:
            raise ValueError(f"{verb}({job_id!r}): the job is queued, not running")
        raise ValueError(self._unknown(job_id, verb))

    def _is_running(self, job_id: str) -> bool:
        return self._running is not None and self._running.job.id == job_id

    def _unknown(self, job_id: str, verb: str) -> str:
        if job_id in self._ended:
            return f"{verb}({job_id!r}): the job already ended ({self._ended[job_id].value})"
        return f"{verb}({job_id!r}): unknown job"

    def _end(self, entry: Entry, outcome: Outcome, now: float) -> None:
        self._ledger.depart(entry.flow, now)
        self._ended[entry.job.id] = outcome
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _running_run(self, now: float) -> Run | None:
        r = self._running
        return Run(r.dispatched_at, now, r.dispatch_tier is Tier.EXTRACT) if r else None

    def _t2_over(self, now: float) -> bool:
        return self._window.over(now, self._running_run(now))

    def _context(self, now: float) -> PickContext:
        return PickContext(self._queues, self._foreground, now, self._loaded,
                           lambda: self._t2_over(now), self.config.max_affinity_wait_s)

    def _react(self, now: float, event: RevokeCause | None) -> list[Action]:
        """Dispatch when idle; at an event (R4), revoke a runner that a queued job outranks."""
        if self._running is None:
            return self._dispatch(now)
        if event is not None and preemptor(self._context(now), self.tier(self._running.job)) is not None:
            return self._revoke(self._running, event)
        return []

    def _dispatch(self, now: float) -> list[Action]:
        entry = pick(self._context(now))
        if entry is None:
            return []
        self._queues.remove(entry)
        entry.dispatched_at = now
        entry.dispatch_tier = self.tier(entry.job)
        swap = entry.job.model_id != self._loaded
        self._loaded = entry.job.model_id
        self._running = entry
        return [Dispatch(entry.job.id, entry.job.model_id, swap, entry.dispatch_tier)]

    def _revoke(self, entry: Entry, cause: RevokeCause) -> list[Action]:
        if entry.revoke_sent:
            return []  # a running job gets at most one Revoke
        entry.revoke_sent = True
        return [Revoke(entry.job.id, cause)]

    def _describe(self, entry: Entry, now: float) -> dict:
        job = entry.job
        return {
            "id": job.id, "order": entry.seq, "kind": job.kind.value, "producer": job.producer,
            "model": job.model_id,
            "deadline": job.deadline, "subject": job.subject, "foreground_hint": job.foreground_hint,
            "submitted": entry.submitted, "waited_s": now - entry.submitted,
        }
