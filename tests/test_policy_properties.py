"""Hypothesis properties of the policy over random workloads on a virtual clock.

The driver (policy_support.Driver) already asserts, after every call, that the device is
never idle while a job waits, that the call revoked exactly when the R4 event rule says
(an event happened and pick, the runner counted as queued, would choose another job),
that `next_wakeup` is R5's, and at every Dispatch that the job is the one R2–R12 choose
(the scan-everything oracle, which reads the T2 budget exactly from the runs). Times are
drawn on a coarse grid too, so that runs meet exactly at window edges and float sums that
drift would tip the budget (issue 10). The tests below add the budget, bounded-wait and
fairness properties.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy_support import Arrival, Driver, job
from uniun_ray.policy import PolicyConfig, SchedulerPolicy

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KINDS = ("chat", "nataraj", "gana", "extract")


def times(lo: float, hi: float):
    """Any float, or one on a 10 ms grid (clocks that hit exact boundaries)."""
    return st.one_of(st.floats(lo, hi, allow_nan=False),
                     st.integers(round(lo * 100), round(hi * 100)).map(lambda c: c / 100))


@st.composite
def workloads(draw, kinds=KINDS, models=("m", "y"), max_jobs=40, horizon=900.0):
    n = draw(st.integers(1, max_jobs))
    arrivals = []
    for i in range(n):
        kind = draw(st.sampled_from(kinds))
        at = draw(times(0, horizon))
        deadline = None
        if kind in ("nataraj", "gana") and draw(st.booleans()):
            deadline = at + draw(times(-30, 300))
        arrivals.append(Arrival(at, i, job(
            f"j{i}", kind, model=draw(st.sampled_from(models)),
            producer=f"{kind}:{draw(st.integers(0, 2))}", deadline=deadline,
            foreground_hint=kind == "extract" and draw(st.booleans()),
            subject=draw(st.sampled_from([None, "s1", "s2"]))),
            duration=draw(times(0.05, 60))))
    foreground = [(draw(st.floats(0, horizon, allow_nan=False)),
                   kind := draw(st.sampled_from([None, "nataraj", "gana", "extract", "chat"])),
                   draw(st.sampled_from([None, "s1"])) if kind else None)
                  for _ in range(draw(st.integers(0, 6)))]
    return arrivals, foreground


def configs():
    return st.builds(PolicyConfig, window_s=st.sampled_from([60.0, 300.0]),
                     t2_share=st.sampled_from([0.0, 0.6, 1.0]),
                     max_affinity_wait_s=st.sampled_from([0.0, 5.0, 20.0, 60.0]),
                     decay_period_s=st.sampled_from([100.0, 300.0]),
                     absence_s=st.sampled_from([30.0, 300.0]),
                     chat_step_floor_s=st.sampled_from([0.0, 0.015, 0.075]))


@PROPS
@given(workloads(), configs(), st.lists(st.tuples(times(0, 900.0), st.integers(0, 39)), max_size=5))
def test_prop_never_idle_revokes_only_at_events_and_every_dispatch_is_the_rules_choice(workload, config, cancels):
    arrivals, foreground = workload
    d = Driver(SchedulerPolicy(config))
    d.run(arrivals, foreground, cancels=[(at, f"j{i}") for at, i in cancels])
    # every job ended exactly once (none lost, none duplicated); revokes only of runners
    assert sorted(d.ended) == sorted(a.job.id for a in arrivals)
    assert set(d.ended.values()) == {1}
    p = d.policy
    assert p.queued == 0 and p.running_job is None and p.next_wakeup() is None


def held_in(runs, lo, hi, now, only_t2):
    total = 0.0
    for r in runs:
        if only_t2 and r.tier != "T2":
            continue
        end = r.end if r.end is not None else now
        total += max(0.0, min(end, hi) - max(r.start, lo))
    return total


@PROPS
@given(workloads(kinds=("extract", "extract", "nataraj", "gana", "chat"), max_jobs=60), configs())
def test_prop_t2_holds_at_most_its_share_plus_one_job_where_lower_tiers_waited(workload, config):
    arrivals, foreground = workload
    d = Driver(SchedulerPolicy(config), check_oracle=False, sample=True)
    d.run(arrivals, foreground)
    check_t2_share(d.runs, d.waiting_samples, config, jobs_over=1)


def lower_tier_eligible(snapshot: dict, config: PolicyConfig) -> bool:
    """R11 skips T2 only for *eligible* lower-tier work: a T3/T4 job a device may take without
    breaking R12: on a loaded model, with a device empty, or past its affinity wait."""
    loaded = {d["loaded_model"] for d in snapshot["devices"]}
    empty = any(not d["jobs"] for d in snapshot["devices"])
    return any(empty or j["model"] in loaded or j["waited_s"] > config.max_affinity_wait_s
               for tier in ("T3", "T4") for j in snapshot["tiers"][tier])


def check_t2_share(runs, samples: list[tuple[float, dict]], config: PolicyConfig, jobs_over: int) -> None:
    """R11 (R19 on a pool): wherever eligible T3/T4 work waited throughout [t - window, t], T2
    held at most its share of the held (device-)seconds there, plus `jobs_over` of its longest
    runs (the runs under way when the budget ran out: one per device)."""
    t2_runs = [r for r in runs if r.tier == "T2"]
    if not t2_runs:
        return
    longest = max(r.end - r.start for r in t2_runs)
    lower_waited = [(t, lower_tier_eligible(s, config)) for t, s in samples]
    for i, (t, _) in enumerate(lower_waited):
        lo = t - config.window_s
        # the state between events is the state after the last event: T3/T4 waited
        # throughout [lo, t] if they waited after every event from the one before lo on
        start = max((j for j, (u, _) in enumerate(lower_waited) if u <= lo), default=None)
        if start is None or not all(waited for _, waited in lower_waited[start:i]):
            continue
        t2 = held_in(runs, lo, t, t, only_t2=True)
        held = held_in(runs, lo, t, t, only_t2=False)
        assert t2 <= config.t2_share * held + jobs_over * longest + 1e-6, (t, t2, held, longest)


@PROPS
@given(st.lists(st.tuples(st.sampled_from(["nataraj", "gana"]), st.integers(0, 3),
                          st.floats(0.1, 20, allow_nan=False)), min_size=2, max_size=60))
def test_prop_every_backlogged_t4_flow_is_served_within_a_bound(jobs):
    arrivals = [Arrival(0.0, i, job(f"j{i}", kind, producer=f"{kind}:{p}"), dur)
                for i, (kind, p, dur) in enumerate(jobs)]
    d = Driver(SchedulerPolicy())
    d.run(arrivals)
    flows = {(a.job.kind.value, a.job.producer) for a in arrivals}
    longest = max(a.duration for a in arrivals)
    bound = 4 * (len(flows) + 1) * longest
    remaining = {f: sum(1 for a in arrivals if (a.job.kind.value, a.job.producer) == f) for f in flows}
    last_served = dict.fromkeys(flows, 0.0)
    for r in d.runs:
        for f in flows:  # every flow still backlogged at this start waited at most `bound`
            if remaining[f] and f != (r.kind, r.producer):
                assert r.start - last_served[f] <= bound, (f, r.start, last_served[f], bound)
        f = (r.kind, r.producer)
        last_served[f] = r.end
        remaining[f] -= 1


@PROPS
@given(st.lists(st.floats(0.1, 30, allow_nan=False), min_size=2, max_size=40),
       st.lists(st.floats(0.1, 30, allow_nan=False), min_size=2, max_size=40))
def test_prop_two_backlogged_equal_flows_differ_by_at_most_two_largest_jobs(a_jobs, b_jobs):
    arrivals = [Arrival(0.0, i, job(f"a{i}", "gana", producer="gana:A"), d) for i, d in enumerate(a_jobs)]
    arrivals += [Arrival(0.0, 100 + i, job(f"b{i}", "gana", producer="gana:B"), d) for i, d in enumerate(b_jobs)]
    d = Driver(SchedulerPolicy(PolicyConfig(decay_period_s=1e9)))
    d.run(arrivals)
    largest = max(a_jobs + b_jobs)
    service = {"gana:A": 0.0, "gana:B": 0.0}
    left = {"gana:A": len(a_jobs), "gana:B": len(b_jobs)}
    for r in d.runs:
        service[r.producer] += r.end - r.start
        left[r.producer] -= 1
        if left["gana:A"] and left["gana:B"]:  # both still backlogged
            assert abs(service["gana:A"] - service["gana:B"]) <= 2 * largest
