"""Vruntime accounting for the fair pool (R7–R10), in two levels: kinds, then producers
within a kind. Only the pool kinds (nataraj, gana) carry vruntime.

A flow is *present* while it has queued or running work. The ledger is told when a job
joins a flow (`arrive`) and when it leaves for good (`depart`), so presence, seeding and
absence are derived from those two events alone.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from .types import POOL_KINDS, Kind, PolicyConfig

#: A producer-level flow: producers are fair-shared only against producers of their kind.
ProducerFlow = tuple[Kind, str]


@dataclass
class _Level:
    """One level of the hierarchy: vruntimes, presence counts and when each flow went idle."""

    vruntime: dict
    load: Counter
    idle_since: dict

    @classmethod
    def empty(cls) -> "_Level":
        return cls({}, Counter(), {})

    def arrive(self, flow, is_peer: Callable[[object], bool], now: float, absence_s: float) -> None:
        """R9: a newcomer, or a flow back after more than `absence_s` idle, starts at the
        minimum vruntime of its present peers (0 if none) so it can neither monopolise the
        pool on return nor be punished for old history. Only a flow that was absent pays
        for the scan of the (few) present flows."""
        if self.load[flow] == 0:
            returning = flow in self.vruntime and now - self.idle_since[flow] <= absence_s
            if not returning:
                present = [self.vruntime[p] for p in self.load if is_peer(p)]
                self.vruntime[flow] = min(present, default=0.0)
        self.load[flow] += 1

    def depart(self, flow, now: float) -> None:
        self.load[flow] -= 1
        if self.load[flow] == 0:
            del self.load[flow]
            self.idle_since[flow] = now


class VruntimeLedger:
    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._kinds = _Level.empty()
        self._producers = _Level.empty()
        self._epoch: float | None = None
        self._halvings = 0

    # -- reading -------------------------------------------------------------------------
    def kind_vruntime(self, kind: Kind) -> float:
        return self._kinds.vruntime.get(kind, 0.0)

    def producer_vruntime(self, flow: ProducerFlow) -> float:
        return self._producers.vruntime.get(flow, 0.0)

    def weight(self, name: str) -> float:
        """A kind's value or a producer id's weight: held time is divided by it (R8)."""
        return self._config.weight(name)

    def snapshot(self) -> dict:
        producers: dict[str, dict[str, float]] = {}
        for (kind, producer), value in sorted(self._producers.vruntime.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
            producers.setdefault(kind.value, {})[producer] = value
        return {
            "kinds": {k.value: v for k, v in sorted(self._kinds.vruntime.items(), key=lambda kv: kv[0].value)},
            "producers": producers,
        }

    # -- events --------------------------------------------------------------------------
    def arrive(self, flow: ProducerFlow, now: float) -> None:
        kind = flow[0]
        if kind not in POOL_KINDS:
            return
        absence = self._config.absence_s
        self._kinds.arrive(kind, lambda k: True, now, absence)
        self._producers.arrive(flow, lambda p: p[0] is kind, now, absence)

    def depart(self, flow: ProducerFlow, now: float) -> None:
        if flow[0] not in POOL_KINDS:
            return
        self._kinds.depart(flow[0], now)
        self._producers.depart(flow, now)

    def charge(self, flow: ProducerFlow, held_s: float) -> None:
        """R7: every run, finished or revoked, pays for its held time, divided by weight."""
        kind, producer = flow
        if kind not in POOL_KINDS:
            return
        self._kinds.vruntime[kind] = self.kind_vruntime(kind) + held_s / self.weight(kind.value)
        self._producers.vruntime[flow] = self.producer_vruntime(flow) + held_s / self.weight(producer)

    def decay(self, now: float) -> bool:
        """R10: halve every vruntime once per `decay_period_s` since the first call, applying
        the halvings missed while dormant all at once. Returns whether anything changed."""
        if self._epoch is None:
            self._epoch = now
        due = math.floor((now - self._epoch) / self._config.decay_period_s)
        missed = due - self._halvings
        if missed <= 0:
            return False
        self._halvings = due
        factor = 0.5 ** missed
        for level in (self._kinds, self._producers):
            for flow in level.vruntime:
                level.vruntime[flow] *= factor
        return True
