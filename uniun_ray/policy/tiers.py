"""Tiers (R1): a pure function of the job, the foreground and the time.

A tier is never stored: the running job's tier too is recomputed whenever it matters,
so a foreground change or a deadline passing moves jobs without any bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass

from .types import Job, Kind, Tier

__all__ = ["Foreground", "Tier", "tier_of"]  # Tier is re-exported from .types


@dataclass(frozen=True, slots=True)
class Foreground:
    """What the user is looking at: a kind (the open page) and optionally a subject (the
    open note). With a subject, exactly the jobs about that subject are hoisted, whatever
    their kind; without one, the foreground kind's jobs are, and extract jobs only when
    they carry `foreground_hint` (a backfill must not ride on an opened note)."""

    kind: Kind | None = None
    subject: str | None = None

    def hoists(self, job: Job) -> bool:
        if self.kind is None or job.kind is Kind.CHAT:
            return False
        if self.subject is not None:
            return job.subject == self.subject
        if job.kind is not self.kind:
            return False
        return job.kind is not Kind.EXTRACT or job.foreground_hint


def tier_of(job: Job, foreground: Foreground, now: float) -> Tier:
    if job.kind is Kind.CHAT:
        return Tier.CHAT
    if foreground.hoists(job):
        return Tier.FOREGROUND
    if job.kind is Kind.EXTRACT:
        return Tier.EXTRACT
    if job.deadline is not None and now >= job.deadline:
        return Tier.DEADLINE
    return Tier.FAIR
