"""Test support for the policy: a brute-force reference picker (the rules read straight off
SPEC R2–R12, scanning everything) and a small virtual-clock driver.

The oracle works from `snapshot()` alone, so it shares no code with the indexed picker it
checks.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from uniun_ray.policy import Dispatch, Job, Requeued, Revoke, SchedulerPolicy

FAIR_TIERS = ("T2", "T3", "T4")


def job(id: str, kind: str, model: str = "m", **fields) -> Job:
    return Job(id, kind, model, **fields)


def _cfs_order(jobs: list[dict], vr: dict) -> list[dict]:
    """T4 order: kind vruntime, kind's oldest job, producer vruntime, producer's oldest job."""
    kind_oldest, prod_oldest = {}, {}
    for j in jobs:
        kind_oldest[j["kind"]] = min(kind_oldest.get(j["kind"], j["order"]), j["order"])
        key = (j["kind"], j["producer"])
        prod_oldest[key] = min(prod_oldest.get(key, j["order"]), j["order"])

    def key(j):
        return (vr["kinds"].get(j["kind"], 0.0), kind_oldest[j["kind"]],
                vr["producers"].get(j["kind"], {}).get(j["producer"], 0.0),
                prod_oldest[(j["kind"], j["producer"])], j["producer"], j["order"])
    return sorted(jobs, key=key)


def _ordered(tier: str, jobs: list[dict], vr: dict) -> list[dict]:
    if tier == "T3":
        return sorted(jobs, key=lambda j: (j["deadline"], j["order"]))
    if tier == "T4":
        return _cfs_order(jobs, vr)
    return sorted(jobs, key=lambda j: j["order"])


def expected_pick(tiers: dict[str, list[dict]], snap: dict, loaded: str | None, max_wait: float) -> str | None:
    """The job R2–R12 say must run next on an idle device holding `loaded`."""
    for t in ("T0", "T1"):
        if tiers[t]:
            return _ordered(t, tiers[t], snap["vruntime"])[0]["id"]
    fair = list(FAIR_TIERS)
    if snap["t2"]["over_budget"] and (tiers["T3"] or tiers["T4"]):
        fair.remove("T2")
    ranked = [j for t in fair for j in _ordered(t, tiers[t], snap["vruntime"])]
    if not ranked:
        return None
    best = ranked[0]
    if loaded is None or best["model"] == loaded:
        return best["id"]
    same = [j for j in ranked if j["model"] == loaded]
    if same and snap["now"] - best["submitted"] <= max_wait:
        return same[0]["id"]
    return best["id"]


@dataclass
class Run:
    job_id: str
    kind: str
    producer: str
    tier: str
    start: float
    end: float | None = None
    revoked: bool = False


@dataclass(order=True)
class Arrival:
    at: float
    seq: int
    job: Job = field(compare=False)
    duration: float = field(compare=False, default=1.0)


class Driver:
    """Runs a policy on a virtual clock: jobs take their `duration` of device time (a
    revoked job stops after `revoke_delay` and, when re-queued, runs its full duration
    again), `tick` is called at `next_wakeup()`. Every Dispatch is checked against the
    oracle, and the driver records runs for the property tests."""

    def __init__(self, policy: SchedulerPolicy, revoke_delay: float = 0.05, check_oracle: bool = True,
                 sample: bool = False):
        self.sample = sample
        self.policy = policy
        self.revoke_delay = revoke_delay
        self.check_oracle = check_oracle
        self.now = 0.0
        self.durations: dict[str, float] = {}
        self.running: tuple[str, float] | None = None  # job id, time it ends
        self.runs: list[Run] = []
        self.dispatch_log: list[tuple[float, Dispatch]] = []
        self.revokes: list[tuple[float, str]] = []
        self.ended: dict[str, int] = {}
        self.waiting_samples: list[tuple[float, dict]] = []

    def _apply(self, actions: list, loaded_before: str | None) -> None:
        for action in actions:
            if isinstance(action, Dispatch):
                self._on_dispatch(action, loaded_before)
            elif isinstance(action, Revoke):
                assert self.running and self.running[0] == action.job_id, "Revoke names the running job"
                self.revokes.append((self.now, action.job_id))
                self.running = (action.job_id, min(self.running[1], self.now + self.revoke_delay))
                self.runs[-1].revoked = True

    def _on_dispatch(self, d: Dispatch, loaded_before: str | None) -> None:
        assert self.running is None, "a Dispatch while a job is unfinished"
        snap = self.policy.snapshot()
        if self.check_oracle:
            tiers = {t: list(v) for t, v in snap["tiers"].items()}
            r = snap["running"]
            tiers[r["tier"]].append(r)
            want = expected_pick(tiers, snap, loaded_before, self.policy.config.max_affinity_wait_s)
            assert d.job_id == want, f"dispatched {d.job_id}, rules say {want} at t={self.now}"
        assert d.swap == (d.model_id != loaded_before)
        r = snap["running"]
        self.dispatch_log.append((self.now, d))
        self.runs.append(Run(d.job_id, r["kind"], r["producer"], r["tier"], self.now))
        self.running = (d.job_id, self.now + self.durations[d.job_id])

    def call(self, method: str, *args) -> list:
        loaded = self.policy.loaded_model
        actions = getattr(self.policy, method)(*args)
        self._apply(actions, loaded)
        assert self.policy.queued == 0 or self.policy.running_job is not None, "device idle while work waits"
        if self.sample:
            self.waiting_samples.append((self.now, self.policy.snapshot()))
        return actions

    def _finish_running(self) -> None:
        job_id, _ = self.running
        outcome = "revoked" if self.runs[-1].revoked else "done"
        self.runs[-1].end = self.now
        self.running = None
        if Requeued(job_id) not in self.call("finish", job_id, self.now, outcome):
            self.ended[job_id] = self.ended.get(job_id, 0) + 1

    def run(self, arrivals: list[Arrival], foreground: list[tuple[float, str | None, str | None]] = (),
            until: float = float("inf")) -> None:
        events: list = [(a.at, 1, i, "submit", a) for i, a in enumerate(arrivals)]
        events += [(at, 0, i, "fg", (kind, subject)) for i, (at, kind, subject) in enumerate(foreground)]
        heapq.heapify(events)
        while True:
            candidates = []
            if events:
                candidates.append(events[0][0])
            if self.running:
                candidates.append(self.running[1])
            wake = self.policy.next_wakeup()
            if wake is not None:
                candidates.append(wake)
            if not candidates or min(candidates) > until:
                return
            self.now = max(self.now, min(candidates))
            if self.running and self.running[1] <= self.now:
                self._finish_running()
            elif events and events[0][0] <= self.now:
                _, _, _, what, payload = heapq.heappop(events)
                if what == "submit":
                    self.durations[payload.job.id] = payload.duration
                    self.call("submit", payload.job, self.now)
                else:
                    self.call("set_foreground", payload[0], self.now, payload[1])
            else:
                self.call("tick", self.now)
