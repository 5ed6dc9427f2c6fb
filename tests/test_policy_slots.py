"""Slots (SPEC §6): one test (or a few) per rule R21–R25 on a virtual clock, and hypothesis
properties with 1–3 devices x 1–8 slots against the scanning checks of slot_support.

With one slot per device every R1–R20 test (test_policy_rules, test_policy_pool) runs
unchanged on the same code.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy_support import Arrival, job
from slot_support import SlotDriver
from test_policy_pool import check_equal_service
from test_policy_properties import check_t2_share, configs, times
from uniun_ray.policy import Dispatch, PolicyConfig, Requeued, Revoke, RevokeCause, SchedulerPolicy, Tier

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: A GPU-like step: flat up to 4, then growing (k = S - 1 beside one chat up to 4 slots).
FLAT = {1: 0.010, 2: 0.0101, 3: 0.0102, 4: 0.0103, 5: 0.0140, 6: 0.0160, 7: 0.0180, 8: 0.0200}
#: A profile that does not grow with the rows (as served on a 2-core CPU: 3 rows slower than 4).
BUMPY = {1: 0.010, 2: 0.0135, 3: 0.0120, 4: 0.0124, 5: 0.0160, 6: 0.0122, 7: 0.0180, 8: 0.0200}


def slotted(slots=4, devices=("d0",), **cfg) -> SchedulerPolicy:
    return SchedulerPolicy(PolicyConfig(**cfg), devices=devices, slots=slots)


def background(profile, rows=4, **cfg) -> SchedulerPolicy:
    """A 4-slot device with the step ``profile``, ``rows`` Nataraj jobs decoding on it."""
    p = slotted(4, **cfg)
    p.set_step_profile("m", "d0", profile)
    for i in range(rows):
        p.submit(job(f"n{i}", "nataraj", producer=f"n:{i}"), 0)
    return p


def D(job_id, tier, device="d0", model="m", swap=False, slot=0):
    return Dispatch(job_id, model, swap, tier, device, slot)


# R21 ------------------------------------------------------------------------------------
def test_r21_free_slots_take_the_best_jobs_on_the_device_model_in_pick_order():
    p = slotted(3)
    assert p.submit(job("n1", "nataraj"), 0) == [D("n1", Tier.FAIR, swap=True)]
    assert p.submit(job("e1", "extract"), 1) == [D("e1", Tier.EXTRACT, slot=1)]  # joins: no revoke
    assert p.submit(job("g1", "gana", model="y"), 2) == []     # another model: the device is not empty
    assert p.submit(job("n2", "nataraj"), 3) == [D("n2", Tier.FAIR, slot=2)]
    # full: R22 revokes n2, which hands its slot to e2 at once (it joins as n2 stops)
    assert p.submit(job("e2", "extract"), 4) == [Revoke("n2", RevokeCause.ARRIVAL), D("e2", Tier.EXTRACT, slot=2)]
    assert p.finish("n2", 4.1, "revoked") == [Requeued("n2")]
    # a freed slot takes the best job on m (n2), not the other model's job inside its wait
    assert p.finish("n1", 5, "done") == [D("n2", Tier.FAIR, slot=0)]
    snap = p.snapshot()["devices"][0]
    assert snap["slots"] == 3 and [(j["id"], j["slot"]) for j in snap["jobs"]] == [("e1", 1), ("e2", 2), ("n2", 0)]


def test_r21_a_device_swaps_only_when_empty_and_its_slots_are_numbered():
    p = slotted(2)
    p.submit(job("a", "nataraj"), 0)
    p.submit(job("b", "nataraj"), 0)
    p.submit(job("y", "gana", model="y"), 1)
    assert p.finish("a", 2, "done") == []        # no m work left, but b still runs: no swap, y waits
    assert p.finish("b", 3, "done") == [D("y", Tier.FAIR, model="y", swap=True)]


def test_r21_an_other_model_job_past_its_affinity_wait_drains_the_device():
    p = slotted(2, max_affinity_wait_s=10)
    p.submit(job("n1", "nataraj", producer="n:1"), 0)
    p.submit(job("n2", "nataraj", producer="n:2"), 0)
    p.submit(job("g", "gana", model="y"), 1)
    for i in range(3, 8):
        p.submit(job(f"n{i}", "nataraj", producer=f"n:{i}"), 1)
    # within the wait a freed slot takes m work
    assert p.finish("n1", 5, "done") == [D("n3", Tier.FAIR, slot=0)]
    p.tick(11.5)                                   # g has waited past 10 s: the device drains for it
    assert p.snapshot()["devices"][0]["draining_for"] == "g"
    assert p.finish("n2", 12, "done") == []        # a freed slot stays free
    assert p.finish("n3", 13, "done") == [D("g", Tier.FAIR, model="y", swap=True)]


def test_r21_one_model_per_device_and_affinity_across_a_pool():
    p = slotted(2, devices=("d0", "d1"))
    p.set_loaded_model("m", 0, device="d0")
    p.set_loaded_model("y", 0, device="d1")
    acts = [p.submit(job(f"j{i}", "nataraj", model=("m", "y")[i % 2], producer=f"n:{i}"), 0)[0] for i in range(4)]
    assert [(a.job_id, a.device, a.swap) for a in acts] == [("j0", "d0", False), ("j1", "d1", False),
                                                           ("j2", "d0", False), ("j3", "d1", False)]


# R22 ------------------------------------------------------------------------------------
def test_r22_an_outranking_arrival_joins_a_free_slot_and_revokes_nothing():
    p = slotted(2)
    p.submit(job("n1", "nataraj"), 0)
    assert p.submit(job("e", "extract"), 1) == [D("e", Tier.EXTRACT, slot=1)]


def test_r22_no_free_slot_revokes_exactly_the_lowest_ranked_job():
    p = slotted(3)
    p.submit(job("e", "extract"), 0)
    p.submit(job("n1", "nataraj", producer="n:1"), 1)
    p.submit(job("n2", "nataraj", producer="n:2"), 2)
    # a T3 job arrives: one revoke, the lowest-ranked (T4, then the most recently dispatched)
    # and its slot is handed over at once: d joins at the step where n2 stops (no release first)
    assert p.submit(job("d", "gana", deadline=0.0), 3) == [Revoke("n2", RevokeCause.ARRIVAL),
                                                            D("d", Tier.DEADLINE, slot=2)]
    assert p.finish("n2", 3.1, "revoked") == [Requeued("n2")]
    assert [(j["id"], j["slot"]) for j in p.snapshot()["devices"][0]["jobs"]] == [("e", 0), ("n1", 1), ("d", 2)]


def test_r22_a_revoked_or_cancelled_job_hands_its_slot_over_and_holds_it_no_longer():
    p = slotted(2)
    p.submit(job("e", "extract"), 0)
    p.submit(job("n1", "nataraj", producer="n:1"), 0)
    p.submit(job("n2", "nataraj", producer="n:2"), 0.5)            # queued: both slots taken
    assert p.submit(job("d", "gana", deadline=0.0), 1) == [Revoke("n1", RevokeCause.ARRIVAL),
                                                            D("d", Tier.DEADLINE, slot=1)]
    # n1's slot-seconds end at the handover (R24): e 2 + n1 1 + d 1 held at t=2, not 2 + 2 + 1
    p.tick(2)
    assert p.snapshot()["t2"]["held_s"] == pytest.approx(4.0)
    assert p.finish("n1", 3, "revoked") == [Requeued("n1")]
    assert p.snapshot()["t2"]["held_s"] == pytest.approx(3 + 1 + 2)
    # a cancel hands its slot over too: the next job joins as the cancelled one stops
    assert p.cancel("d", 4) == [Revoke("d", RevokeCause.CANCEL), D("n2", Tier.FAIR, slot=1)]  # n:2 held less
    assert p.finish("d", 4.1, "revoked") == []
    assert [(j["id"], j["slot"]) for j in p.snapshot()["devices"][0]["jobs"]] == [("e", 0), ("n2", 1)]


def test_r22_with_one_slot_a_revoked_job_keeps_its_slot_until_it_ends():
    p = slotted(1)
    p.submit(job("n", "nataraj"), 0)
    assert p.submit(job("e", "extract"), 1) == [Revoke("n", RevokeCause.ARRIVAL)]   # §1 exactly
    assert p.finish("n", 1.1, "revoked") == [Requeued("n"), D("e", Tier.EXTRACT)]


def test_r22_a_chat_that_needs_a_swap_empties_the_lowest_ranked_device():
    p = slotted(2, devices=("d0", "d1"))
    p.submit(job("e1", "extract", model="a"), 0)          # d0: T2 + T4
    p.submit(job("n1", "nataraj", model="a", producer="n:1"), 0)
    p.submit(job("n2", "nataraj", model="b", producer="n:2"), 1)   # d1: T4 + T4
    p.submit(job("n3", "nataraj", model="b", producer="n:3"), 1)
    acts = p.submit(job("c", "chat", model="c"), 2)
    assert sorted(acts, key=str) == sorted([Revoke("n2", RevokeCause.ARRIVAL), Revoke("n3", RevokeCause.ARRIVAL)], key=str)
    assert p.finish("n2", 2.1, "revoked") == [Requeued("n2")]   # no refill: the device drains for c
    assert p.finish("n3", 2.2, "revoked") == [Requeued("n3"), D("c", Tier.CHAT, "d1", "c", swap=True)]


def test_r22_chat_is_never_revoked_and_a_chat_joins_a_free_slot():
    p = slotted(2)
    p.submit(job("c1", "chat"), 0)
    assert p.submit(job("c2", "chat"), 0) == [D("c2", Tier.CHAT, slot=1)]
    assert p.submit(job("c3", "chat"), 0) == []                  # full of chats: it waits
    assert p.finish("c1", 1, "done") == [D("c3", Tier.CHAT, slot=0)]


# R23 ------------------------------------------------------------------------------------
def test_r23_beside_a_chat_only_jobs_within_the_step_bound_keep_their_slots():
    p = background({1: 0.10, 2: 0.11, 3: 0.12, 4: 0.20}, rows=3)  # k = 2 beside one chat
    p.submit(job("e", "extract"), 0.5)                                  # T2, the best-ranked other
    # full: one revoke (R22), whose slot the chat takes at once; beside it stay the two
    # highest-ranked others (e, then n0): n1 goes (R23)
    assert p.submit(job("c", "chat"), 1) == [Revoke("n2", RevokeCause.ARRIVAL), D("c", Tier.CHAT, slot=2),
                                             Revoke("n1", RevokeCause.STEP)]
    assert p.finish("n2", 1.1, "revoked") == [Requeued("n2")]
    assert p.finish("n1", 1.2, "revoked") == [Requeued("n1")]   # its slot stays free beside the chat
    assert [j["id"] for j in p.snapshot()["devices"][0]["jobs"]] == ["n0", "e", "c"]
    assert {a.job_id for a in p.finish("c", 2, "done")} == {"n1", "n2"}  # back when the chat ends


def test_r23_without_a_profile_a_chat_runs_alone_and_the_others_come_back_after():
    p = slotted(4)
    p.submit(job("n1", "nataraj", producer="n:1"), 0)
    p.submit(job("n2", "nataraj", producer="n:2"), 0)
    acts = p.submit(job("c", "chat"), 1)
    assert acts[0] == D("c", Tier.CHAT, slot=2)
    assert set(acts[1:]) == {Revoke("n1", RevokeCause.STEP), Revoke("n2", RevokeCause.STEP)}
    assert p.finish("n1", 1.1, "revoked") == [Requeued("n1")]            # no refill beside the chat
    p.finish("n2", 1.2, "revoked")
    acts = p.finish("c", 2, "done")
    assert {a.job_id for a in acts if isinstance(a, Dispatch)} == {"n1", "n2"}


#: A 2-core CPU's measured step (SmolLM2, float32): 1.25 x its step alone fits no companion.
CPU = {1: 0.053, 2: 0.074, 4: 0.070, 8: 0.087, 16: 0.112}


def test_r23_beside_a_chat_whose_step_alone_is_fast_the_floor_bounds_the_step_not_the_slack():
    """1.25 x 53 ms is 66 ms, which no two rows meet; the floor (75 ms, faster than one reads)
    keeps the three best background rows beside the chat: step(4) = 70 ms."""
    p = background(CPU)
    assert p.submit(job("c", "chat"), 1) == [Revoke("n3", RevokeCause.ARRIVAL), D("c", Tier.CHAT, slot=3)]
    assert p.finish("n3", 1.1, "revoked") == [Requeued("n3")]
    assert [j["id"] for j in p.snapshot()["devices"][0]["jobs"]] == ["n0", "n1", "n2", "c"]


def test_r23_the_floor_keeps_the_highest_ranked_within_it_and_revokes_the_lowest_ranked():
    """With six slots a chat joins a free one; step(6) (78.5 ms, between the measured 4 and 8)
    is past the floor, step(5) (74.25 ms) within it: the lowest-ranked of five goes."""
    p = slotted(6)
    p.set_step_profile("m", "d0", CPU)
    for i in range(5):
        p.submit(job(f"n{i}", "nataraj", producer=f"n:{i}"), i)
    assert p.submit(job("c", "chat"), 6) == [D("c", Tier.CHAT, slot=5), Revoke("n4", RevokeCause.STEP)]


def test_r23_without_the_floor_the_slack_alone_bounds_the_step():
    p = background(CPU, chat_step_floor_s=0.0)
    acts = p.submit(job("c", "chat"), 1)
    assert acts[:2] == [Revoke("n3", RevokeCause.ARRIVAL), D("c", Tier.CHAT, slot=3)]
    assert set(acts[2:]) == {Revoke(f"n{i}", RevokeCause.STEP) for i in range(3)}


#: The profile a 2-core CPU served (SmolLM2, float32, 1 thread, under the peers load): two rows
#: served rarely, their median slower than three or four rows.
SERVED = {1: 0.0725, 2: 0.1025, 3: 0.0872, 4: 0.0856, 8: 0.150, 16: 0.197}


def test_r23_a_chat_keeps_the_most_companions_within_its_bound_though_fewer_would_break_it():
    """Bound max(1.25 x 72.5, 75) = 90.6 ms: beside the chat, three rows (step(4) = 85.6 ms)
    stay, though one alone (step(2) = 102.5 ms) would not; the one its arrival revoked joins
    again when one of them ends. When one is left beside the chat it goes (R23), and none
    joins the chat alone."""
    p = background(SERVED)
    assert p.submit(job("c", "chat"), 1) == [Revoke("n3", RevokeCause.ARRIVAL), D("c", Tier.CHAT, slot=3)]
    assert p.finish("n3", 1.1, "revoked") == [Requeued("n3")]
    assert p.finish("n0", 2, "done") == [D("n3", Tier.FAIR, slot=0)]
    assert p.finish("n1", 3, "done") == []                        # step(3) = 87 ms: n2, n3 stay
    assert p.finish("n2", 4, "done") == [Revoke("n3", RevokeCause.STEP)]
    assert p.finish("n3", 4.1, "revoked") == [Requeued("n3")]     # and it does not join the chat alone
    assert p.finish("c", 5, "done") == [D("n3", Tier.FAIR, slot=0)]


def test_r23_a_step_profile_is_checked():
    p = slotted(2)
    with pytest.raises(ValueError, match="batch size"):
        p.set_step_profile("m", "d0", {0: 0.1})
    with pytest.raises(ValueError, match="unknown device"):
        p.set_step_profile("m", "dx", {1: 0.1})
    with pytest.raises(ValueError, match="chat_step_slack"):
        PolicyConfig(chat_step_slack=0.9)
    for floor in (-0.01, float("nan"), "0.075", True):
        with pytest.raises(ValueError, match="chat_step_floor_s"):
            PolicyConfig(chat_step_floor_s=floor)


def test_r21_an_over_budget_t2_job_takes_a_slot_no_lower_tier_job_may_take_while_a_chat_waits():
    p = slotted(2, devices=("d0", "d1"), t2_share=0.0)
    for device in ("d0", "d1"):
        p.set_step_profile("m", device, FLAT)
    p.submit(job("e0", "extract"), 0)                    # d0: T2 time in the window
    p.submit(job("c1", "chat"), 0)                       # d0, beside e0
    p.submit(job("c3", "chat"), 0.1)                     # d1
    p.finish("e0", 5, "done")
    p.submit(job("g", "gana", model="y"), 5)             # lower-tier work, on another model
    p.submit(job("cy", "chat", model="y"), 5)            # waits; d1 drains for it
    assert [d["draining_for"] for d in p.snapshot()["devices"]] == [None, "cy"]
    # T2 is over budget and g waits, but g may take no slot: e takes d0's (R11, work-conserving)
    assert p.submit(job("e", "extract"), 5) == [D("e", Tier.EXTRACT, "d0", slot=0)]


# R24 ------------------------------------------------------------------------------------
def test_r24_each_job_is_charged_its_own_time_whatever_the_batch():
    p = slotted(4)
    p.submit(job("a", "gana", producer="gana:A"), 0)
    p.submit(job("b", "gana", producer="gana:B"), 0)
    p.submit(job("e", "extract"), 0)
    p.finish("a", 10, "done")
    p.finish("b", 20, "done")
    snap = p.snapshot()
    assert snap["vruntime"]["producers"]["gana"] == {"gana:A": 10.0, "gana:B": 20.0}
    t2 = snap["t2"]  # slot-seconds: 10 + 20 ended, 20 of T2 still running
    assert (t2["held_s"], t2["t2_held_s"]) == (50.0, 20.0)


# R25 ------------------------------------------------------------------------------------
def test_r25_slots_are_per_device():
    p = SchedulerPolicy(devices=("d0", "d1"), slots={"d0": 1, "d1": 3})
    p.add_device("d2", 0, slots=2)
    assert p.slots == {"d0": 1, "d1": 3, "d2": 2}
    assert [d["slots"] for d in p.snapshot()["devices"]] == [1, 3, 2]
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        p.add_device("d3", 0, slots=0)
    with pytest.raises(ValueError, match="not in the pool"):
        SchedulerPolicy(devices=("d0",), slots={"dx": 2})
    for i in range(6):
        p.submit(job(f"n{i}", "nataraj", producer=f"n:{i}"), 1)
    assert {d: len(js) for d, js in p.slot_jobs.items()} == {"d0": 1, "d1": 3, "d2": 2}



def test_r25_a_device_takes_the_slot_count_its_actor_chose_after_a_load():
    p = slotted(slots=1)
    for i in range(4):
        p.submit(job(f"n{i}", "nataraj", producer=f"n:{i}"), 1)
    assert len(p.slot_jobs["d0"]) == 1
    grown = p.set_slots("d0", 3, 2)
    assert [a.job_id for a in grown if isinstance(a, Dispatch)] == ["n1", "n2"]
    assert {a.slot for a in grown} == {1, 2} and p.snapshot()["devices"][0]["slots"] == 3
    assert p.set_slots("d0", 1, 3) == []             # fewer: nobody is revoked ...
    assert len(p.slot_jobs["d0"]) == 3
    dispatched = [[a.job_id for a in p.finish(f"n{i}", 4 + i, "done") if isinstance(a, Dispatch)] for i in range(3)]
    assert dispatched == [[], [], ["n3"]]            # ... and no slot is filled until they all ended
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        p.set_slots("d0", 0, 9)


# properties ----------------------------------------------------------------------------
@st.composite
def slot_workloads(draw, kinds=("chat", "nataraj", "gana", "extract"), max_jobs=40, horizon=300.0):
    arrivals = []
    for i in range(draw(st.integers(1, max_jobs))):
        kind = draw(st.sampled_from(kinds))
        at = draw(times(0, horizon))
        deadline = at + draw(times(-10, 100)) if kind in ("nataraj", "gana") and draw(st.booleans()) else None
        arrivals.append(Arrival(at, i, job(f"j{i}", kind, model=draw(st.sampled_from(("m", "y"))),
                                           producer=f"{kind}:{draw(st.integers(0, 2))}", deadline=deadline),
                                duration=draw(times(0.05, 30))))
    return arrivals


@PROPS
@given(slot_workloads(), configs(), st.integers(1, 3), st.integers(1, 8), st.sampled_from([None, FLAT, BUMPY]))
def test_prop_slots_fill_revoke_once_and_hold_the_chat_step(arrivals, config, devices, slots, profile):
    """Never a free slot while a job it may take waits (R16 per slot); a device holds one
    model and swaps only when empty (R21); an arrival takes a slot open to it, and its revokes
    hit one device at most (R22); R23's bound after every call; every job ends exactly once
    (the checks run inside the driver after every call)."""
    d = SlotDriver(config, devices, slots, profile=profile)
    d.run(arrivals)
    assert sorted(d.ended) == sorted(a.job.id for a in arrivals) and set(d.ended.values()) == {1}


@PROPS
@given(slot_workloads(kinds=("extract", "extract", "nataraj", "gana", "chat"), max_jobs=50), configs(),
       st.integers(1, 3), st.integers(1, 8))
def test_prop_t2_holds_its_share_of_slot_seconds_plus_one_job_per_slot(arrivals, config, devices, slots):
    d = SlotDriver(config, devices, slots, profile=FLAT)
    d.run(arrivals)
    check_t2_share(d.runs, d.samples, config, jobs_over=devices * slots)


def fair_bound(slots: int) -> float:
    """R24's bound, in largest jobs, on how far apart two equal backlogged flows may be on one
    device of `slots` slots: max(2, (S + 1) // 2). Why it grows with S: a flow ranks first by
    its running jobs, so each holds half the slots; with an odd count the odd slot is one flow's
    until one of its own jobs ends (at most one largest job L), and then goes by the flows'
    service as the policy estimates it: a running job counts for at least its flow's last run,
    so each of the (S - 1) / 2 jobs a flow runs then may read up to L more than it held. A wrong
    pick gives the odd slot to the flow ahead for another L: L + (S - 1) / 2 * L = (S + 1) / 2 * L
    (2 L up to 4 slots, 3 L at 5 and 6, 4 L at 7 and 8); random runs stay near 2 L."""
    return max(2.0, float((slots + 1) // 2))


@PROPS
@given(st.lists(st.floats(0.1, 30, allow_nan=False), min_size=2, max_size=30),
       st.lists(st.floats(0.1, 30, allow_nan=False), min_size=2, max_size=30), st.integers(1, 8))
def test_prop_two_equal_t4_flows_get_equal_slot_seconds_within_the_slots_bound(a_jobs, b_jobs, slots):
    arrivals = [Arrival(0.0, 2 * i, job(f"a{i}", "gana", producer="gana:A"), t) for i, t in enumerate(a_jobs)]
    arrivals += [Arrival(0.0, 2 * i + 1, job(f"b{i}", "gana", producer="gana:B"), t) for i, t in enumerate(b_jobs)]
    d = SlotDriver(PolicyConfig(decay_period_s=1e9), 1, slots)
    d.run(arrivals)
    check_equal_service(d.runs, arrivals, max(a_jobs + b_jobs), fair_bound(slots))


def test_r24_slots_freed_at_one_instant_are_shared_when_a_producer_has_not_ended_a_run():
    """Found by the property above: 3 slots, at t=0.5 A's two short jobs end and free two
    slots. B had ended no run yet, so its running job counted for 0.5 s and the one just
    dispatched for nothing: both slots went to B, which held 8 slot-seconds against A's 1 by
    t=3 (bound 2 x 3 s). A producer without a last run now counts its running jobs for at
    least its kind's last run."""
    a_jobs, b_jobs = [0.5, 0.5, 3.0, 2.0, 0.5], [3.0, 3.0, 3.0, 2.0]
    arrivals = [Arrival(0.0, 2 * i, job(f"a{i}", "gana", producer="gana:A"), t) for i, t in enumerate(a_jobs)]
    arrivals += [Arrival(0.0, 2 * i + 1, job(f"b{i}", "gana", producer="gana:B"), t) for i, t in enumerate(b_jobs)]
    d = SlotDriver(PolicyConfig(decay_period_s=1e9), 1, 3)
    d.run(arrivals)
    check_equal_service(d.runs, arrivals, max(a_jobs + b_jobs))


def test_r25_a_swap_takes_the_slot_count_its_model_got_on_the_device_from_its_dispatch_on():
    """A count the device reported for a model after loading it (`set_slots`) is that model's
    there: a swap back to it has that count from the swap's dispatch on, not the previous
    model's until its load ends; a model never measured there keeps the current count."""
    p = slotted(slots=1)
    for i in range(4):
        p.submit(job(f"n{i}", "nataraj", producer=f"n:{i}"), 1)
    p.set_slots("d0", 4, 2)                                  # m's count, after its load
    p.submit(job("g0", "gana", model="y", producer="g:0"), 2)
    p.submit(job("g1", "gana", model="y", producer="g:1"), 2)
    swapped = [a for i in range(4) for a in p.finish(f"n{i}", 3 + i, "done")]
    assert [(a.job_id, a.swap) for a in swapped] == [("g0", True), ("g1", False)]  # y not measured: 4 slots
    assert p.set_slots("d0", 1, 7, model_id="y") == []       # y's count, after its load
    for i in range(4, 7):
        p.submit(job(f"n{i}", "nataraj", producer=f"n:{i}"), 7)
    p.finish("g0", 8, "done")
    back = p.finish("g1", 9, "done")                         # back to m: its 4 slots at once
    assert [(a.job_id, a.swap) for a in back] == [("n4", True), ("n5", False), ("n6", False)]
    assert p.set_slots("d0", 4, 10, model_id="m") == [] and p.snapshot()["devices"][0]["slots"] == 4
    for i in range(2, 5):
        p.submit(job(f"g{i}", "gana", model="y", producer=f"g:{i}"), 10)
    again = [a for i in range(4, 7) for a in p.finish(f"n{i}", 11 + i, "done")]
    assert [(a.job_id, a.swap) for a in again] == [("g2", True)]   # to y: the one slot y got
    assert p.snapshot()["devices"][0]["slots"] == 1
    assert p.set_slots("d0", 3, 18, model_id="m") == []      # a late count of the model it left
    assert p.snapshot()["devices"][0]["slots"] == 1          # is m's next time, not the device's now
    assert p.snapshot()["devices"][0]["slots_by_model"] == {"m": 3, "y": 1}   # status shows each
