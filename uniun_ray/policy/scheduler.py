"""`SchedulerPolicy`: the state machine of SPEC §1 and §5, with explicit time.

It holds the queues, the pool of devices (each with its loaded model and the jobs in its
slots, §6),
the foreground, the vruntime ledger and the T2 window, and turns each event into actions
(Dispatch, Revoke, Requeued). With one device it is exactly the single-device policy.
It never sleeps or reads a clock: the SchedulerActor feeds it real time, the simulator
virtual time.

Every public method validates all of its input before it changes anything, so a
ValueError leaves the state exactly as it was.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from .budget import Run, T2Window
from .fairness import VruntimeLedger
from .picker import PickContext, affinity_bound, affinity_wakeup, drain_target, place, slot_for, victim, waited_past
from .pool import Device, Pool, check_slots
from .steps import StepProfiles
from .queues import Entry, Queues
from .tiers import Foreground, Tier, tier_of
from .types import (POOL_KINDS, WITHDRAWALS, Action, Dispatch, Job, Kind, Outcome, PolicyConfig, Requeued,
                    Revoke, RevokeCause, check_time)

#: How many ended job ids are remembered, only to tell "finished twice" from "unknown".
_ENDED_MEMORY = 10_000


class SchedulerPolicy:
    def __init__(self, config: PolicyConfig | None = None, devices: tuple[str, ...] | list[str] = ("dev0",),
                 slots: int | Mapping[str, int] = 1) -> None:
        """`slots`: each device's slot count (R25), one for all or per device name."""
        if isinstance(devices, str):
            raise ValueError(f"devices is a sequence of device names, got the string {devices!r}")
        if isinstance(slots, Mapping):
            unknown = set(slots) - set(devices)
            if unknown:
                raise ValueError(f"slots names devices not in the pool: {', '.join(sorted(map(str, unknown)))}")
            counts = [(d, slots.get(d, 1)) for d in devices]
        else:
            counts = [(d, slots) for d in devices]
        self.config = config or PolicyConfig()
        self._pool = Pool(counts)
        self._steps = StepProfiles(self.config.chat_step_slack, self.config.chat_step_floor_s)
        self._swap_costs: dict[tuple[str, str], float] = {}   # (device, model) -> seconds (R12)
        self._ledger = VruntimeLedger(self.config)
        self._queues = Queues(self._ledger, self._inflight)
        self._window = T2Window(self.config.window_s, self.config.t2_share)
        self._foreground = Foreground()
        self._now: float | None = None
        self._seq = 0
        self._dispatches = 0
        self._affinity_at: float | None = None  # R5's wait end, as of the last call (`_settle`)
        self._last_run: dict = {}   # R19: per pool kind and per flow, its last run's held seconds
        self._ended: OrderedDict[str, Outcome] = OrderedDict()

    # -- public API ----------------------------------------------------------------------
    def submit(self, job: Job, now: float) -> list[Action]:
        now = self._check_now(now)
        if not isinstance(job, Job):
            raise ValueError(f"submit takes a Job, got {type(job).__name__}")
        if self.job_state(job.id) is not None:
            raise ValueError(f"duplicate job id {job.id!r}: a job with this id is already queued or running")
        passed = self._advance(now)
        entry = Entry(job, self._seq, now)
        self._seq += 1
        self._ledger.arrive(entry.flow, now)
        self._queues.add(entry)
        # an arrival is an event (R4); named for a deadline or wait it did not outrank
        outranks = any(self.tier(job) < self.tier(e.job) for _, e in self._pool.running())
        return self._react(now, passed if passed is not None and not outranks else RevokeCause.ARRIVAL)

    def finish(self, job_id: str, now: float, outcome: Outcome | str) -> list[Action]:
        now = self._check_now(now)
        outcome = Outcome.parse(outcome)
        device = self._require_running(job_id, "finish")
        entry = device.jobs[job_id]
        if outcome is Outcome.REVOKED and not entry.revoke_sent:
            raise ValueError(f"finish({job_id!r}, 'revoked'): the policy never revoked this job")
        self._advance(now)
        requeue = outcome is Outcome.REVOKED and entry.job.kind is not Kind.CHAT
        return self._stop(device, entry, now, outcome, requeue) + self._react(now, None)

    def cancel(self, job_id: str, now: float, cause: RevokeCause | str = RevokeCause.CANCEL) -> list[Action]:
        """The caller withdrew the job: CANCEL, or RECLAIM when the runtime took back the
        lease of a holder that died. A running job gets its Revoke with that cause."""
        now = self._check_now(now)
        if cause not in WITHDRAWALS:  # a str Enum: "cancel" matches RevokeCause.CANCEL too
            raise ValueError(f"cancel({job_id!r}): cause must be one of "
                             f"{', '.join(c.value for c in WITHDRAWALS)}, got {cause!r}")
        cause = RevokeCause(cause)
        queued = self._queues.get(job_id)
        device = self._pool.holder(job_id)
        if queued is None and device is None:
            raise ValueError(self._unknown(job_id, "cancel"))
        passed = self._advance(now)
        if device is not None:
            device.jobs[job_id].cancelled = True
            return self._revoke(device.jobs[job_id], cause) + self._react(now, None)  # its slot: R22
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
        passed = self._advance(now)
        before, self._foreground = self._foreground, Foreground(kind, subject)
        moved = self._queues.moved_by(before, self._foreground) or any(
            before.hoists(e.job) != self._foreground.hoists(e.job) for _, e in self._pool.running())
        return self._react(now, RevokeCause.FOREGROUND if moved else passed)

    def tick(self, now: float) -> list[Action]:
        """R5: the runtime calls this at `next_wakeup()`; a deadline that passed since the
        last call may promote a queued job to T3 and preempt, and the end of an outranking
        job's affinity wait may let it preempt. Otherwise a tick changes nothing."""
        now = self._check_now(now)
        return self._react(now, self._advance(now))

    def set_loaded_model(self, model_id: str | None, now: float, device: str | None = None) -> list[Action]:
        """The runtime tells what a device really holds (after a failed load or a restart
        of its model actor), so the next Dispatch there asks for a swap when needed.
        `device` may be left out while the pool has one device."""
        now = self._check_now(now)
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"model_id must be a non-empty string or None, got {model_id!r}")
        if device is None and len(self._pool) != 1:
            raise ValueError(f"set_loaded_model: name the device; the pool has {len(self._pool)}")
        target = self._pool.get(device) if device is not None else next(iter(self._pool))
        passed = self._advance(now)
        target.loaded = model_id
        return self._react(now, passed)

    def add_device(self, device: str, now: float, slots: int = 1) -> list[Action]:
        """A device joined the pool (R20) with `slots` slots (R25): it starts empty, and takes
        waiting work (R16)."""
        now = self._check_now(now)
        self._pool.check_new(device, slots)
        passed = self._advance(now)
        self._pool.add(device, slots)
        return self._react(now, passed)

    def set_slots(self, device: str, slots: int, now: float, model_id: str | None = None) -> list[Action]:
        """R25: the device's slot count for `model_id` (default: the model it holds), as its
        ModelActor chose it after that model's load (measured, "auto", or the setting). Jobs
        beyond a smaller count run to their end; no free slot is filled until they have. The
        count is remembered: a later swap back to the model has it from its dispatch on, so
        the jobs dispatched while the model loads fit it (a count that arrives once the
        device moved on to another model waits for that swap back)."""
        now = self._check_now(now)
        target = self._pool.get(device)
        slots = check_slots(slots, device)
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"model_id must be a non-empty string or None, got {model_id!r}")
        passed = self._advance(now)
        model_id = target.loaded if model_id is None else model_id
        if model_id is not None:
            target.counts[model_id] = slots
        if model_id == target.loaded:
            target.slots = slots
        return self._react(now, passed)

    def set_step_profile(self, model_id: str, device: str, profile: Mapping[int, float],
                         now: float | None = None) -> list[Action]:
        """R23: the step time of `model_id` on `device` per batch size, as the runtime measured
        it. Given `now`, the policy reacts at once (a running chat's bound may have moved);
        without it the profile counts from the next call."""
        if now is not None:
            now = self._check_now(now)
        self._pool.get(device)
        self._steps.set(model_id, device, profile)
        if now is None:
            return []
        return self._react(now, self._advance(now))

    def set_swap_cost(self, model_id: str, device: str, seconds: float, now: float | None = None) -> list[Action]:
        """R12: what a swap to `model_id` on `device` costs now, as the runtime measured it for
        the kind it would be (a cold load, a copy from host memory, a switch). A job's affinity
        wait follows the cheapest swap the pool offers it (`picker.affinity_bound`); a model
        without one is a cold load of unknown cost: the whole wait. Given `now`, the policy
        reacts at once: a cost that shortens a wait past its end is that wait's end (R4's
        event); without `now` the cost counts from the next call."""
        if now is not None:
            now = self._check_now(now)
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
        self._pool.get(device)
        if check_time(seconds, "swap seconds") < 0:
            raise ValueError(f"swap seconds must be >= 0, got {seconds!r}")
        self._swap_costs[(device, model_id)] = float(seconds)
        if now is None:
            return []
        return self._react(now, self._advance(now) or RevokeCause.AFFINITY)

    def _wait_bound(self, entry: Entry) -> float:
        """R12: the affinity wait of `entry`, by the cheapest swap to its model in the pool."""
        known = (self._swap_costs.get((name, entry.job.model_id)) for name in self._pool.names)
        cheapest = min((cost for cost in known if cost is not None), default=None)
        return affinity_bound(self.config.max_affinity_wait_s, self.config.affinity_full_swap_s, cheapest)

    def remove_device(self, device: str, now: float) -> list[Action]:
        """A device left the pool (R20): its model is forgotten, and its running job, charged
        for the time it held the device (R7), goes back to its original place (resumes as
        R6: the runtime keeps its tokens) unless it was cancelled; no `finish` follows."""
        now = self._check_now(now)
        gone = self._pool.get(device)
        passed = self._advance(now)
        actions = [a for entry in list(gone.jobs.values())
                   for a in self._stop(gone, entry, now, Outcome.REVOKED, requeue=True)]
        self._pool.remove(device)
        self._swap_costs = {key: cost for key, cost in self._swap_costs.items() if key[0] != device}
        return actions + self._react(now, passed)

    def next_wakeup(self) -> float | None:
        """R5: the earliest queued deadline not yet passed, or the end of the affinity wait
        of a queued job that outranks a running one, whichever comes first."""
        if self._now is None:
            return None
        times = (self._queues.next_deadline_after(self._now), self._affinity_at)
        return min((t for t in times if t is not None), default=None)

    def snapshot(self) -> dict:
        """JSON-ready state. `running` and `loaded_model` are the first device's (with one
        device: the device's); `devices` lists every device."""
        now = self._now if self._now is not None else 0.0
        tiers: dict[str, list[dict]] = {t.label: [] for t in Tier}
        for entry in sorted(self._queues, key=lambda e: e.seq):
            tiers[self.tier(entry.job).label].append(self._describe(entry, now))
        used, held = self._window.usage(now, self._running_runs(now))
        devices = [{"device": d.name, "loaded_model": d.loaded, "slots": d.slots, "slots_by_model": dict(d.counts),
                    "running": self._describe_running(d, d.running, now) if d.running else None,
                    "jobs": [self._describe_running(d, e, now) for e in d.jobs.values()],
                    "draining_for": d.drain_for}
                   for d in self._pool]
        first = devices[0] if devices else {"loaded_model": None, "running": None}
        return {
            "now": self._now,
            "loaded_model": first["loaded_model"],
            "devices": devices,
            "foreground": {
                "kind": self._foreground.kind.value if self._foreground.kind else None,
                "subject": self._foreground.subject,
            },
            "running": first["running"],
            "tiers": tiers,
            "queued": len(self._queues),
            "vruntime": self._ledger.snapshot(),
            "t2": {"share": used / held if held else 0.0, "limit": self.config.t2_share,
                   "held_s": held, "t2_held_s": used, "over_budget": self._t2_over(now)},
            "next_wakeup": self.next_wakeup(),
            "swap_cost_s": {d.name: {model: cost for (device, model), cost in sorted(self._swap_costs.items())
                                     if device == d.name} for d in self._pool},
        }

    # -- read-only helpers for callers ---------------------------------------------------
    def tier(self, job: Job) -> Tier:
        """The job's tier at the policy's current time (recomputed, never stored)."""
        return tier_of(job, self._foreground, self._now if self._now is not None else float("-inf"))

    def job_state(self, job_id: str) -> str | None:
        """"queued", "running", or None for a job the policy does not hold."""
        if self._pool.holder(job_id) is not None:
            return "running"
        return "queued" if self._queues.get(job_id) is not None else None

    def device_of(self, job_id: str) -> str | None:
        """The device running `job_id`, or None."""
        device = self._pool.holder(job_id)
        return device.name if device is not None else None

    @property
    def devices(self) -> tuple[str, ...]:
        return self._pool.names

    @property
    def running_jobs(self) -> dict[str, Job]:
        """Device name -> its first running job, for the busy devices (one slot: the job)."""
        return {d.name: d.running.job for d in self._pool.busy()}

    @property
    def slot_jobs(self) -> dict[str, list[Job]]:
        """Device name -> the jobs in its slots, in dispatch order, for every device."""
        return {d.name: [e.job for e in d.jobs.values()] for d in self._pool}

    @property
    def drains(self) -> dict[str, str]:
        """Device name -> the queued job it is emptied for (R21, R13), for the draining devices."""
        return {d.name: d.drain_for for d in self._pool if d.drain_for is not None}

    @property
    def slots(self) -> dict[str, int]:
        return {d.name: d.slots for d in self._pool}

    @property
    def loaded_models(self) -> dict[str, str | None]:
        return {d.name: d.loaded for d in self._pool}

    @property
    def running_job(self) -> Job | None:
        """The first device's running job (with one device: the running job)."""
        first = next(iter(self._pool), None)
        return first.running.job if first is not None and first.running else None

    @property
    def queued(self) -> int:
        return len(self._queues)

    @property
    def loaded_model(self) -> str | None:
        """The first device's model (with one device: the loaded model)."""
        first = next(iter(self._pool), None)
        return first.loaded if first is not None else None

    # -- internals -----------------------------------------------------------------------
    def _check_now(self, now: float) -> float:
        now = check_time(now, "now")
        if self._now is not None and now < self._now:
            raise ValueError(f"time went backwards: now={now} is before the last call's {self._now}")
        return now

    def _advance(self, now: float) -> RevokeCause | None:
        """Move the clock; name the event that happened on the way, if any (R4, R5): a
        queued deadline passed, or an outranking job's affinity wait ended. Whatever call
        comes first notices it, whether or not the runtime ticked at `next_wakeup`."""
        previous, affinity = self._now, self._affinity_at  # of the state since the last call
        self._now = now
        if self._ledger.decay(now):
            self._queues.pool.reprice_all()
        due = self._queues.next_deadline_after(previous) if previous is not None else None
        if due is not None and due <= now:
            return RevokeCause.DEADLINE
        return RevokeCause.AFFINITY if affinity is not None and affinity <= now else None

    def _inflight(self) -> dict:
        """R19: per pool kind and per (kind, producer), what its running jobs count for and
        how many run, for the fair pool to rank by (fewer running first). A running job counts for the time it has
        held its device, and at least for its flow's last run (a producer that has not ended a
        run yet: its kind's): devices or slots that free at one instant would otherwise all go
        to the flow whose jobs were just dispatched (they have held nothing yet), and one flow
        could take the pool for a whole round of its jobs."""
        running: dict = {}
        for _, entry in self._pool.running():
            if entry.job.kind in POOL_KINDS and not entry.handed:
                kind_last = self._last_run.get(entry.job.kind, 0.0)
                for flow in (entry.job.kind, entry.flow):
                    held, count = running.get(flow, (0.0, 0))
                    expected = max(self._now - entry.dispatched_at, self._last_run.get(flow, kind_last))
                    running[flow] = (held + expected, count + 1)
        return running

    def _settle(self, ctx: PickContext) -> None:
        """Note, at the end of every call that changes the state, when the affinity wait of
        an outranking job ends (R4, R5): `next_wakeup` reports it, and the next call's
        `_advance` finds out whether it passed. Computed once per call, with the call's
        context (its T2 budget reading included)."""
        runners = {(d.loaded, self.tier(e.job)) for d, e in self._pool.running() if not e.revoke_sent}
        times = [affinity_wakeup(ctx, loaded, tier) for loaded, tier in runners]  # once per model and tier
        self._affinity_at = min((t for t in times if t is not None), default=None)

    def _require_running(self, job_id: str, verb: str) -> Device:
        device = self._pool.holder(job_id)
        if device is not None:
            return device
        if self._queues.get(job_id) is not None:
            raise ValueError(f"{verb}({job_id!r}): the job is queued, not running")
        raise ValueError(self._unknown(job_id, verb))

    def _unknown(self, job_id: str, verb: str) -> str:
        if job_id in self._ended:
            return f"{verb}({job_id!r}): the job already ended ({self._ended[job_id].value})"
        return f"{verb}({job_id!r}): unknown job"

    def _end(self, entry: Entry, outcome: Outcome, now: float) -> None:
        self._ledger.depart(entry.flow, now)
        self._ended[entry.job.id] = outcome
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    @staticmethod
    def _run_of(entry: Entry, now: float) -> Run:
        return Run(entry.dispatched_at, now, entry.dispatch_tier is Tier.EXTRACT)

    def _running_runs(self, now: float) -> list[Run]:
        return [self._run_of(e, now) for _, e in self._pool.running() if not e.handed]

    def _t2_over(self, now: float) -> bool:
        return self._window.over(now, self._running_runs(now))

    def _context(self, now: float) -> PickContext:
        return PickContext(self._queues, self._foreground, now, lambda: self._t2_over(now),
                           self._wait_bound, lambda entry: self.tier(entry.job))

    def _stop(self, device: Device, entry: Entry, now: float, outcome: Outcome, requeue: bool) -> list[Action]:
        """End the run of `entry` on `device`: charge it (R7, R11; slot-seconds, R24) and free
        its slot; the job goes back to its original place (R6) when `requeue` and it was not
        cancelled, else ends. The caller then reacts (the device may be leaving the pool)."""
        self._pool.stop(device, entry)
        if not entry.handed:
            self._close_run(device, entry, now)
        if requeue and not entry.cancelled:
            entry.dispatched_at = entry.dispatch_tier = None
            entry.revoke_sent = entry.handed = False
            self._queues.add(entry)  # same seq: its original place (R6)
            return [Requeued(entry.job.id)]
        self._end(entry, outcome, now)
        return []

    def _close_run(self, device: Device, entry: Entry, now: float) -> None:
        """Charge the run of `entry` as it stops holding its slot, at its end or when it hands
        the slot over (R7, R11; slot-seconds, R24)."""
        self._window.record((device.name, entry.slot), self._run_of(entry, now))
        self._ledger.charge(entry.flow, now - entry.dispatched_at)
        if entry.job.kind in POOL_KINDS:
            self._last_run[entry.job.kind] = self._last_run[entry.flow] = now - entry.dispatched_at
        self._queues.pool.reprice(entry.flow)

    def _react(self, now: float, event: RevokeCause | None) -> list[Action]:
        """Give every free slot work (R16, R21); then, at an event (R4), revoke the running
        jobs that queued jobs outrank, one per outranking job (R18, R22); then keep each
        running chat's step within its bound (R23); then fill the slots those revokes handed
        over, and those of a device whose drain moved elsewhere."""
        ctx = self._context(now)
        actions = self._fill(ctx, now)
        if event is not None:
            actions += self._preempt(ctx, event, {a.job_id for a in actions})
        while more := self._empty_for_urgent(ctx) + self._hold_chat_steps() + self._fill(ctx, now):
            actions += more  # a chat that took a handed slot may bound its companions (R23)
        self._settle(ctx)
        return actions

    def _fill(self, ctx: PickContext, now: float) -> list[Action]:
        actions: list[Action] = []
        while (choice := self._next(ctx)) is not None:
            actions.append(self._dispatch(*choice, now))
        return actions

    def _next(self, ctx: PickContext) -> tuple[Entry, Device] | None:
        free = self._pool.free()
        self._plan_drain(ctx, free)
        return place(ctx, free, lambda d: self._ceiling(ctx, d)) if free else None

    def _ceiling(self, ctx: PickContext, device: Device) -> Tier | None:
        """The tier from which a device's free slot is closed (`place`): beside chats whose
        step is at its bound only a chat may join (R23); a device draining for another
        model's job takes only jobs that outrank it (R21). None: open to all."""
        closed = []
        if device.drain_for is not None and device.jobs and (waiting := self._queues.get(device.drain_for)):
            closed.append(ctx.tier(waiting))
        chats, others = self._chats_and_others(device)
        if chats and not self._steps.room_beside(device.loaded, device.name, chats, device.slots, len(others)):
            closed.append(Tier.FOREGROUND)
        return min(closed, default=None)

    def chat_step(self, device_name: str) -> dict | None:
        """R23 on a device now, for the record of a revoke it caused: its running chats, the
        step profile the policy reads and the bound a step beside them must keep (None while
        no chat runs there)."""
        device = self._pool.get(device_name)
        chats = sum(e.job.kind is Kind.CHAT for e in device.live())
        bound = self._steps.bound(device.loaded, device.name, chats) if chats else None
        if bound is None:
            return None
        return {"chats": chats, "bound_s": bound, "step_profile": self._steps.get(device.loaded, device.name)}

    def _chats_and_others(self, device: Device) -> tuple[int, list[Entry]]:
        """R23 on `device`: how many live chats it runs, and its live jobs that are not chats."""
        live = device.live()
        others = [e for e in live if e.job.kind is not Kind.CHAT]
        return len(live) - len(others), others

    def _plan_drain(self, ctx: PickContext, free: list[Device]) -> None:
        """R21: the job first in pick order that no free slot may take, when no device holds its
        model (a T0/T1 job, or a T2–T4 job past its affinity wait), drains the device it will
        take. A drain whose job left the queue ends."""
        for device in self._pool:
            if device.drain_for is not None and self._queues.get(device.drain_for) is None:
                device.drain_for = None
        waiting = ctx.first((Tier.CHAT, Tier.FOREGROUND))
        if waiting is None:
            waiting = ctx.first(ctx.fair_tiers(len(self._queues.pool) > 0))
            if waiting is None or not waited_past(waiting, ctx):
                return
        if slot_for(waiting, free, self._queues.count_on) is None:
            target = drain_target(ctx, waiting, list(self._pool))
            if target is not None:
                target.drain_for = waiting.job.id

    def _empty_for_urgent(self, ctx: PickContext) -> list[Action]:
        """R13, R22: a device draining for a T0/T1 job is emptied as soon as that job outranks
        every job left on it (a chat there that it could not revoke has ended), so that the
        urgent job waits for no background job to end."""
        actions: list[Action] = []
        for device in self._pool.busy():
            waiting = self._queues.get(device.drain_for) if device.drain_for else None
            if waiting is None or ctx.tier(waiting) > Tier.FOREGROUND:
                continue
            live = device.live()
            if live and all(ctx.tier(waiting) < ctx.tier(e) for e in live):
                for entry in live:
                    actions += self._revoke(entry, RevokeCause.ARRIVAL)
        return actions

    def _hold_chat_steps(self) -> list[Action]:
        """R23: beside a device's running chats keep only the k highest-ranked other jobs for
        which step(k + chats) <= max(slack x step(chats), floor); revoke the rest, lowest-ranked first
        (they are re-queued, keep their KV and take slots again when the chats end)."""
        actions: list[Action] = []
        for device in self._pool.busy():
            chats, others = self._chats_and_others(device)
            if not chats:
                continue
            keep = self._steps.companions(device.loaded, device.name, chats, device.slots, len(others))
            others.sort(key=lambda e: (self.tier(e.job), e.dispatch_no))
            for entry in reversed(others[keep:]):
                actions += self._revoke(entry, RevokeCause.STEP)
        return actions

    def _preempt(self, ctx: PickContext, event: RevokeCause, fresh: set[str]) -> list[Action]:
        """Revoke one running job per queued job that outranks one, lowest-ranked first (R18);
        an arrival revokes one at most. The jobs that devices already revoked will take are
        set aside first, so that one outranking job never revokes twice; a job dispatched in
        this very call is never revoked."""
        busy = self._pool.busy()
        if not any(e.job.id not in fresh for d in busy for e in d.live()):
            return []
        aside = []
        for device in busy:
            aside += self._taken_by_revoked(ctx, device)
        actions: list[Action] = []
        victims, limit = 0, 1 if event is RevokeCause.ARRIVAL else sum(len(d.live()) for d in busy)
        while victims < limit and (choice := victim(ctx, busy, fresh)) is not None:
            device, revoked, entry = choice
            for running in revoked:
                actions += self._revoke(running, event)
            if entry.job.model_id != device.loaded:  # emptied for it: no refill meanwhile (R21, R22)
                for other in self._pool:
                    if other.drain_for == entry.job.id:
                        other.drain_for = None   # it drained elsewhere: that device fills again
                device.drain_for = entry.job.id
            self._queues.remove(entry)
            aside.append(entry)
            victims += 1
        for entry in aside:
            self._queues.add(entry)
        return actions

    def _taken_by_revoked(self, ctx: PickContext, device: Device) -> list[Entry]:
        """The queued jobs that take the slots of `device`'s revoked jobs when they stop, taken
        out of the queues, so that one outranking job never revokes twice (R18, R22)."""
        revoked = sum(e.revoke_sent and not e.handed for e in device.jobs.values())
        view = Device(device.name, device.loaded, {e.job.id: e for e in device.live()}, device.slots)
        taken = []
        for _ in range(revoked):
            choice = place(ctx, [view], lambda d: None)
            if choice is None:
                break
            self._queues.remove(choice[0])
            view.jobs[choice[0].job.id] = choice[0]
            taken.append(choice[0])
        return taken

    def _dispatch(self, entry: Entry, device: Device, now: float) -> Dispatch:
        self._queues.remove(entry)
        entry.dispatched_at = now
        entry.dispatch_tier = self.tier(entry.job)
        swap = entry.job.model_id != device.loaded
        handed = self._pool.start(device, entry, self._dispatches)
        if handed is not None:
            self._close_run(device, handed, now)
        self._dispatches += 1
        return Dispatch(entry.job.id, entry.job.model_id, swap, entry.dispatch_tier, device.name, entry.slot)

    def _revoke(self, entry: Entry, cause: RevokeCause) -> list[Action]:
        if entry.revoke_sent:
            return []  # a running job gets at most one Revoke
        entry.revoke_sent = True
        return [Revoke(entry.job.id, cause)]

    def _describe_running(self, device: Device, entry: Entry, now: float) -> dict:
        return self._describe(entry, now) | {
            "tier": self.tier(entry.job).label,
            "held_s": now - entry.dispatched_at,
            "revoked": entry.revoke_sent,
            "device": device.name,
            "slot": entry.slot,
        }

    def _describe(self, entry: Entry, now: float) -> dict:
        job = entry.job
        return {
            "id": job.id, "order": entry.seq, "kind": job.kind.value, "producer": job.producer,
            "model": job.model_id,
            "deadline": job.deadline, "subject": job.subject, "foreground_hint": job.foreground_hint,
            "submitted": entry.submitted, "waited_s": now - entry.submitted,
        }
