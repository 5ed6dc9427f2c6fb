"""Test support for the policy: a brute-force reference picker (the rules read straight off
SPEC R2–R12, scanning everything) and a small virtual-clock driver.

The oracle works from `snapshot()` and the driver's own record of runs alone, so it shares
no code with the indexed picker it checks: it reads the T2 budget exactly (fractions) from
the runs, and the R4 event rule (which calls may revoke) from the call and the snapshots
before and after it.
"""
from __future__ import annotations

import heapq
import sys
from dataclasses import dataclass, field
from fractions import Fraction

from uniun_ray.policy import Dispatch, Job, PolicyConfig, Requeued, Revoke, RevokeCause, SchedulerPolicy

FAIR_TIERS = ("T2", "T3", "T4")


def job(id: str, kind: str, model: str = "m", **fields) -> Job:
    return Job(id, kind, model, **fields)


def _cfs_order(jobs: list[dict], vr: dict, running: list[dict] = (), last: dict | None = None,
               queued: list[dict] = ()) -> list[dict]:
    """T4 order: kind rank, kind's oldest job, producer rank, producer's oldest job. A rank is,
    on a pool, first how many of the flow's jobs run (R19, R24: fewer first, so that backlogged
    flows hold as many slots each), then the vruntime plus what those `running` jobs count
    for (unit weights): each the time it has held its device so far, and at least the
    flow's last run, its kind's for a producer without one (`last`: seconds per kind and per
    (kind, producer)). A flow's oldest job
    is its oldest queued one in any tier (`queued`; R9: a Gana whose deadline fell due, now
    in T3, is still the Gana flow's oldest job)."""
    inflight: dict = {}
    for r in running:
        for key in (r["kind"], (r["kind"], r["producer"])):
            held, count = inflight.get(key, (0.0, 0))
            floor = (last or {}).get(key, (last or {}).get(r["kind"], 0.0))  # a new producer: its kind's
            inflight[key] = (held + max(r["held_s"], floor), count + 1)

    def rank(v: float, key) -> tuple[int, float]:
        held, count = inflight.get(key, (0.0, 0))
        return (count, v + held) if count else (0, v)

    kind_oldest, prod_oldest = {}, {}
    for j in [*jobs, *queued]:
        kind_oldest[j["kind"]] = min(kind_oldest.get(j["kind"], j["order"]), j["order"])
        key = (j["kind"], j["producer"])
        prod_oldest[key] = min(prod_oldest.get(key, j["order"]), j["order"])

    def key(j):
        return (rank(vr["kinds"].get(j["kind"], 0.0), j["kind"]), kind_oldest[j["kind"]],
                rank(vr["producers"].get(j["kind"], {}).get(j["producer"], 0.0), (j["kind"], j["producer"])),
                prod_oldest[(j["kind"], j["producer"])], j["producer"], j["order"])
    return sorted(jobs, key=key)


def _ordered(tier: str, jobs: list[dict], vr: dict, running: list[dict] = (), last: dict | None = None,
             queued: list[dict] = ()) -> list[dict]:
    if tier == "T3":
        return sorted(jobs, key=lambda j: (j["deadline"], j["order"]))
    if tier == "T4":
        return _cfs_order(jobs, vr, running, last, queued)
    return sorted(jobs, key=lambda j: j["order"])


def _fair_ranked(tiers: dict[str, list[dict]], snap: dict, over_budget: bool, below: str = "T5",
                 running: list[dict] = (), last: dict | None = None) -> list[dict]:
    """T2–T4 jobs of tiers below `below` in pick order; T2 skipped over budget (R11) when
    T3/T4 work waits."""
    fair = [t for t in FAIR_TIERS if t < below]
    if over_budget and (tiers["T3"] or tiers["T4"]) and "T2" in fair:
        fair.remove("T2")
    queued = [j for jobs in tiers.values() for j in jobs]
    return [j for t in fair for j in _ordered(t, tiers[t], snap["vruntime"], running, last, queued)]


def expected_pick(tiers: dict[str, list[dict]], snap: dict, loaded: str | None, max_wait: float,
                  over_budget: bool) -> str | None:
    """The job R2–R12 say must run next on an idle device holding `loaded`."""
    for t in ("T0", "T1"):
        if tiers[t]:
            return _ordered(t, tiers[t], snap["vruntime"])[0]["id"]
    ranked = _fair_ranked(tiers, snap, over_budget)
    if not ranked:
        return None
    best = ranked[0]
    if loaded is None or best["model"] == loaded:
        return best["id"]
    same = [j for j in ranked if j["model"] == loaded]
    if same and snap["now"] - best["submitted"] <= max_wait:
        return same[0]["id"]
    return best["id"]


def affinity_wait_holding_back(tiers: dict[str, list[dict]], snap: dict, loaded: str | None,
                               over_budget: bool) -> dict | None:
    """The queued job that outranks the runner but waits out its affinity wait (R4, R12):
    the best outranking T2–T4 job, when it is on another model and no outranking job is on
    the loaded one."""
    runner = snap["running"]
    if runner is None or runner["revoked"] or runner["tier"] == "T0":
        return None
    ranked = _fair_ranked(tiers, snap, over_budget, below=runner["tier"])
    if not ranked or any(j["model"] == loaded for j in ranked):
        return None
    return ranked[0]


def t2_over_budget(runs: list["Run"], now: float, config: PolicyConfig) -> bool | None:
    """R11 read exactly (fractions) from the runs: whether T2 held more than its share of
    [now - window, now]. None where the share is within a nanosecond of the limit (either
    answer is right there), except that a share of 1 and a window without T2 time are
    never over."""
    lo, hi = Fraction(now) - Fraction(config.window_s), Fraction(now)
    t2 = held = Fraction(0)
    for r in runs:
        end = Fraction(now if r.end is None else r.end)
        if end <= lo:
            continue
        part = min(end, hi) - max(Fraction(r.start), lo)
        held += part
        t2 += part if r.tier == "T2" else 0
    if t2 == 0 or config.t2_share == 1.0:
        return False
    limit = Fraction(config.t2_share) * held
    if abs(t2 - limit) <= Fraction(len(runs) + 1, 10**9):
        return None
    return t2 > limit


def hoisted(j: dict, foreground: tuple[str | None, str | None]) -> bool:
    """R1's T1, read off a snapshot's job: the foreground subject's jobs, else the
    foreground kind's (extracts only with the hint); never a chat."""
    kind, subject = foreground
    if kind is None or j["kind"] == "chat":
        return False
    if subject is not None:
        return j["subject"] == subject
    return j["kind"] == kind and (kind != "extract" or j["foreground_hint"])


def calls_per_cycle(p: SchedulerPolicy, queued: int) -> int:
    """Python function calls made by one finish -> dispatch -> submit cycle of `p` (R15's
    structural check), once `queued` jobs wait and every device is busy."""
    for i in range(queued):
        kind = ("nataraj", "gana", "extract")[i % 3]
        p.submit(job(f"j{i}", kind, model=("m", "y")[i % 2], producer=f"{kind}:{i % 10}",
                     deadline=1e6 + i if i % 5 == 0 else None), 0)
    running = next(iter(p.running_jobs.values())).id
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"
    sys.setprofile(count)
    try:
        p.finish(running, 1, "done")
        p.submit(job("new", "gana", producer="gana:3"), 1)
    finally:
        sys.setprofile(None)
    return calls


@dataclass
class Run:
    job_id: str
    kind: str
    producer: str
    tier: str
    start: float
    end: float | None = None
    revoked: bool = False
    device: str = "dev0"


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
        self.events_checked = 0  # calls whose revokes the R4 oracle judged
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
            want = self._picks(snap, loaded_before)
            assert d.job_id in want, f"dispatched {d.job_id}, rules say {want} at t={self.now}"
        assert d.swap == (d.model_id != loaded_before)
        assert d.tier.label == snap["running"]["tier"]
        r = snap["running"]
        self.dispatch_log.append((self.now, d))
        self.runs.append(Run(d.job_id, r["kind"], r["producer"], r["tier"], self.now))
        self.running = (d.job_id, self.now + self.durations[d.job_id])

    def _budget_options(self, at: float) -> tuple[bool, ...]:
        over = t2_over_budget(self.runs, at, self.policy.config)
        return (True, False) if over is None else (over,)

    def _picks(self, snap: dict, loaded: str | None) -> set[str]:
        """What pick may choose, the running job counted as queued (both answers where the
        budget is too close to call)."""
        tiers = {t: list(v) for t, v in snap["tiers"].items()}
        tiers[snap["running"]["tier"]].append(snap["running"])
        wait = self.policy.config.max_affinity_wait_s
        return {expected_pick(tiers, snap, loaded, wait, over) for over in self._budget_options(snap["now"])}

    def _held_back(self, snap: dict, at: float) -> list[dict | None]:
        tiers = {t: list(v) for t, v in snap["tiers"].items()}
        if snap["running"] is not None:
            tiers[snap["running"]["tier"]].append(snap["running"])
        return [affinity_wait_holding_back(tiers, snap, snap["loaded_model"], over)
                for over in self._budget_options(at)]

    def _events(self, method: str, args: tuple, before: dict) -> set[RevokeCause] | None:
        """The R4 events this call brings (the causes a Revoke may give), or None where the
        budget is too close to call which job an ended affinity wait held back."""
        prev, now, wait = before["now"], self.now, self.policy.config.max_affinity_wait_s
        jobs = [j for tier in before["tiers"].values() for j in tier]
        causes = set()
        if method == "submit":
            causes.add(RevokeCause.ARRIVAL)
        if method == "set_foreground":
            old = (before["foreground"]["kind"], before["foreground"]["subject"])
            new = (args[0], args[2])
            if any(hoisted(j, old) != hoisted(j, new) for j in jobs + [before["running"]]):
                causes.add(RevokeCause.FOREGROUND)
        if any(j["deadline"] is not None and prev < j["deadline"] <= now for j in jobs):
            causes.add(RevokeCause.DEADLINE)
        ended = {h is not None and prev - h["submitted"] <= wait < now - h["submitted"]
                 for h in self._held_back(before, prev)}
        if len(ended) > 1:
            return None
        if ended.pop():
            causes.add(RevokeCause.AFFINITY)
        return causes

    def _check_revokes(self, method: str, args: tuple, before: dict, actions: list) -> None:
        """R4, clarified: a call revokes exactly when it brings an event and pick, with the
        running job counted as queued, would choose another job, of a lower tier number
        (a T2 runner over budget is not revoked for T3 work: the budget never revokes); a
        cancel of the running job revokes it with its own cause."""
        revokes = [a for a in actions if isinstance(a, Revoke)]
        runner = before["running"]
        if runner is not None and method == "cancel" and args[0] == runner["id"]:
            assert revokes == ([] if runner["revoked"] else [Revoke(runner["id"], RevokeCause.CANCEL)])
            return
        if runner is None or runner["revoked"] or runner["kind"] == "chat" or method == "finish":
            assert not revokes, f"{method} at t={self.now} revoked {revokes}"
            return
        causes = self._events(method, args, before)
        after = self.policy.snapshot()
        picks = self._picks(after, runner["model"])
        if causes is None or len(picks) > 1:
            return
        tier_of = {j["id"]: t for t, jobs in after["tiers"].items() for j in jobs}
        outranks = [tier_of[j] < after["running"]["tier"] for j in picks if j != runner["id"]]
        should = bool(causes) and any(outranks)
        assert bool(revokes) == should, f"{method} at t={self.now}: revokes {revokes}, events {causes}, picks {picks}"
        assert not revokes or revokes[0].cause in causes, (revokes, causes)
        self.events_checked += 1

    def _check_wakeup(self) -> None:
        """R5: the next wake-up is the earliest queued deadline not yet passed or the end of
        the affinity wait that holds an outranking job back, whichever comes first."""
        snap, wait = self.policy.snapshot(), self.policy.config.max_affinity_wait_s
        held = self._held_back(snap, self.now)
        if len({None if h is None else h["id"] for h in held}) > 1:
            return
        deadlines = [j["deadline"] for tier in snap["tiers"].values() for j in tier
                     if j["deadline"] is not None and j["deadline"] > self.now]
        got = self.policy.next_wakeup()
        wait_end = None if held[0] is None else held[0]["submitted"] + wait
        if wait_end is not None and self.now - held[0]["submitted"] > wait:
            wait_end = None  # over already, but the budget held it back: it goes at the next event
        if wait_end is not None and (not deadlines or wait_end < min(deadlines)):
            assert got is not None and abs(got - wait_end) < 1e-6 and got - held[0]["submitted"] > wait, (got, wait_end)
        else:
            assert got == min(deadlines, default=None), (got, deadlines, held)

    def call(self, method: str, *args) -> list:
        loaded = self.policy.loaded_model
        before = self.policy.snapshot() if self.check_oracle else None
        actions = getattr(self.policy, method)(*args)
        if self.check_oracle:
            self._check_revokes(method, args, before, actions)
        self._apply(actions, loaded)
        assert self.policy.queued == 0 or self.policy.running_job is not None, "device idle while work waits"
        if self.check_oracle:
            self._check_wakeup()
        if self.sample:
            self.waiting_samples.append((self.now, self.policy.snapshot()))
        return actions

    def _cancel(self, job_id: str) -> None:
        state = self.policy.job_state(job_id)
        if state is None:
            return
        self.call("cancel", job_id, self.now)
        if state == "queued":
            self.ended[job_id] = self.ended.get(job_id, 0) + 1

    def _finish_running(self) -> None:
        job_id, _ = self.running
        outcome = "revoked" if self.runs[-1].revoked else "done"
        self.runs[-1].end = self.now
        self.running = None
        if Requeued(job_id) not in self.call("finish", job_id, self.now, outcome):
            self.ended[job_id] = self.ended.get(job_id, 0) + 1

    def run(self, arrivals: list[Arrival], foreground: list[tuple[float, str | None, str | None]] = (),
            until: float = float("inf"), cancels: list[tuple[float, str]] = ()) -> None:
        """`cancels`: (time, job id); a cancel of a job not held at that time is skipped."""
        events: list = [(a.at, 1, i, "submit", a) for i, a in enumerate(arrivals)]
        events += [(at, 0, i, "fg", (kind, subject)) for i, (at, kind, subject) in enumerate(foreground)]
        events += [(at, 2, i, "cancel", job_id) for i, (at, job_id) in enumerate(cancels)]
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
                elif what == "cancel":
                    self._cancel(payload)
                else:
                    self.call("set_foreground", payload[0], self.now, payload[1])
            else:
                self.call("tick", self.now)
