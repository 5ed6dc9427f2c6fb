"""Choosing a job (R2, R3, R11, R12) and deciding whether it preempts (R4).

Two questions, two functions: `pick` answers "the device is free: what runs next?";
`preemptor` answers "something changed: does a queued job outrank the running one?" with
the same rules, the running job counted as a candidate. The T2 budget and the affinity
wait are pick-time rules: they are consulted, so an over-budget T2 or a job on another
model still inside its affinity wait never revokes (a revoke would only hand the device
straight back: thrash), but they are not events, so they never revoke on their own.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from .queues import Entry, Queues
from .tiers import Foreground, Tier

_FAIR_TIERS = (Tier.EXTRACT, Tier.DEADLINE, Tier.FAIR)


@dataclass
class PickContext:
    queues: Queues
    foreground: Foreground
    now: float
    loaded_model: str | None
    budget_check: Callable[[], bool]
    max_affinity_wait_s: float

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

    def fair_tiers(self, lower_work: bool) -> tuple[Tier, ...]:
        """R11: over budget, T2 is skipped only if T3/T4 work exists (work-conserving)."""
        if lower_work and self.queues.head(Tier.EXTRACT, self.foreground, self.now) and self.t2_over_budget:
            return _FAIR_TIERS[1:]
        return _FAIR_TIERS


def pick(ctx: PickContext) -> Entry | None:
    urgent = ctx.first((Tier.CHAT, Tier.FOREGROUND))
    if urgent is not None:
        return urgent  # T0/T1 swap at once (R12, R13)
    tiers = ctx.fair_tiers(lower_work=len(ctx.queues.pool) > 0)
    best = ctx.first(tiers)
    if best is None or ctx.loaded_model is None or best.job.model_id == ctx.loaded_model:
        return best
    # R12: fall through T2–T4 to the best job on the loaded model, unless the best job
    # has waited past the affinity bound; after a swap this favours the new model.
    same = ctx.first(tiers, ctx.loaded_model)
    if same is not None and ctx.now - best.submitted <= ctx.max_affinity_wait_s:
        return same
    return best


def preemptor(ctx: PickContext, running_tier: Tier) -> Entry | None:
    """The queued job that should revoke a running job of `running_tier`, if any: the job
    `pick` would choose, with the runner counted as a candidate, when it is of a lower tier.

    The runner is on the loaded model, so for T2–T4 it is always a same-model candidate: a
    job on another model preempts only once its affinity wait is over (at an event: this
    is never a timer of its own), and an over-budget T2 never does while the runner is
    T3/T4 work."""
    if running_tier is Tier.CHAT:
        return None  # chat only loses to itself (R4)
    urgent = ctx.first(t for t in (Tier.CHAT, Tier.FOREGROUND) if t < running_tier)
    if urgent is not None:
        return urgent
    lower_work = len(ctx.queues.pool) > 0 or running_tier >= Tier.DEADLINE
    tiers = [t for t in ctx.fair_tiers(lower_work) if t < running_tier]
    same = ctx.first(tiers, ctx.loaded_model)
    if same is not None:
        return same
    best = ctx.first(tiers)
    if best is not None and ctx.now - best.submitted > ctx.max_affinity_wait_s:
        return best
    return None
