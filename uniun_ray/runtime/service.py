"""The scheduler's imperative shell: the policy fed with real time, its actions executed
against the device, and the lease protocol that producers speak.

`SchedulerService` knows nothing of Ray: the device is any object with async `load`,
`grant` and `revoke` (the Ray actor passes a handle wrapper; tests pass a fake), so the
whole protocol — grants, fencing, revoke during a load, reclaiming a dead holder's lease,
dropping a dead waiter — is testable without a cluster.

Liveness. Ray does not cancel a dead caller's pending call, and a dead holder never
releases. So waiters long-poll `grant` (each poll proves they are alive) and holders renew
their lease; the reaper drops a queued job whose caller stopped polling and reclaims a lease
that was not renewed in time.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from collections import Counter

from ..policy import Dispatch, Kind, Outcome, PolicyConfig, Revoke, SchedulerPolicy
from .eventlog import EventLog
from .protocol import DeviceLost, JobDropped, JobSpec, Lease, Preempted, QueueFull, UnknownJob

_ENDED_MEMORY = 10_000
#: How often one job may lose the device (ModelActor died under it) and be re-queued
#: before it fails with DeviceLost: a model that kills its actor must not loop forever.
MAX_DEVICE_FAULTS = 3
#: The longest a `grant` long-poll waits when its caller's session heartbeats (see `heartbeat`).
SESSION_POLL_S = 60.0


class Device(Protocol):
    """`load`, `grant` and `revoke` raise DeviceLost when the device died under the call.
    Optional: `async current_epoch() -> int`, the newest epoch the device was granted, which
    a (restarted) scheduler reads once so that its epochs fence every older lease."""

    async def load(self, model_id: str) -> float: ...
    async def grant(self, epoch: int) -> None: ...
    async def revoke(self, epoch: int) -> None: ...


@dataclass(frozen=True)
class RuntimeConfig:
    """Timeouts of the lease protocol, and the policy's own configuration."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    lease_timeout_s: float = 30.0     # a lease not renewed for this long is reclaimed
    waiter_timeout_s: float = 30.0    # a queued job whose caller stopped polling is dropped
    reap_period_s: float = 1.0
    max_queued: int = 10_000          # per kind, queued or running; beyond it submit raises QueueFull
    event_log: str | None = None      # JSONL path (default ~/.cache/uniun-ray/events.jsonl)
    event_log_max_bytes: int = 20 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("lease_timeout_s", "waiter_timeout_s", "reap_period_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("max_queued", "event_log_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.policy, PolicyConfig):
            raise ValueError(f"policy must be a PolicyConfig, got {type(self.policy).__name__}")
        if self.event_log is not None and (not isinstance(self.event_log, (str, os.PathLike)) or not str(self.event_log)):
            raise ValueError(f"event_log must be a path (or None for the default), got {self.event_log!r}")


@dataclass(eq=False)
class _Tracked:
    spec: JobSpec
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
    session: str | None = None       # the caller's session: its heartbeats keep the job alive


class SchedulerService:
    def __init__(self, device: Device, config: RuntimeConfig | None = None, metrics=None) -> None:
        self.config = config or RuntimeConfig()
        self.policy = SchedulerPolicy(self.config.policy)
        self._device = device
        self._jobs: dict[str, _Tracked] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._epoch = 0
        self._epoch_synced = False
        self._clock = 0.0
        self._swap_s: dict[str, float] = {}
        self._per_kind: Counter = Counter()
        self._sessions: dict[str, float] = {}   # session -> last heartbeat (monotonic)
        self._device_model: str | None = None
        self.events = EventLog(self.config.event_log, self.config.event_log_max_bytes)
        # optional sink beside the log (runtime.metrics.SchedulerMetrics): write(event) for
        # every event, refresh(snapshot_fn) from the timer
        self.metrics = metrics
        self._rearm = asyncio.Event()
        self._timer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- the producer-facing protocol ---------------------------------------------------
    async def submit(self, spec: JobSpec) -> str:
        """Queue a job; returns its id at once. Bad specs raise before anything is queued."""
        self._ensure_timer()
        if not isinstance(spec, JobSpec):
            raise ValueError(f"submit takes a JobSpec, got {type(spec).__name__}")
        job = spec.to_job()
        if self._per_kind[job.kind] >= self.config.max_queued:
            raise QueueFull(f"the {job.kind.value} queue is full: {self._per_kind[job.kind]} jobs queued or "
                            f"running, limit max_queued={self.config.max_queued}; nothing was queued")
        tracked = _Tracked(spec, self._future(), time.monotonic())
        now = self._now()
        actions = self.policy.submit(job, now)  # raises on a duplicate id
        self._jobs[spec.id] = tracked
        self._per_kind[job.kind] += 1
        self._emit("submit", spec, deadline=spec.deadline, foreground_hint=spec.foreground_hint,
                   subject=spec.subject)
        self._rearm.set()
        self._apply(actions, reason=f"arrival of {spec.kind} job {spec.id}")
        return spec.id

    async def grant(self, job_id: str, wait_s: float = 5.0, session: str | None = None) -> Lease | None:
        """Wait for the job's lease; None means "still queued, poll again". Without a
        session, each poll proves the caller alive, so the wait is capped well inside the
        waiter timeout. With a session that heartbeats (`heartbeat`), the session proves it
        and a poll may wait up to SESSION_POLL_S: 10,000 waiters then cost the scheduler
        a few calls a second instead of thousands."""
        self._ensure_timer()
        tracked = self._tracked(job_id)
        tracked.last_seen = time.monotonic()
        cap = self.config.waiter_timeout_s / 3
        if session is not None:
            tracked.session = session
            self._sessions[session] = tracked.last_seen
            cap = SESSION_POLL_S
        try:
            return await asyncio.wait_for(asyncio.shield(tracked.grant), max(0.0, min(wait_s, cap)))
        except asyncio.TimeoutError:
            return None

    async def heartbeat(self, session: str) -> float:
        """A client process is alive, and with it every job it waits for under `session`.
        Returns the seconds until its next heartbeat is due."""
        if not isinstance(session, str) or not session:
            raise ValueError(f"session must be a non-empty string, got {session!r}")
        self._sessions[session] = time.monotonic()
        return self.config.waiter_timeout_s / 3

    async def renew(self, job_id: str, epoch: int) -> bool:
        """A holder's heartbeat. False: the lease was revoked; stop at once and release."""
        tracked = self._holder(job_id, epoch)
        tracked.last_seen = time.monotonic()
        return not tracked.revoke_requested

    async def report_first_token(self, job_id: str, epoch: int) -> None:
        """The holder saw its job's first piece (for TTFT in the event log and metrics)."""
        tracked = self._holder(job_id, epoch)
        if not tracked.first_token_seen:
            tracked.first_token_seen = True
            self._emit("first_token", tracked.spec)

    async def release(self, job_id: str, epoch: int, outcome: str) -> bool:
        """End a lease. Returns True when the job was re-queued (a revoked background job:
        poll `grant` again and resume); False when it ended."""
        outcome = Outcome.parse(outcome)
        tracked = self._holder(job_id, epoch)
        if outcome is Outcome.REVOKED and not tracked.revoke_requested:
            raise ValueError(f"release({job_id!r}, 'revoked'): the scheduler did not revoke this lease")
        return self._finish(tracked, outcome)

    async def device_lost(self, job_id: str, epoch: int, reason: str = "the model actor died") -> bool:
        """The holder's model call died with the ModelActor (killed, crashed, restarted). The
        device no longer holds a known model, so the next dispatch reloads it; the job is
        re-queued (a generation resumes from the tokens its client kept). Returns True when
        re-queued (poll `grant` again); False when it failed (too many device faults)."""
        return self._lose_device(self._holder(job_id, epoch), f"device lost: {reason}")

    async def cancel(self, job_id: str) -> None:
        """The caller withdraws its job, queued or running."""
        tracked = self._jobs.get(job_id)
        if tracked is None:
            return  # already ended: cancelling is idempotent
        self._withdraw(tracked, "cancelled by its caller")

    def _withdraw(self, tracked: _Tracked, reason: str) -> None:
        """End a job on the scheduler's side. A granted one is fenced at the device and
        finished at once: its holder is gone or has given up, so nobody will release it. A
        loading one ends when its load completes (see `_prepare`)."""
        tracked.cancelled, tracked.drop_reason = True, reason
        state = tracked.state
        self._apply(self.policy.cancel(tracked.spec.id, self._now()), reason=reason)
        if state == "queued":
            self._emit("drop", tracked.spec, reason=reason)
            self._end(tracked, reason)
        elif state == "granted":
            if reason.startswith("lease reclaimed"):
                self._emit("reclaim", tracked.spec, reason=reason)
            self._finish(tracked, Outcome.REVOKED)

    async def set_foreground(self, kind: str | None, subject: str | None = None) -> None:
        actions = self.policy.set_foreground(kind, self._now(), subject)
        self._emit("foreground", None, kind=kind, subject=subject)
        self._apply(actions, reason=f"foreground set to {kind}" + (f" ({subject})" if subject else ""))

    async def status(self) -> dict:
        self._apply(self.policy.tick(self._now()))  # so held and waited times are current
        snap = self.policy.snapshot()
        snap["swap_s"] = dict(self._swap_s)
        snap["event_log"] = str(self.events.path)
        mono = time.monotonic()
        snap["leases"] = {j.spec.id: {"state": j.state, "epoch": j.lease.epoch if j.lease else None,
                                      "held_s": mono - j.granted_at if j.lease else 0.0,
                                      "idle_s": mono - j.last_seen}
                          for j in self._jobs.values() if j.state != "queued"}
        return snap

    # -- executing the policy's actions ---------------------------------------------------
    def _apply(self, actions, reason: str = "deadline passed") -> None:
        """Execute the policy's actions. `reason` is what made this call revoke, if it does
        (a tick revokes only when a queued deadline passed)."""
        for action in actions:
            tracked = self._jobs[action.job_id]
            if isinstance(action, Dispatch):
                tracked.state = "loading"
                self._emit("dispatch", tracked.spec, swap=action.swap,
                           tier=int(self.policy.tier(tracked.spec.to_job())))
                self._spawn(self._prepare(tracked, action))
            elif isinstance(action, Revoke):
                tracked.revoke_requested = True
                self._emit("revoke", tracked.spec, reason=reason)
                if tracked.lease is not None:
                    self._spawn(self._device.revoke(tracked.lease.epoch))

    async def _prepare(self, tracked: _Tracked, dispatch: Dispatch) -> None:
        """Load the model if asked, fence a new epoch at the device, then hand out the lease,
        unless the job was revoked meanwhile: then it ends its turn without ever running."""
        try:
            if not self._epoch_synced:  # (re)started: fence above every lease the device saw
                current = getattr(self._device, "current_epoch", None)
                self._epoch = max(self._epoch, await current() if current else 0)
                self._epoch_synced = True
            swap_s = 0.0
            if dispatch.swap:
                self._emit("swap_start", tracked.spec, **{"from": self._device_model})
                self._device_model = None
                swap_s = await self._device.load(dispatch.model_id)
                self._device_model = dispatch.model_id
                self._swap_s[dispatch.model_id] = swap_s
                self._emit("swap_end", tracked.spec, seconds=swap_s)
            self._epoch += 1
            epoch = self._epoch
            await self._device.grant(epoch)
        except Exception as error:  # the load failed: the job fails, the device holds nothing known
            self._device_model = None
            if isinstance(error, DeviceLost) and not tracked.cancelled:
                self._lose_device(tracked, f"device lost while preparing: {error}")
                return
            self.policy.set_loaded_model(None, self._now())
            self._fail(tracked, error)
            return
        if tracked.revoke_requested:
            self._finish(tracked, Outcome.REVOKED)
            return
        tracked.lease = Lease(tracked.spec.id, epoch, dispatch.model_id, tracked.spec.kind, swap_s,
                              renew_every_s=self.config.lease_timeout_s / 3)
        tracked.state = "granted"
        tracked.last_seen = tracked.granted_at = time.monotonic()
        tracked.grant.set_result(tracked.lease)

    def _lose_device(self, tracked: _Tracked, reason: str) -> bool:
        """The device died under the dispatched job: forget the loaded model and run the job
        again. The policy has no "lost" outcome, so the run ends as failed (its held time is
        charged, R7) and the job is submitted again under its id; the log's finish says
        `requeued`. Any kind, chat too: a fault is not a preemption."""
        now = self._now()
        self._device_model = None
        self._apply(self.policy.set_loaded_model(None, now), reason=reason)
        tracked.device_faults += 1
        if tracked.device_faults > MAX_DEVICE_FAULTS:
            self._fail(tracked, DeviceLost(f"{reason} ({tracked.device_faults} times; giving up)"))
            return False
        actions = self.policy.finish(tracked.spec.id, now, Outcome.FAILED)
        self._emit("finish", tracked.spec, outcome="failed", reason=reason, requeued=True)
        actions += self.policy.submit(tracked.spec.to_job(), now)
        tracked.state, tracked.lease, tracked.revoke_requested = "queued", None, False
        if tracked.grant.done():
            tracked.grant = self._future()
        tracked.last_seen = time.monotonic()
        self._apply(actions, reason=f"re-queue of {tracked.spec.kind} job {tracked.spec.id} after {reason}")
        return True

    def _fail(self, tracked: _Tracked, error: Exception) -> None:
        actions = self.policy.finish(tracked.spec.id, self._now(), Outcome.FAILED)
        self._emit("finish", tracked.spec, outcome="failed",
                   reason=str(error) if isinstance(error, DeviceLost) else f"load failed: {error}")
        self._forget(tracked, f"failed: {error}")
        if not tracked.grant.done():
            tracked.grant.set_exception(error)
        self._apply(actions)

    def _finish(self, tracked: _Tracked, outcome: Outcome) -> bool:
        job_id = tracked.spec.id
        actions = self.policy.finish(job_id, self._now(), outcome)
        self._emit("finish", tracked.spec, outcome=outcome.value)
        # re-queued (R6); possibly dispatched again by this very call (it is still the best job)
        requeued = self.policy.job_state(job_id) is not None
        if requeued:
            tracked.state, tracked.lease, tracked.revoke_requested = "queued", None, False
            if tracked.grant.done():  # a waiter still on the unresolved one keeps it
                tracked.grant = self._future()
            tracked.last_seen = time.monotonic()
        elif outcome is Outcome.REVOKED:
            self._end(tracked, tracked.drop_reason or "revoked")
        else:
            self._forget(tracked, outcome.value)
        self._apply(actions)
        return requeued

    def _end(self, tracked: _Tracked, reason: str) -> None:
        """The job will never run (again): wake its waiter with the reason."""
        self._forget(tracked, reason)
        if not tracked.grant.done():
            error = JobDropped if tracked.drop_reason else Preempted
            tracked.grant.set_exception(error(f"job {tracked.spec.id} ended: {reason}"))

    def _forget(self, tracked: _Tracked, reason: str) -> None:
        if self._jobs.pop(tracked.spec.id, None) is not None:
            self._per_kind[Kind(tracked.spec.kind)] -= 1
        self._ended[tracked.spec.id] = reason
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    # -- time: deadlines and the reaper ---------------------------------------------------
    def _now(self) -> float:
        """Wall-clock epoch seconds (deadlines are time.time()), never going backwards."""
        self._clock = max(self._clock, time.time())
        return self._clock

    def _ensure_timer(self) -> None:
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._run_timer())

    async def _run_timer(self) -> None:
        while True:
            wake = self.policy.next_wakeup()
            delay = self.config.reap_period_s
            if wake is not None:
                delay = min(delay, max(0.0, wake - time.time()))
            self._rearm.clear()
            try:
                await asyncio.wait_for(self._rearm.wait(), delay)
            except asyncio.TimeoutError:
                pass
            self._apply(self.policy.tick(self._now()))
            self._reap(time.monotonic())
            if self.metrics is not None:
                self.metrics.refresh(self.policy.snapshot)

    def _reap(self, mono: float) -> None:
        for session, seen in list(self._sessions.items()):
            if mono - seen > 10 * self.config.waiter_timeout_s:
                del self._sessions[session]
        for tracked in list(self._jobs.values()):
            seen = tracked.last_seen
            if tracked.state == "queued" and tracked.session is not None:
                seen = max(seen, self._sessions.get(tracked.session, seen))
            idle = mono - seen
            if tracked.state == "queued" and idle > self.config.waiter_timeout_s:
                self._withdraw(tracked, f"its caller stopped polling for {idle:.1f} s (caller gone?)")
            elif tracked.state == "granted" and idle > self.config.lease_timeout_s:
                self._withdraw(tracked, f"lease reclaimed: not renewed for {idle:.1f} s (holder gone?)")

    # -- helpers --------------------------------------------------------------------------
    def _emit(self, ev: str, spec: JobSpec | None, **fields) -> None:
        event = {"t": self._now(), "ev": ev}
        if spec is not None:
            event |= {"job": spec.id, "kind": spec.kind, "producer": spec.producer or spec.kind,
                      "model": spec.model_id}
        event |= fields
        self.events.write(event)
        if self.metrics is not None:
            self.metrics.write(event)

    def _future(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        return future

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tracked(self, job_id: str) -> _Tracked:
        tracked = self._jobs.get(job_id)
        if tracked is None:
            reason = self._ended.get(job_id)
            if reason:
                raise JobDropped(f"job {job_id} ended: {reason}")
            raise UnknownJob(f"unknown job {job_id!r}: this scheduler has no record of it (it restarted and "
                             f"lost its queue, or the id was never submitted); resubmit it")
        return tracked

    def _holder(self, job_id: str, epoch: int) -> _Tracked:
        tracked = self._tracked(job_id)
        if tracked.lease is None or tracked.lease.epoch != epoch:
            raise JobDropped(f"lease {epoch} of job {job_id} is no longer held (stale or already released)")
        return tracked
