"""Choosing a job (R2, R3, R11, R12, R16, R17) and deciding whether it preempts (R4, R18).

`place` answers "devices are free: what runs next, and where?"; `preemptor` answers "an
event happened: does a queued job outrank the job running on this device?" with the same
rules, the running job counted as a candidate; `victim` chooses, across the pool, the one
running job to revoke; `affinity_wakeup` answers "when does the affinity wait that holds
such a job back end?". With one device these are exactly the single-device rules: a
device is a model (its `loaded`) and the pool's ties never arise. The T2 budget and the affinity
wait are pick-time rules: they are consulted, so an over-budget T2 or a job on another
model still inside its affinity wait never revokes (a revoke would only hand the device
straight back: thrash). The budget is never an event; the end of an outranking job's
affinity wait is one (R4, clarified), so that whether it revokes does not depend on an
unrelated call happening to come along.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from .pool import Device, slot_for, swap_target
from .queues import Entry, Queues
from .tiers import Foreground, Tier

_FAIR_TIERS = (Tier.EXTRACT, Tier.DEADLINE, Tier.FAIR)


@dataclass
class PickContext:
    queues: Queues
    foreground: Foreground
    now: float
    budget_check: Callable[[], bool]
    wait_bound: Callable[[Entry], float]   # R12: a job's affinity wait, by the cost of its swap
    tier: Callable[[Entry], Tier]

    @cached_property
    def t2_over_budget(self) -> bool:
        """Asked only when T2 has a candidate and lower tiers have work."""
        return self.budget_check()

    def first(self, tiers, model: str | None = None) -> Entry | None:
        for tier in tiers:
            entry = self.queues.head(tier, self.foreground, self.now, model)
            if entry is not None:
                return entry
        return None

    def fair_tiers(self, lower_work: bool, below: Tier | None = None) -> tuple[Tier, ...]:
        """T2–T4 (those numbered below `below`, when given). R11: over budget, T2 is skipped
        only if T3/T4 work exists (work-conserving)."""
        tiers = _FAIR_TIERS if below is None else tuple(t for t in _FAIR_TIERS if t < below)
        if (tiers[:1] == (Tier.EXTRACT,) and lower_work
                and self.queues.head(Tier.EXTRACT, self.foreground, self.now) and self.t2_over_budget):
            return tiers[1:]
        return tiers


def affinity_end(submitted: float, max_wait_s: float) -> float:
    """The first instant at which a job submitted at `submitted` has waited longer than
    `max_wait_s` (R12), with the comparison `waited_past` makes, float for float: the
    runtime's tick at this time finds the wait over, not a hair short of it."""
    end = submitted + max_wait_s
    while end - submitted <= max_wait_s:
        end = math.nextafter(end, math.inf)
    while (earlier := math.nextafter(end, -math.inf)) - submitted > max_wait_s:
        end = earlier
    return end


def affinity_bound(max_wait_s: float, full_swap_s: float, swap_s: float | None) -> float:
    """R12's bound on a job's affinity wait for a swap of `swap_s` seconds: `max_wait_s` for a
    swap costing `full_swap_s` or more, or of unknown cost; proportionally less for a cheaper
    one. Waiting w for a swap of cost c buys batching at the price of w; with w proportional
    to c, the device spends at most `full_swap_s` / `max_wait_s` of its time swapping even
    when every job alternates models, whatever the swaps cost (1/6 with the defaults)."""
    if swap_s is None:
        return max_wait_s
    return max_wait_s * min(1.0, swap_s / full_swap_s)


def waited_past(entry: Entry, ctx: PickContext) -> bool:
    return ctx.now - entry.submitted > ctx.wait_bound(entry)


def place(ctx: PickContext, free: list[Device], ceiling: Callable[[Device], Tier | None]) -> tuple[Entry, Device] | None:
    """The next job and the device with a free slot it runs on (R16, R21: while a job waits
    that a free slot may take, the slot gets one), or None. Called once per slot, in a loop.

    A device with jobs takes only jobs on its model; an empty one may swap (R21). `ceiling`
    closes a device's free slots to jobs of its tier and above: beside a chat whose step is
    at its bound, to all but chats (R23); on a device draining for another model's job, to
    all that do not outrank that job (R21)."""
    urgent = ctx.first((Tier.CHAT, Tier.FOREGROUND))
    if urgent is not None:
        room = [d for d in free if _admits(ctx, ceiling(d), urgent)]
        device = slot_for(urgent, room, ctx.queues.count_on)  # T0/T1 swap at once (R12, R13)
        if device is not None:
            return urgent, device
        # it waits for a slot or a device emptied for it (R22); other slots take their model's work
        tiers = ctx.fair_tiers(len(ctx.queues.pool) > 0)
        return (_same_model(ctx, free, ceiling, (Tier.CHAT, Tier.FOREGROUND, *tiers))
                or _conserving_t2(ctx, free, ceiling, tiers))
    tiers = ctx.fair_tiers(lower_work=len(ctx.queues.pool) > 0)
    best = ctx.first(tiers)
    if best is None:
        return None
    room = [d for d in free if _admits(ctx, ceiling(d), best)]
    holder = next((d for d in room if d.loaded == best.job.model_id), None)
    if holder is not None:
        return best, holder
    empty = [d for d in room if not d.jobs]
    if empty and (waited_past(best, ctx) or any(d.loaded is None for d in empty)):
        return best, swap_target(empty, ctx.queues.count_on)
    # R12: each free device falls through T2–T4 to the best job on its model while the
    # best job is inside its affinity wait; after a swap this favours the new model.
    same = _same_model(ctx, free, ceiling, tiers)
    if same is not None:
        return same
    if empty:
        return best, swap_target(empty, ctx.queues.count_on)
    return _conserving_t2(ctx, free, ceiling, tiers)


def _conserving_t2(ctx: PickContext, free: list[Device], ceiling: Callable[[Device], Tier | None],
                   tiers: tuple[Tier, ...]) -> tuple[Entry, Device] | None:
    """R11 is work-conserving per slot: an over-budget T2 job (`tiers` skip T2) takes a free
    slot that no T3/T4 job may take (theirs are on other models and the device is not empty)."""
    undrained = [d for d in free if d.drain_for is None]
    return _same_model(ctx, undrained, ceiling, (Tier.EXTRACT,)) if Tier.EXTRACT not in tiers else None


def _admits(ctx: PickContext, ceiling: Tier | None, entry: Entry) -> bool:
    return ceiling is None or ctx.tier(entry) < ceiling


def _same_model(ctx: PickContext, free: list[Device], ceiling: Callable[[Device], Tier | None],
                tiers: tuple[Tier, ...]) -> tuple[Entry, Device] | None:
    """The first free device, in pool order, with a job on its own model it admits, and that job."""
    for device in free:
        if device.loaded is None:
            continue
        below = ceiling(device)
        same = ctx.first((t for t in tiers if below is None or t < below), device.loaded)
        if same is not None:
            return same, device
    return None


def drain_target(ctx: PickContext, entry: Entry, devices: list[Device]) -> Device | None:
    """R21: the device a waiting job that no slot may take will have once it is empty, when no
    device holds its model (else it waits for a slot there): none if one already drains for
    it, else the device whose jobs rank lowest (`device_rank`: a device running a chat
    last). Draining closes its slots to the jobs that do not outrank this one (`place`)."""
    if any(d.loaded == entry.job.model_id or d.drain_for == entry.job.id for d in devices):
        return None
    open_ = [d for d in devices if d.jobs and d.drain_for is None]
    return max(open_, key=lambda d: device_rank(ctx, list(d.jobs.values())), default=None)


def device_rank(ctx: PickContext, jobs: list[Entry]) -> tuple:
    """How low a device's jobs rank together, for emptying it (larger: lower): its best job's
    tier, then fewer jobs, then the most recently dispatched (R18's order for one job)."""
    return (min(ctx.tier(e) for e in jobs), -len(jobs), max(e.dispatch_no for e in jobs))


def _outranking_fair_tiers(ctx: PickContext, running_tier: Tier) -> list[Tier]:
    lower_work = len(ctx.queues.pool) > 0 or running_tier >= Tier.DEADLINE
    return ctx.fair_tiers(lower_work, below=running_tier)


def preemptor(ctx: PickContext, loaded: str | None, running_tier: Tier) -> Entry | None:
    """The queued job that should revoke a running job of `running_tier` on a device holding
    `loaded`, if any: the job `place` would choose for that device, with the runner counted
    as a candidate, when it is of a lower tier.

    The runner is on the loaded model, so for T2–T4 it is always a same-model candidate: a
    job on another model preempts only once its affinity wait is over (the end of that
    wait is an event: `affinity_wakeup`), and an over-budget T2 never does while the
    runner is T3/T4 work."""
    if running_tier is Tier.CHAT:
        return None  # chat only loses to itself (R4)
    urgent = ctx.first(t for t in (Tier.CHAT, Tier.FOREGROUND) if t < running_tier)
    if urgent is not None:
        return urgent
    tiers = _outranking_fair_tiers(ctx, running_tier)
    same = ctx.first(tiers, loaded)
    if same is not None:
        return same
    best = ctx.first(tiers)
    if best is not None and waited_past(best, ctx):
        return best
    return None


def victim(ctx: PickContext, busy: list[Device], spare: set[str]) -> tuple[Device, list[Entry], Entry] | None:
    """R18, R22: at an event with no slot free for it, the running jobs to revoke and the queued
    job they make way for. Per device, the queued job `place` would give the slot of its
    lowest-ranked live job (R18's order: highest tier, then most recently dispatched): on the
    device's model it takes that one slot (one revoke); on another model it needs the device
    empty, so it revokes every live job there, and only where it outranks them all (R13,
    R22). Across devices, the lowest-ranked choice: highest tier, ties the one holding the
    arriving job's model (no swap), then fewest jobs lost, then most recently dispatched. With
    one slot per device this is R18 exactly. Revoked jobs already make way, the jobs in
    `spare` (just dispatched) are never revoked, and chat never is."""
    chosen = None
    for device in busy:
        live = device.live()
        if not live or any(e.job.id in spare for e in live):
            continue
        worst = max(live, key=lambda e: (ctx.tier(e), e.dispatch_no))
        entry = preemptor(ctx, device.loaded, ctx.tier(worst))
        if entry is None:
            continue
        if entry.job.model_id == device.loaded:
            key, revoked = (ctx.tier(worst), True, -1, worst.dispatch_no), [worst]
        elif all(ctx.tier(entry) < ctx.tier(e) for e in live):
            best_tier, fewer, latest = device_rank(ctx, live)
            key, revoked = (best_tier, False, fewer, latest), live
        else:
            continue
        chosen = (key, device, revoked, entry) if chosen is None or key > chosen[0] else chosen
    return chosen[1:] if chosen else None


def affinity_wakeup(ctx: PickContext, loaded: str | None, running_tier: Tier) -> float | None:
    """When the affinity wait of the job that would preempt a runner of `running_tier`
    ends (R4, R5), or None when no outranking job on another model is inside its wait.

    Only the best outranking job's wait matters: `preemptor` looks at no other job on
    another model, so the end of any other job's wait would be an event that changes
    nothing."""
    if running_tier is Tier.CHAT:
        return None
    tiers = _outranking_fair_tiers(ctx, running_tier)
    best = ctx.first(tiers)
    if best is None or best.job.model_id == loaded or ctx.first(tiers, loaded):
        return None
    end = affinity_end(best.submitted, ctx.wait_bound(best))
    return end if end > ctx.now else None
