"""Test support for a pool of devices (SPEC §5): a scan-everything oracle of where each job
goes (R16, R17, with R2–R12 inside it) and a virtual-clock driver for N devices.

Like policy_support's, the oracle works from `snapshot()` and the driver's own runs, and
shares no code with the indexed placement it checks.
"""
from __future__ import annotations

import heapq
from policy_support import Arrival, Run, _fair_ranked, _ordered, t2_over_budget
from uniun_ray.policy import POOL_KINDS, Dispatch, PolicyConfig, Requeued, Revoke, SchedulerPolicy


def _swap_target(free: list[str], loaded: dict, queued: list[dict]) -> str:
    """R17: an empty device first, else the one whose model has the least queued work."""
    return min(free, key=lambda d: (loaded[d] is not None, sum(j["model"] == loaded[d] for j in queued)))


def expected_placement(queued: list[dict], running: list[dict], snap: dict, free: list[str], loaded: dict,
                       max_wait: float, over_budget: bool, last: dict | None = None) -> tuple[str, str] | None:
    """The (job, device) R16/R17 and R2–R12 give next, `free` in pool order; `running`: the
    jobs holding the other devices, `last`: each pool kind's and flow's last run (R19: the
    fair pool counts running jobs, each for at least its flow's last run)."""
    tiers = {t: [j for j in queued if j["tier"] == t] for t in ("T0", "T1", "T2", "T3", "T4")}
    for t in ("T0", "T1"):
        if tiers[t]:
            job = _ordered(t, tiers[t], snap["vruntime"])[0]
            holders = [d for d in free if loaded[d] == job["model"]]
            return job["id"], holders[0] if holders else _swap_target(free, loaded, queued)
    ranked = _fair_ranked(tiers, snap, over_budget, running=running, last=last)
    if not ranked:
        return None
    best = ranked[0]
    holders = [d for d in free if loaded[d] == best["model"]]
    if holders:
        return best["id"], holders[0]
    if snap["now"] - best["submitted"] > max_wait or any(loaded[d] is None for d in free):
        return best["id"], _swap_target(free, loaded, queued)
    for d in free:
        same = [j for j in ranked if j["model"] == loaded[d]]
        if same:
            return same[0]["id"], d
    return best["id"], _swap_target(free, loaded, queued)


class PoolDriver:
    """Runs a pool policy on a virtual clock (jobs take their `duration`; a revoked job stops
    after `revoke_delay` and runs its full duration again when re-queued; `tick` at
    `next_wakeup()`), checking after every call that no device idles while a job waits,
    that every Dispatch is the oracle's placement, and that a pure arrival revokes at most
    one job, the lowest-ranked, exactly one where a chat finds every device busy."""

    def __init__(self, config: PolicyConfig, devices: int, revoke_delay: float = 0.05):
        self.names = tuple(f"d{i}" for i in range(devices))
        self.policy = SchedulerPolicy(config, devices=self.names)
        self.revoke_delay = revoke_delay
        self.now = 0.0
        self.durations: dict[str, float] = {}
        self.on: dict[str, tuple[Run, float]] = {}  # device -> its run, when it ends
        self.loaded: dict[str, str | None] = dict.fromkeys(self.names)
        self.runs: list[Run] = []
        self.ended: dict[str, int] = {}
        self.samples: list[tuple[float, dict]] = []
        self.last_run: dict = {}   # seconds of each pool kind's and flow's last run, ended or revoked

    # -- checks --------------------------------------------------------------------------
    def _check_placements(self, dispatches: list[Dispatch]) -> None:
        snap = self.policy.snapshot()
        dispatched = {d.job_id for d in dispatches}
        running = {r["running"]["id"]: r["running"] for r in snap["devices"] if r["running"]}
        queued = [j | {"tier": t} for t, jobs in snap["tiers"].items() for j in jobs]
        queued += [running[i] for i in dispatched]
        held = [j for i, j in running.items() if i not in dispatched]
        free = [d for d in self.names if d not in self.on]  # `on`: as before this call
        loaded = dict(self.loaded)
        wait = self.policy.config.max_affinity_wait_s
        over = t2_over_budget(self.runs, self.now, self.policy.config)
        for d in dispatches:
            want = {expected_placement(queued, held, snap, free, loaded, wait, o, self.last_run)
                    for o in ((True, False) if over is None else (over,))}
            assert (d.job_id, d.device) in want, f"t={self.now}: {d.job_id} on {d.device}, rules say {want}"
            assert d.swap == (loaded[d.device] != d.model_id)
            held.append(running[d.job_id])
            queued = [j for j in queued if j["id"] != d.job_id]
            free.remove(d.device)
            loaded[d.device] = d.model_id

    def _check_arrival(self, before: dict, before_jobs: dict, revokes: list[Revoke], arriving: dict, wake: float | None) -> None:
        if wake is not None and wake <= self.now:
            return  # a deadline or an affinity wait ended too: not a pure arrival
        # tiers at the arrival's time: `before` was described at the policy's previous call,
        # and a deadline that passed since then has moved its job up (R5)
        jobs = {job.id: job for job in before_jobs.values()}
        runners = [r["running"] | {"tier": self.policy.tier(jobs[r["running"]["id"]]).label}
                   for r in before["devices"] if r["running"]]
        revocable = [r for r in runners if not r["revoked"] and r["kind"] != "chat"]
        assert len(revokes) <= 1, f"t={self.now}: one arrival revoked {revokes}"
        # every device busy and none making way already: the arriving job needs a revoke
        all_busy = len(runners) == len(self.names) and not any(r["revoked"] for r in runners)
        if revokes and all_busy and arriving["tier"] in ("T0", "T1"):  # no affinity wait: the lowest-ranked goes
            victim = next(r for r in revocable if r["id"] == revokes[0].job_id)
            assert victim["tier"] == max(r["tier"] for r in revocable), (victim, revocable)
        if arriving["kind"] == "chat" and all_busy and revocable:
            assert len(revokes) == 1, f"t={self.now}: a chat found every device busy, revoked {revokes}"

    # -- driving -------------------------------------------------------------------------
    def call(self, method: str, *args) -> list:
        """Call the policy, check what it did, and apply its actions."""
        before, before_jobs, wake = self.policy.snapshot(), self.policy.running_jobs, self.policy.next_wakeup()
        actions = getattr(self.policy, method)(*args)
        revokes = [a for a in actions if isinstance(a, Revoke)]
        dispatches = [a for a in actions if isinstance(a, Dispatch)]
        if method == "submit":
            self._check_arrival(before, before_jobs, revokes, {"kind": args[0].kind.value,
                                                  "tier": self.policy.tier(args[0]).label}, wake)
        if method == "finish":
            assert not revokes, "a finish never revokes"
        self._check_placements(dispatches)
        for r in revokes:
            device = self.policy.device_of(r.job_id)
            run, end = self.on[device]
            run.revoked = True
            self.on[device] = (run, min(end, self.now + self.revoke_delay))
        for d in dispatches:
            running = next(r["running"] for r in self.policy.snapshot()["devices"] if r["device"] == d.device)
            run = Run(d.job_id, running["kind"], running["producer"], d.tier.label, self.now, device=d.device)
            self.runs.append(run)
            self.on[d.device] = (run, self.now + self.durations[d.job_id])
            self.loaded[d.device] = d.model_id
        assert self.policy.queued == 0 or len(self.policy.running_jobs) == len(self.names), \
            f"t={self.now}: a device idles while work waits"
        self.samples.append((self.now, self.policy.snapshot()))
        return actions

    def _finish(self, device: str) -> None:
        run, _ = self.on.pop(device)
        run.end = self.now
        if run.kind in POOL_KINDS:
            self.last_run[run.kind] = self.last_run[(run.kind, run.producer)] = run.end - run.start
        outcome = "revoked" if run.revoked else "done"
        if Requeued(run.job_id) not in self.call("finish", run.job_id, self.now, outcome):
            self.ended[run.job_id] = self.ended.get(run.job_id, 0) + 1

    def run(self, arrivals: list[Arrival], foreground: list[tuple[float, str | None, str | None]] = ()) -> None:
        events: list = [(a.at, 1, a.seq, "submit", a) for a in arrivals]
        events += [(at, 0, i, "fg", (kind, subject)) for i, (at, kind, subject) in enumerate(foreground)]
        heapq.heapify(events)
        while True:
            ends = sorted((end, device) for device, (_, end) in self.on.items())
            candidates = [t for t in (events[0][0] if events else None, ends[0][0] if ends else None,
                                      self.policy.next_wakeup()) if t is not None]
            if not candidates:
                return
            self.now = max(self.now, min(candidates))
            if ends and ends[0][0] <= self.now:
                self._finish(ends[0][1])
            elif events and events[0][0] <= self.now:
                _, _, _, what, payload = heapq.heappop(events)
                if what == "submit":
                    self.durations[payload.job.id] = payload.duration
                    self.call("submit", payload.job, self.now)
                else:
                    self.call("set_foreground", payload[0], self.now, payload[1])
            else:
                self.call("tick", self.now)
