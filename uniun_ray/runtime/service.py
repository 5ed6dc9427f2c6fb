"""The scheduler's imperative shell: the policy fed with real time, its actions executed
against the device, and the lease protocol that producers speak.

`SchedulerService` knows nothing of Ray: a device is any object with async `load`,
`grant` and `revoke` (the Ray actor passes a handle wrapper; tests pass a fake), so the
whole protocol — grants, fencing, revoke during a load, reclaiming a dead holder's lease,
dropping a dead waiter, a device leaving the pool — is testable without a cluster. It
drives a pool of named devices (SPEC §5), each dispatch on the device the policy chose.
It is three parts and the glue between them and the policy:

- `leases.LeaseTable`: every job from submit to end, its lease, the callers' sessions;
- `driver.DeviceDriver`, one per device: its model, swap times and lease epochs (fencing);
- `reaper.Reaper`: the policy's timers, and the reaper of callers that went quiet.

The service applies the policy's actions as they are: a `Dispatch` carries its tier, a
`Revoke` its cause, and `finish` says `Requeued` when the job goes back in its queue;
nothing here re-derives a policy fact.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from ..models.registry import DEFAULT_CHAT_MODEL
from ..settings import check_slot_count
from ..models.swap import SwapAbandoned
from ..policy import Dispatch, Job, Outcome, PolicyConfig, Requeued, Revoke, RevokeCause, SchedulerPolicy
from .clock import Clock
from .driver import Device, DeviceDriver, EpochClock
from ..events.log import EventLog
from .leases import LeaseTable, Tracked
from .protocol import DeviceGone, DeviceLost, JobDropped, Lease, ModelUnavailable, Preempted, UniunError
from .reaper import Reaper

__all__ = ["Device", "RuntimeConfig", "SchedulerService"]

#: How often one job may lose the device (ModelActor died under it) and be re-queued
#: before it fails with DeviceLost: a model that kills its actor must not loop forever.
MAX_DEVICE_FAULTS = 3
#: The scheduler's own faults `status` keeps (its `faults`: the newest last).
FAULTS_KEPT = 20

log = logging.getLogger(__name__)
#: A revoke's reason in the log when the call that caused it names none (a tick, say).
_REASONS = {RevokeCause.ARRIVAL: "arrival of an outranking job", RevokeCause.FOREGROUND: "foreground change",
            RevokeCause.DEADLINE: "deadline passed", RevokeCause.AFFINITY: "an outranking job's affinity wait ended",
            RevokeCause.CANCEL: "cancelled", RevokeCause.RECLAIM: "lease reclaimed",
            RevokeCause.STEP: "a chat's step beside it would exceed its bound (R23)"}
#: The name of the device of a service given one device, not a pool (the policy's default).
LONE_DEVICE = "dev0"
#: The longest a `grant` long-poll waits when its caller's session heartbeats (see `heartbeat`).
SESSION_POLL_S = 60.0
#: How often a busy device is asked for the step times it serves (R23; `DeviceDriver.served_steps`).
STEPS_ASK_S = 1.0
#: The longest an `acquire` waits for the releases it names that have not arrived yet (their
#: holder sent them first; only a release lost with its sender's process takes this long).
RELEASE_WAIT_S = 1.0


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
    chat_model: str = DEFAULT_CHAT_MODEL   # what `model_id=None` means, for every process alike
    models: Mapping[str, str] = field(default_factory=dict)   # the operator's ids -> folders of weights
    hub_models: bool = False          # HTTP requests may name any Hugging Face repo id cached on the device's host
    slots: int | None = None          # jobs a device decodes together (SPEC §6); None: auto, measured at each load
    grant_notice_s: float = 0.05      # the least time between two unconfirmed grant notices to a device (driver)
    settings: tuple = field(default=(), compare=False)   # every setting, as `start` read it (`Settings.describe`)

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
        notice = self.grant_notice_s
        if isinstance(notice, bool) or not isinstance(notice, (int, float)) or not 0 <= notice < math.inf:
            raise ValueError(f"grant_notice_s must be a finite number >= 0, got {notice!r}")
        check_slot_count(self.slots)
        if not isinstance(self.chat_model, str) or not self.chat_model:
            raise ValueError(f"chat_model must be a model id, got {self.chat_model!r}")
        if not isinstance(self.models, Mapping):
            raise ValueError(f"models must map model ids to folders, got {self.models!r}")
        if not isinstance(self.hub_models, bool):
            raise ValueError(f"hub_models must be a bool, got {self.hub_models!r}")
        if self.event_log is not None and (not isinstance(self.event_log, (str, os.PathLike)) or not str(self.event_log)):
            raise ValueError(f"event_log must be a path (or None for the default), got {self.event_log!r}")



def _unloadable(error: Exception, dispatch: Dispatch) -> Exception:
    """A failed load as the job's caller gets it: bad input (an unknown model: ValueError) and
    the runtime's own errors as they are; anything else means the model cannot run on that
    device (ModelUnavailable), with the cause's first line (a Ray task error's carries its
    traceback after it)."""
    if isinstance(error, (ValueError, UniunError)):
        return error
    cause = str(getattr(error, "cause", None) or error).strip()
    return ModelUnavailable(f"model {dispatch.model_id!r} cannot run on device {dispatch.device}: "
                            f"{cause.splitlines()[0] if cause else type(error).__name__}")


class SchedulerService:
    def __init__(self, devices: Device | Mapping[str, Device], config: RuntimeConfig | None = None,
                 metrics=None, clock: Clock | None = None) -> None:
        """`devices`: the pool, device name -> device (in the order ties go by), or one
        device, then named LONE_DEVICE. `clock`: the time it reads and its timers wait on
        (real time; a test passes one it moves by hand)."""
        named = dict(devices) if isinstance(devices, Mapping) else {LONE_DEVICE: devices}
        self.config = config or RuntimeConfig()
        self.clock = clock or Clock()
        self.policy = SchedulerPolicy(self.config.policy, devices=tuple(named), slots=self.config.slots or 1)
        self.leases = LeaseTable(self.config.max_queued, self.clock.monotonic)
        self._epochs = EpochClock()   # one for the pool: a lease's (job, epoch) names one grant
        self.drivers = {name: self._driver(device) for name, device in named.items()}
        self.reaper = Reaper(self.config.reap_period_s, self.policy.next_wakeup, self._tick,
                             lambda mono: self.leases.idle(mono, self.config.waiter_timeout_s,
                                                           self.config.lease_timeout_s),
                             self._withdraw, self._each_round, self.clock)
        self._last_now = 0.0
        self.events = EventLog(self.config.event_log, self.config.event_log_max_bytes)
        # optional sink beside the log (runtime.metrics.SchedulerMetrics): write(event) for
        # every event, refresh(snapshot_fn) from the timer
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self.faults: deque[dict] = deque(maxlen=FAULTS_KEPT)   # the scheduler's own, for status

    # -- the producer-facing protocol ---------------------------------------------------
    async def submit(self, job: Job) -> str:
        """Queue a job; returns its id at once. A bad job raises before anything is queued."""
        self._keep_running()
        if not isinstance(job, Job):
            raise ValueError(f"submit takes a Job (uniun_ray.policy.Job), got {type(job).__name__}")
        self.leases.check_room(job)
        actions = self.policy.submit(job, self._now())  # raises on a duplicate id
        self.leases.add(job)
        self._emit("submit", job, deadline=job.deadline, foreground_hint=job.foreground_hint, subject=job.subject)
        self.reaper.rearm()
        self._apply(actions, (RevokeCause.ARRIVAL, f"arrival of {job.kind.value} job {job.id}"))
        return job.id

    async def grant(self, job_id: str, wait_s: float = 5.0, session: str | None = None) -> Lease | None:
        """Wait for the job's lease; None means "still queued, poll again". Without a
        session, each poll proves the caller alive, so the wait is capped well inside the
        waiter timeout. With a session that heartbeats (`heartbeat`), the session proves it
        and a poll may wait up to SESSION_POLL_S: 10,000 waiters then cost the scheduler
        a few calls a second instead of thousands."""
        self._keep_running()
        tracked = self.leases.get(job_id)
        self.leases.seen(tracked, session)
        cap = SESSION_POLL_S if session is not None else self.config.waiter_timeout_s / 3
        try:
            return await asyncio.wait_for(asyncio.shield(tracked.grant), max(0.0, min(wait_s, cap)))
        except asyncio.TimeoutError:
            return None

    async def acquire(self, job: Job, wait_s: float = 5.0, session: str | None = None,
                      after: tuple[tuple[str, int], ...] = (), released: tuple[tuple[str, int, str], ...] = ()
                      ) -> Lease | None:
        """`submit` then `grant` in one call: a client's first round trip both queues its job
        and waits for its lease (None: queued, poll `grant`). A client ends its leases
        one-way (it does not wait for a release's answer), and its next acquire says so:
        `released`, the releases (job id, epoch, outcome) it had not sent yet, are applied
        here first (one call fewer); `after`, the leases (job id, epoch) whose release is on
        its way: Ray may run an async actor's calls out of order, so the submit waits, at
        most RELEASE_WAIT_S, for them. Either way the policy decides the submit with the
        caller's ended leases free."""
        for job_id, epoch, outcome in released:
            self._release_if_held(job_id, epoch, Outcome.parse(outcome))
        held = self.leases.still_held(after)
        if held:
            await asyncio.wait(held, timeout=RELEASE_WAIT_S)
        await self.submit(job)
        return await self.grant(job.id, wait_s, session)

    async def heartbeat(self, session: str) -> float:
        """A client process is alive, and with it every job it waits for under `session`.
        Returns the seconds until its next heartbeat is due."""
        if not isinstance(session, str) or not session:
            raise ValueError(f"session must be a non-empty string, got {session!r}")
        self.leases.heartbeat(session)
        return self.config.waiter_timeout_s / 3

    async def renew(self, job_id: str, epoch: int) -> bool:
        """A holder's heartbeat; False once the lease was revoked. The client's work stops at
        the device (the revoke reaches the ModelActor and fences its epoch, R4), so its
        heartbeat ignores the answer; `LeaseLoop.still_held` reads it to tell a revoke from a
        device that restarted. A holder whose work no device fences would stop on False."""
        tracked = self.leases.holder(job_id, epoch)
        tracked.last_seen = self.clock.monotonic()
        return not tracked.revoke_requested

    async def report_first_token(self, job_id: str, epoch: int) -> None:
        """The holder saw its job's first piece (for TTFT in the event log and metrics)."""
        tracked = self.leases.holder(job_id, epoch)
        if not tracked.first_token_seen:
            tracked.first_token_seen = True
            self._emit_run("first_token", tracked)

    async def release(self, job_id: str, epoch: int, outcome: str) -> bool:
        """End a lease. Returns True when the job was re-queued (a revoked background job:
        poll `grant` again and resume); False when it ended. A lease whose device left the
        pool under it: the job went back already (True), unless its holder finished the work
        before it heard (done, failed): then the job ends, so that it never runs twice."""
        return self._release(job_id, epoch, Outcome.parse(outcome))

    def _release_if_held(self, job_id: str, epoch: int, outcome: Outcome) -> None:
        """A release that came with an `acquire`. A lease that is no longer held (reclaimed,
        or its job cancelled) changes nothing: the event log says how it ended."""
        if self.leases.moved(job_id, epoch) or self.leases.held(job_id, epoch) is not None:
            self._release(job_id, epoch, outcome)

    def _release(self, job_id: str, epoch: int, outcome: Outcome) -> bool:
        if self.leases.moved(job_id, epoch):
            if outcome is Outcome.REVOKED:
                return True
            self._withdraw(self.leases.jobs[job_id], f"{outcome.value} on a device that then left the pool",
                           RevokeCause.CANCEL)
            return False
        tracked = self.leases.holder(job_id, epoch)
        if outcome is Outcome.REVOKED and not tracked.revoke_requested:
            raise ValueError(f"release({job_id!r}, 'revoked'): the scheduler did not revoke this lease")
        return self._finish(tracked, outcome)

    async def device_lost(self, job_id: str, epoch: int, reason: str = "the model actor died") -> bool:
        """The holder's model call died with the ModelActor (killed, crashed, restarted). The
        job is re-queued (a generation resumes from the tokens its client kept). A device
        gone for good leaves the pool (R20); one that restarted holds no known model, so the
        next dispatch there reloads it. A device that left the pool already (its node died)
        took the lease with it and re-queued the job. Returns True when re-queued (poll
        `grant` again); False when it failed (too many device faults)."""
        if self.leases.moved(job_id, epoch):
            return True
        device = self.leases.holder(job_id, epoch).device
        gone = await self.drivers[device].gone()
        if self.leases.moved(job_id, epoch):          # it left the pool during the probe
            return True
        tracked = self.leases.holder(job_id, epoch)   # still held after the probe?
        if gone:
            return self._remove_device(device, f"device lost: {reason}")
        return self._lose_device(tracked, device, f"device lost: {reason}")

    def add_device(self, name: str, device: Device) -> None:
        """A device joined the pool (R20): it starts empty and takes waiting work at once."""
        actions = self.policy.add_device(name, self._now(), slots=self.config.slots or 1)  # refuses a name in the pool
        self.drivers[name] = self._driver(device)
        self._emit("device", None, device=name, change="added")
        self._apply(actions)

    def _driver(self, device: Device) -> DeviceDriver:
        return DeviceDriver(device, self._epochs, self.config.slots, self.config.grant_notice_s)

    def remove_device(self, name: str, reason: str) -> None:
        """A device left the pool for good (R20): its node died, or its actor is gone. Its
        jobs, if any, go back to their places at once; each holder, whose calls to the device
        fail, is told so when it reports the loss (`device_lost`) or releases."""
        self._remove_device(name, reason)

    async def cancel(self, job_id: str) -> None:
        """The caller withdraws its job, queued or running."""
        tracked = self.leases.jobs.get(job_id)
        if tracked is None:  # already ended (idempotent), or its submit is still on the way:
            self.leases.cancelled_early(job_id)  # then that submit is refused
            return
        self._withdraw(tracked, "cancelled by its caller", RevokeCause.CANCEL)

    async def set_foreground(self, kind: str | None, subject: str | None = None) -> None:
        actions = self.policy.set_foreground(kind, self._now(), subject)
        self._emit("foreground", None, kind=kind, subject=subject)
        self._apply(actions, (RevokeCause.FOREGROUND, f"foreground set to {kind}" + (f" ({subject})" if subject else "")))

    async def status(self) -> dict:
        """The policy's snapshot (`devices`: each device's model and running job, and its swaps:
        the last one's kind and what it kept warm, the seconds per model and kind), the
        measured swap times (the latest of any device), the leases, and `settings`: every
        setting's value and source as `start` read them (`settings.Settings.describe`)."""
        self._tick()  # so held and waited times are current
        snap = self.policy.snapshot()
        snap["swap_s"] = {model: s for driver in self.drivers.values() for model, s in driver.swap_s.items()}
        for device in snap["devices"]:
            plan = self.drivers[device["device"]].plan or {}
            device["step_profile"], device["slots_auto"] = plan.get("step_profile"), plan.get("auto")
            device["swaps"] = self.drivers[device["device"]].describe_swaps()
        snap["event_log"] = str(self.events.path)
        snap["chat_model"] = self.config.chat_model
        snap["leases"] = self.leases.snapshot()
        snap["faults"] = list(self.faults)
        snap["settings"] = [dict(row) for row in self.config.settings]
        return snap

    # -- executing the policy's actions ---------------------------------------------------
    def _apply(self, actions, context: tuple[RevokeCause, str] | None = None) -> None:
        """Execute the policy's actions. `context` (cause, text) words the log's `reason` of a
        revoke with that cause ("arrival of chat job c"); the `cause` is the policy's own."""
        for action in actions:
            if isinstance(action, Requeued):
                continue  # read by `_finish`, which made the call
            tracked = self.leases.jobs[action.job_id]
            if isinstance(action, Dispatch):
                tracked.state, tracked.device = "loading", action.device
                self._emit_run("dispatch", tracked, swap=action.swap, tier=int(action.tier), slot=action.slot,
                               batch=len(self.policy.slot_jobs.get(action.device, ())))
                self._spawn(self._prepare(tracked, action))
            elif isinstance(action, Revoke):
                tracked.revoke_requested = True
                worded = context[1] if context is not None and context[0] is action.cause else None
                bounded = self.policy.chat_step(tracked.device) if action.cause is RevokeCause.STEP else None
                self._emit_run("revoke", tracked, cause=action.cause.value,
                               reason=tracked.drop_reason or worded or _REASONS[action.cause], **(bounded or {}))
                if tracked.lease is not None:
                    self._spawn(self.drivers[tracked.device].revoke(tracked.lease.epoch))
                elif (drain := self.policy.drains.get(tracked.device)) is not None \
                        and self.leases.jobs[drain].job.model_id != tracked.job.model_id:
                    # R13: the job the device is emptied for (a chat) wants another model than
                    # the one this job's swap loads: it must not wait for that swap
                    self._spawn(self.drivers[tracked.device].abandon(tracked.job.model_id))

    async def _prepare(self, tracked: Tracked, dispatch: Dispatch) -> None:
        """`_grant` in a task of its own, guarded: a fault of the scheduler's own code there
        (the device's faults are `_grant`'s to handle) would vanish with the task. It is
        logged with its traceback, kept for `status` (`faults`) and written to the event log
        (`fault`), and the job, if it is still the policy's, fails as a failed load does: its
        holder's acquire raises, the policy frees its slot, nothing waits for it forever."""
        try:
            await self._grant(tracked, dispatch)
        except Exception as error:
            log.exception("preparing %s on %s failed", tracked.job.id, dispatch.device)
            fault = {"t": self._now(), "where": "prepare", "job": tracked.job.id, "device": dispatch.device,
                     "error": f"{type(error).__name__}: {error}"}
            self.faults.append(fault)
            self._emit_run("fault", tracked, where="prepare", error=fault["error"])
            held = any(job.id == tracked.job.id for job in self.policy.slot_jobs.get(dispatch.device, ()))
            if self.leases.jobs.get(tracked.job.id) is tracked and held:
                reason = f"the scheduler failed preparing it: {fault['error']}"
                self._fail(tracked, UniunError(f"job {tracked.job.id}: {reason}"), reason)

    async def _grant(self, tracked: Tracked, dispatch: Dispatch) -> None:
        """Load the model if asked, fence a new epoch at the device, then hand out the lease,
        unless the job was revoked meanwhile: then it ends its turn without ever running. A
        device that left the pool meanwhile (its node died) put the job back already (R20):
        whatever its calls answer then is not the job's any more."""
        device = dispatch.device
        driver = self.drivers[device]
        try:
            swap_s = 0.0
            if dispatch.swap:
                self._emit_run("swap_start", tracked, **{"from": driver.model})
                swap = await driver.load(dispatch.model_id)
                swap_s = swap.seconds
                self._emit_run("swap_end", tracked, seconds=swap_s, swap_kind=swap.kind)
                if self.drivers.get(device) is driver:
                    for model, seconds in driver.swap_costs().items():   # R12: the next swaps' costs
                        self.policy.set_swap_cost(model, device, seconds)
                if driver.plan is not None and self.drivers.get(device) is driver:
                    self._take_plan(device, dispatch.model_id, driver.plan)
            epoch = await driver.fence(dispatch.model_id, confirm=dispatch.swap)
        except Exception as error:
            if self.drivers.get(device) is not driver:
                return
            if tracked.revoke_requested and driver.abandoned == dispatch.model_id:   # given up for a chat (R13)
                if isinstance(error, SwapAbandoned):   # the job whose load it was; the others waited for it
                    self._emit_run("swap_end", tracked, abandoned=True)
                    driver.lost()   # nothing active there; the model it replaced is kept warm
                    self._apply(self.policy.set_loaded_model(None, self._now(), device=device))
                self._finish(tracked, Outcome.REVOKED)
                return
            if isinstance(error, DeviceGone):  # the device leaves the pool: the job runs on another
                self._remove_device(device, f"device lost while preparing: {error}")
                return
            driver.lost()  # the load failed: the job fails, the device holds nothing known
            if isinstance(error, DeviceLost) and not tracked.cancelled:
                self._lose_device(tracked, device, f"device lost while preparing: {error}")
                return
            self._apply(self.policy.set_loaded_model(None, self._now(), device=device))
            self._fail(tracked, _unloadable(error, dispatch))
            return
        if self.drivers.get(device) is not driver:
            return
        try:
            self._hand_out(tracked, dispatch, driver, epoch, swap_s)
        except Exception:   # our own fault (`_prepare` fails the job): the device must not admit the epoch
            self._spawn(driver.revoke(epoch))
            raise

    def _hand_out(self, tracked: Tracked, dispatch: Dispatch, driver: DeviceDriver, epoch: int, swap_s: float) -> None:
        """The fenced epoch's lease to its job, unless the job was revoked meanwhile: then it
        ends its turn without ever running."""
        if tracked.revoke_requested:
            driver.ended(epoch)
            self._finish(tracked, Outcome.REVOKED)
            return
        self.leases.hand_out(tracked, Lease(tracked.job.id, epoch, dispatch.model_id, tracked.job.kind.value,
                                            swap_s, renew_every_s=self.config.lease_timeout_s / 3,
                                            tier=int(dispatch.tier), device=dispatch.device))

    def _take_plan(self, device: str, model_id: str, plan: dict) -> None:
        """What the device chose for the model it loaded: its step profile (R23) and slot
        count (R25), given to the policy, which keeps the count for the model's next swap there."""
        now = self._now()
        self.policy.set_step_profile(model_id, device, {int(b): s for b, s in plan["step_profile"].items()})
        self._emit("slots", None, device=device, model=model_id, slots=plan["slots"],
                   step_profile=plan["step_profile"], auto=plan.get("auto"))
        self._apply(self.policy.set_slots(device, plan["slots"], now, model_id=model_id))

    def _remove_device(self, device: str, reason: str) -> bool:
        """R20: the device is gone for good. The policy forgets it and puts its jobs, if any,
        back at their original places (charged for their held time, R7), unless they were
        cancelled. Not a device fault of the jobs': they did nothing wrong. True when a job
        went back."""
        if self.drivers.pop(device, None) is None:
            return False  # already removed (its jobs' holders and the watcher all saw it go)
        jobs = self.policy.slot_jobs.get(device, [])
        actions = self.policy.remove_device(device, self._now())
        self._emit("device", None, device=device, change="removed", reason=reason)
        requeued = [self._moved_off(self.leases.jobs[job.id], Requeued(job.id) in actions, reason) for job in jobs]
        self._apply(actions, (RevokeCause.ARRIVAL, f"re-queue of a job after {reason}"))
        return any(requeued)

    def _moved_off(self, tracked: Tracked, requeued: bool, reason: str) -> bool:
        """One job of a device that left the pool: back in its queue (its holder learns it
        from `moved`), or ended when it was cancelled."""
        self._emit_run("finish", tracked, outcome="failed", reason=reason, requeued=requeued)
        if requeued:
            if tracked.lease is not None:
                tracked.moved_from = tracked.lease.epoch
            self.leases.requeue(tracked)
        else:
            self.leases.end(tracked, tracked.drop_reason or reason,
                            JobDropped(f"job {tracked.job.id} ended: {tracked.drop_reason or reason}"))
        return requeued

    def _lose_device(self, tracked: Tracked, device: str, reason: str) -> bool:
        """The device died under the dispatched job and came back (restarted): forget its
        model and run the job again. The policy has no "lost" outcome, so the run ends as
        failed (its held time is charged, R7) and the job is submitted again under its id;
        the log's finish says `requeued`. Any kind, chat too: a fault is not a preemption."""
        now = self._now()
        self.drivers[device].lost()
        self._apply(self.policy.set_loaded_model(None, now, device=device))
        tracked.device_faults += 1
        if tracked.device_faults > MAX_DEVICE_FAULTS:
            self._fail(tracked, DeviceLost(f"{reason} ({tracked.device_faults} times; giving up)"))
            return False
        actions = self.policy.finish(tracked.job.id, now, Outcome.FAILED)
        self._emit_run("finish", tracked, outcome="failed", reason=reason, requeued=True)
        actions += self.policy.submit(tracked.job, now)
        self.leases.requeue(tracked)
        self._apply(actions, (RevokeCause.ARRIVAL, f"re-queue of {tracked.job.kind.value} job {tracked.job.id} "
                                                    f"after {reason}"))
        return True

    def _fail(self, tracked: Tracked, error: Exception, reason: str | None = None) -> None:
        self._lease_ended(tracked)
        actions = self.policy.finish(tracked.job.id, self._now(), Outcome.FAILED)
        self._emit_run("finish", tracked, outcome="failed", requeued=False,
                       reason=reason or (str(error) if isinstance(error, DeviceLost) else f"load failed: {error}"))
        self.leases.end(tracked, f"failed: {error}", error)
        self._apply(actions)

    def _finish(self, tracked: Tracked, outcome: Outcome) -> bool:
        self._lease_ended(tracked)
        actions = self.policy.finish(tracked.job.id, self._now(), outcome)
        requeued = Requeued(tracked.job.id) in actions  # R6; maybe dispatched again by this very call
        self._emit_run("finish", tracked, outcome=outcome.value, requeued=requeued)
        if requeued:
            self.leases.requeue(tracked)
        elif outcome is Outcome.REVOKED:
            reason = tracked.drop_reason or "revoked"
            error = JobDropped if tracked.drop_reason else Preempted
            self.leases.end(tracked, reason, error(f"job {tracked.job.id} ended: {reason}"))
        else:
            self.leases.end(tracked, outcome.value)
        self._apply(actions)
        return requeued

    def _lease_ended(self, tracked: Tracked) -> None:
        """The job's lease, if it had one, no longer holds a slot: its device's next grant
        fences it."""
        driver = self.drivers.get(tracked.device)
        if tracked.lease is not None and driver is not None:
            driver.ended(tracked.lease.epoch)

    def _withdraw(self, tracked: Tracked, reason: str, cause: RevokeCause) -> None:
        """End a job on the scheduler's side (its caller cancelled it, or went quiet). A
        granted one is fenced at the device and finished at once: its holder is gone or has
        given up, so nobody will release it. A loading one ends when its load completes
        (see `_prepare`)."""
        tracked.cancelled, tracked.drop_reason = True, reason
        state = tracked.state
        self._apply(self.policy.cancel(tracked.job.id, self._now(), cause))
        if state == "queued":
            self._emit("drop", tracked.job, reason=reason)
            self.leases.end(tracked, reason, JobDropped(f"job {tracked.job.id} ended: {reason}"))
        elif state == "granted":
            if cause is RevokeCause.RECLAIM:
                self._emit_run("reclaim", tracked, reason=reason)
            self._finish(tracked, Outcome.REVOKED)

    # -- time ---------------------------------------------------------------------------
    def _now(self) -> float:
        """Wall-clock epoch seconds (deadlines are time.time()), never going backwards."""
        self._last_now = max(self._last_now, self.clock.time())
        return self._last_now

    def _keep_running(self) -> None:
        """Start the timers that a call needs running (the reaper; a subclass adds its own)."""
        self.reaper.ensure_running()

    def _tick(self) -> None:
        self._apply(self.policy.tick(self._now()))

    def _each_round(self) -> None:
        """After each of the reaper's rounds: the metrics' gauges, and each busy device asked
        for the step times it serves."""
        self._refresh_metrics()
        for name, driver in self.drivers.items():
            if self.policy.slot_jobs.get(name):
                self._spawn(self._take_steps(name, driver))

    async def _take_steps(self, device: str, driver: DeviceDriver) -> None:
        """R23: the step times `device` serves, given to the policy, which reacts at once (a
        running chat's bound may have moved: its companions are revoked, or more may join)."""
        try:
            profile = await driver.served_steps(self.clock.monotonic(), STEPS_ASK_S)
            if profile is not None and self.drivers.get(device) is driver and driver.model is not None:
                self._apply(self.policy.set_step_profile(driver.model, device, profile, self._now()))
        except Exception as error:   # a device that died is its holders' to report; the next round asks again
            log.info("asking %s for its step times failed: %s", device, error)

    def _refresh_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.refresh(self.policy.snapshot)

    # -- helpers --------------------------------------------------------------------------
    def _emit(self, ev: str, job: Job | None, **fields) -> None:
        event = {"t": self._now(), "ev": ev}
        if job is not None:
            event |= {"job": job.id, "kind": job.kind.value, "producer": job.producer, "model": job.model_id}
        event |= fields
        self.events.write(event)
        if self.metrics is not None:
            self.metrics.write(event)

    def _emit_run(self, ev: str, tracked: Tracked, **fields) -> None:
        """An event of a job's run: it names the run's device (SPEC §5)."""
        self._emit(ev, tracked.job, device=tracked.device, **fields)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
