"""The lease table: every job the scheduler holds from its submit to its end, what state its
lease is in, and the sessions whose heartbeats prove waiting callers alive.

Plain bookkeeping, no policy and no device: `SchedulerService` decides, this remembers.
A job is `queued` (its caller long-polls `grant`), `loading` (dispatched, the device is
being prepared) or `granted` (a holder has the lease and renews it). When a job ends for
good its id is remembered for a while with the reason, so a late call is told why.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

from ..policy import Job
from .protocol import JobDropped, Lease, QueueFull, UnknownJob

_ENDED_MEMORY = 10_000
_CANCELLED_EARLY = "cancelled by its caller before its submit arrived"


@dataclass(eq=False)
class Tracked:
    job: Job
    grant: asyncio.Future
    last_seen: float
    state: str = "queued"            # queued | loading | granted
    lease: Lease | None = None
    revoke_requested: bool = False
    cancelled: bool = False
    drop_reason: str | None = None   # why the scheduler itself withdrew the job
    granted_at: float = 0.0
    first_token_seen: bool = False
    device_faults: int = 0
    device: str | None = None        # the device of its latest dispatch
    session: str | None = None       # the caller's session: its heartbeats keep the job alive
    moved_from: int | None = None    # the epoch of the lease its device took along when it left the pool
    lease_over: asyncio.Future | None = None   # resolved when the lease handed out ends (`requeue`, `end`)


def _future() -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
    return future


def _resolve(future: asyncio.Future | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class LeaseTable:
    def __init__(self, max_queued: int, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.max_queued = max_queued
        self.monotonic = monotonic             # the service's clock (`clock.Clock`)
        self.jobs: dict[str, Tracked] = {}
        self.per_kind: Counter = Counter()
        self.sessions: dict[str, float] = {}   # session -> last heartbeat (monotonic)
        self._ended: OrderedDict[str, str] = OrderedDict()

    # -- a job's life -----------------------------------------------------------------------
    def check_room(self, job: Job) -> None:
        """Refuse a job its caller already withdrew (a cancel that overtook its submit), or
        one beyond the per-kind bound."""
        if self._ended.get(job.id) == _CANCELLED_EARLY:
            raise JobDropped(f"job {job.id} ended: {_CANCELLED_EARLY}")
        kind = job.kind
        if self.per_kind[kind] >= self.max_queued:
            raise QueueFull(f"the {kind.value} queue is full: {self.per_kind[kind]} jobs queued or "
                            f"running, limit max_queued={self.max_queued}; nothing was queued")

    def add(self, job: Job) -> Tracked:
        tracked = self.jobs[job.id] = Tracked(job, _future(), self.monotonic())
        self.per_kind[job.kind] += 1
        return tracked

    def requeue(self, tracked: Tracked) -> None:
        """Back to queued (a revoked run, or one the device lost): a fresh grant to wait for."""
        _resolve(tracked.lease_over)
        tracked.state, tracked.lease, tracked.revoke_requested = "queued", None, False
        if tracked.grant.done():  # a waiter still on the unresolved one keeps it
            tracked.grant = _future()
        tracked.last_seen = self.monotonic()

    def hand_out(self, tracked: Tracked, lease: Lease) -> None:
        tracked.lease, tracked.state, tracked.lease_over = lease, "granted", _future()
        tracked.last_seen = tracked.granted_at = self.monotonic()
        tracked.grant.set_result(lease)

    def end(self, tracked: Tracked, reason: str, error: BaseException | None = None) -> None:
        """The job will never run (again): forget it, and wake its waiter with `error`."""
        if self.jobs.pop(tracked.job.id, None) is not None:
            self.per_kind[tracked.job.kind] -= 1
        _resolve(tracked.lease_over)
        self._ended[tracked.job.id] = reason
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        if error is not None and not tracked.grant.done():
            tracked.grant.set_exception(error)

    def cancelled_early(self, job_id: str) -> None:
        """A cancel for a job this table does not hold: remember it, unless the job ended
        already, so that a submit of it still on its way is refused."""
        if job_id not in self._ended:
            self._ended[job_id] = _CANCELLED_EARLY
            if len(self._ended) > _ENDED_MEMORY:
                self._ended.popitem(last=False)

    # -- lookups ----------------------------------------------------------------------------
    def get(self, job_id: str) -> Tracked:
        tracked = self.jobs.get(job_id)
        if tracked is None:
            reason = self._ended.get(job_id)
            if reason:
                raise JobDropped(f"job {job_id} ended: {reason}")
            raise UnknownJob(f"unknown job {job_id!r}: this scheduler has no record of it (it restarted and "
                             f"lost its queue, or the id was never submitted); resubmit it")
        return tracked

    def moved(self, job_id: str, epoch: int) -> bool:
        """Whether lease `epoch` of the job went with a device that left the pool (R20): the
        job is queued again (or already runs elsewhere), and that lease's holder is to resume."""
        tracked = self.jobs.get(job_id)
        return tracked is not None and tracked.moved_from == epoch

    def held(self, job_id: str, epoch: int) -> Tracked | None:
        """The job, while lease `epoch` of it is the one handed out and not ended."""
        tracked = self.jobs.get(job_id)
        return tracked if tracked is not None and tracked.lease is not None and tracked.lease.epoch == epoch else None

    def holder(self, job_id: str, epoch: int) -> Tracked:
        tracked = self.get(job_id)
        if self.held(job_id, epoch) is None:
            raise JobDropped(f"lease {epoch} of job {job_id} is no longer held (stale or already released)")
        return tracked

    def still_held(self, leases) -> list[asyncio.Future]:
        """Of `leases` ((job id, epoch) pairs), the `lease_over` of each one still held."""
        return [tracked.lease_over for job_id, epoch in leases if (tracked := self.held(job_id, epoch)) is not None]

    # -- liveness ---------------------------------------------------------------------------
    def seen(self, tracked: Tracked, session: str | None) -> None:
        tracked.last_seen = self.monotonic()
        if session is not None:
            tracked.session = session
            self.sessions[session] = tracked.last_seen

    def heartbeat(self, session: str) -> None:
        self.sessions[session] = self.monotonic()

    def idle(self, mono: float, waiter_timeout_s: float, lease_timeout_s: float) -> Iterator[tuple[Tracked, float]]:
        """Jobs whose caller went quiet: a queued one past `waiter_timeout_s` (its session's
        heartbeat counts as a poll), a granted one past `lease_timeout_s` without a renew."""
        for session, seen in list(self.sessions.items()):
            if mono - seen > 10 * waiter_timeout_s:
                del self.sessions[session]
        for tracked in list(self.jobs.values()):
            seen = tracked.last_seen
            if tracked.state == "queued" and tracked.session is not None:
                seen = max(seen, self.sessions.get(tracked.session, seen))
            idle = mono - seen
            if (tracked.state == "queued" and idle > waiter_timeout_s) or \
                    (tracked.state == "granted" and idle > lease_timeout_s):
                yield tracked, idle

    def snapshot(self) -> dict:
        mono = self.monotonic()
        return {j.job.id: {"state": j.state, "epoch": j.lease.epoch if j.lease else None,
                           "held_s": mono - j.granted_at if j.lease else 0.0, "idle_s": mono - j.last_seen}
                for j in self.jobs.values() if j.state != "queued"}
