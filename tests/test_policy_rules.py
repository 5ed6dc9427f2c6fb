"""One test (or a few) per SPEC rule, named for it, on a virtual clock."""
from __future__ import annotations

import pytest

from policy_support import calls_per_cycle, job
from uniun_ray.policy import (Dispatch, Foreground, Kind, PolicyConfig, Requeued, Revoke, RevokeCause,
                              SchedulerPolicy, Tier, tier_of)


def D(job_id, tier, model="m", swap=False):
    return [Dispatch(job_id, model, swap, tier)]


def policy(**cfg) -> SchedulerPolicy:
    p = SchedulerPolicy(PolicyConfig(**cfg))
    p.set_loaded_model("m", 0.0)
    return p


def tiers(p: SchedulerPolicy) -> dict[str, list[str]]:
    return {t: [j["id"] for j in js] for t, js in p.snapshot()["tiers"].items()}


# R1 -------------------------------------------------------------------------------------
def test_r1_tier_table():
    fg_none, at = Foreground(), 10.0
    assert tier_of(job("c", "chat"), fg_none, at) is Tier.CHAT
    assert tier_of(job("e", "extract"), fg_none, at) is Tier.EXTRACT
    assert tier_of(job("e", "extract", foreground_hint=True), fg_none, at) is Tier.EXTRACT
    assert tier_of(job("n", "nataraj"), fg_none, at) is Tier.FAIR
    assert tier_of(job("g", "gana", deadline=10.0), fg_none, at) is Tier.DEADLINE
    assert tier_of(job("g", "gana", deadline=10.5), fg_none, at) is Tier.FAIR
    # foreground kind hoists its kind; extract only with the hint
    assert tier_of(job("n", "nataraj"), Foreground(Kind.NATARAJ), at) is Tier.FOREGROUND
    assert tier_of(job("g", "gana", deadline=1.0), Foreground(Kind.NATARAJ), at) is Tier.DEADLINE
    assert tier_of(job("e", "extract", foreground_hint=True), Foreground(Kind.EXTRACT), at) is Tier.FOREGROUND
    assert tier_of(job("e", "extract"), Foreground(Kind.EXTRACT), at) is Tier.EXTRACT
    assert tier_of(job("c", "chat"), Foreground(Kind.NATARAJ), at) is Tier.CHAT


def test_r1_subject_hoists_only_that_subject_any_kind():
    fg = Foreground(Kind.EXTRACT, "note-7")
    assert tier_of(job("e1", "extract", foreground_hint=True, subject="note-7"), fg, 0) is Tier.FOREGROUND
    assert tier_of(job("g1", "gana", subject="note-7"), fg, 0) is Tier.FOREGROUND
    assert tier_of(job("e2", "extract", foreground_hint=True, subject="note-8"), fg, 0) is Tier.EXTRACT
    assert tier_of(job("e3", "extract", foreground_hint=True), fg, 0) is Tier.EXTRACT


def test_r1_with_a_subject_t1_is_exactly_that_subjects_jobs_whatever_their_kind():
    p = policy()
    p.submit(job("e", "extract"), 0)  # runs at T2
    p.submit(job("g", "gana", subject="s1"), 0)
    p.submit(job("n", "nataraj"), 0)  # the foreground kind, but about no subject
    assert p.set_foreground("nataraj", 1, subject="s1") == [Revoke("e", RevokeCause.FOREGROUND)]
    assert tiers(p)["T1"] == ["g"] and tiers(p)["T4"] == ["n"]
    assert p.finish("e", 1.05, "revoked") == [Requeued("e"), *D("g", Tier.FOREGROUND)]


def test_r1_tier_is_recomputed_from_time_and_foreground_even_while_running():
    p = policy()
    p.submit(job("g", "gana", deadline=5.0), 0.0)
    assert p.snapshot()["running"]["tier"] == "T4"
    p.tick(5.0)
    assert p.snapshot()["running"]["tier"] == "T3"
    p.set_foreground("gana", 6.0)
    assert p.snapshot()["running"]["tier"] == "T1"


# R2 -------------------------------------------------------------------------------------
def test_r2_strict_order_lowest_tier_first():
    p = policy()
    p.submit(job("c", "chat"), 0)
    for j in (job("n", "nataraj"), job("g", "gana", deadline=0.5), job("e", "extract"),
              job("h", "nataraj", producer="p2")):
        p.submit(j, 1)
    p.set_foreground("nataraj", 1)
    p.submit(job("c2", "chat"), 1)
    order = []
    actions = p.finish("c", 2, "done")
    while actions:
        (d,) = actions
        order.append(d.job_id)
        actions = p.finish(d.job_id, 3, "done")
    assert order == ["c2", "n", "h", "e", "g"]


# R3 -------------------------------------------------------------------------------------
def test_r3_fifo_in_t2_and_edf_in_t3():
    p = policy()
    p.submit(job("c", "chat"), 0)
    p.submit(job("e1", "extract"), 1)
    p.submit(job("e2", "extract"), 2)
    p.submit(job("late", "gana", deadline=5), 3)
    p.submit(job("early", "gana", producer="g2", deadline=4), 3.5)
    assert tiers(p)["T2"] == ["e1", "e2"]
    p.tick(6)
    assert p.finish("c", 6, "done") == D("e1", Tier.EXTRACT)
    assert p.finish("e1", 7, "done") == D("e2", Tier.EXTRACT)
    assert p.finish("e2", 8, "done") == D("early", Tier.DEADLINE)
    assert p.finish("early", 9, "done") == D("late", Tier.DEADLINE)


def test_r3_requeued_job_keeps_its_original_place():
    p = policy()
    p.submit(job("e1", "extract"), 0)
    p.submit(job("e2", "extract"), 1)
    assert p.submit(job("c", "chat"), 2) == [Revoke("e1", RevokeCause.ARRIVAL)]
    assert p.finish("e1", 2.1, "revoked") == [Requeued("e1"), *D("c", Tier.CHAT)]
    assert tiers(p)["T2"] == ["e1", "e2"]
    assert p.finish("c", 3, "done") == D("e1", Tier.EXTRACT)


# R4 -------------------------------------------------------------------------------------
def test_r4_preempts_on_arrival():
    p = policy()
    p.submit(job("n", "nataraj"), 0)
    assert p.submit(job("e", "extract"), 1) == [Revoke("n", RevokeCause.ARRIVAL)]


def test_r4_preempts_on_foreground_change_both_sides():
    p = policy()
    p.submit(job("g", "gana"), 0)
    p.submit(job("n", "nataraj"), 0)
    assert p.set_foreground("nataraj", 1) == [Revoke("g", RevokeCause.FOREGROUND)]  # the queued side moves up
    p.finish("g", 1.1, "revoked")
    assert p.snapshot()["running"]["id"] == "n"
    p.submit(job("e", "extract"), 2)  # T2 < T1? no: nataraj is hoisted, extract waits
    assert p.snapshot()["running"]["revoked"] is False
    assert p.set_foreground(None, 3) == [Revoke("n", RevokeCause.FOREGROUND)]  # the running side moves down


def test_r4_preempts_when_a_deadline_passes_while_waiting():
    p = policy()
    p.submit(job("n", "nataraj"), 0)
    p.submit(job("g", "gana", deadline=10), 1)
    assert p.tick(9.9) == []
    assert p.tick(10) == [Revoke("n", RevokeCause.DEADLINE)]


def test_r4_never_on_budget():
    p = policy()
    p.submit(job("e1", "extract"), 0)
    p.submit(job("n", "nataraj"), 0)
    assert p.finish("e1", 100, "done") == D("n", Tier.FAIR)  # T2 held 100 % of the window: over budget
    assert p.submit(job("e2", "extract"), 101) == []


def test_r4_the_end_of_an_outranking_jobs_affinity_wait_is_an_event_and_a_wakeup():
    p = policy()  # max_affinity_wait_s 60
    p.submit(job("n", "nataraj"), 0)
    assert p.submit(job("g", "gana", model="other", deadline=1), 1) == []  # T3, inside its wait
    wake = p.next_wakeup()
    assert wake == pytest.approx(61) and wake > 61  # the first instant it has waited *longer*
    assert p.tick(61) == []
    assert p.tick(wake) == [Revoke("n", RevokeCause.AFFINITY)]
    assert p.next_wakeup() is None
    assert p.finish("n", 62, "revoked") == [Requeued("n"), *D("g", Tier.DEADLINE, "other", swap=True)]


def test_r4_issue_10_a_wait_ending_revokes_at_its_wakeup_not_at_an_unrelated_call():
    p = policy(max_affinity_wait_s=5)
    p.submit(job("g1", "gana", model="m1"), 0)
    assert p.submit(job("e1", "extract", model="m2"), 1) == []
    assert p.set_foreground(None, 3) == []  # nothing was in front: no tier changes, no event
    assert p.next_wakeup() == pytest.approx(6)
    assert p.tick(p.next_wakeup()) == [Revoke("g1", RevokeCause.AFFINITY)]
    # a runtime that ticks late: the first call after the end notices it, whatever it is
    late = policy(max_affinity_wait_s=5)
    late.submit(job("g1", "gana", model="m1"), 0)
    late.submit(job("e1", "extract", model="m2"), 1)
    assert late.tick(100) == [Revoke("g1", RevokeCause.AFFINITY)]


def test_r4_a_foreground_change_that_alters_no_tier_does_nothing():
    p = policy(window_s=100, t2_share=0.5)
    p.submit(job("e1", "extract"), 0)
    p.submit(job("n1", "nataraj"), 0)
    p.submit(job("e2", "extract"), 0)
    assert p.finish("e1", 100, "done") == D("n1", Tier.FAIR)  # T2 over budget: skipped
    # at 160 T2 holds 40 of 100 s: under budget, so pick would take e2, but the budget
    # sliding is no event; neither is a foreground change that moves no job
    assert p.set_foreground("chat", 160) == []
    assert p.set_foreground("extract", 160) == []  # e2 carries no hint: still T2
    assert p.set_foreground(None, 160) == []
    # an arrival is an event: pick is asked, and takes e2
    assert p.submit(job("n2", "nataraj"), 161) == [Revoke("n1", RevokeCause.ARRIVAL)]


def test_r4_a_foreground_change_that_moves_a_job_is_an_event():
    p = policy()
    p.submit(job("n", "nataraj"), 0)
    p.submit(job("g", "gana", subject="s1"), 0)
    # gana is in front, but n (not a gana) is not hoisted and g is: g moves to T1
    assert p.set_foreground("gana", 1, subject="s1") == [Revoke("n", RevokeCause.FOREGROUND)]


def test_r4_a_bare_tick_a_cancel_or_a_finish_never_revokes():
    p = policy(window_s=100, t2_share=0.5)
    p.submit(job("e1", "extract"), 0)
    p.submit(job("n1", "nataraj"), 0)
    p.submit(job("e2", "extract"), 0)
    p.submit(job("n2", "nataraj", producer="b"), 0)
    p.submit(job("n3", "nataraj", producer="c"), 0)
    assert p.finish("e1", 100, "done") == D("n1", Tier.FAIR)
    assert p.tick(160) == []      # e2 is under budget again: pick would take it
    assert p.cancel("n3", 161) == []
    assert p.snapshot()["running"]["revoked"] is False
    assert p.finish("n1", 162, "done") == D("e2", Tier.EXTRACT)


def test_r4_chat_is_never_preempted_and_revoke_is_sent_once():
    p = policy()
    p.submit(job("c1", "chat"), 0)
    assert p.submit(job("c2", "chat", model="x"), 1) == []
    assert p.set_foreground("nataraj", 1) == []
    p2 = policy()
    p2.submit(job("n", "nataraj"), 0)
    assert p2.submit(job("c", "chat"), 1) == [Revoke("n", RevokeCause.ARRIVAL)]
    assert p2.submit(job("c2", "chat"), 1) == []


# R5 -------------------------------------------------------------------------------------
def test_r5_next_wakeup_is_the_earliest_queued_deadline_not_yet_passed():
    p = policy()
    assert p.next_wakeup() is None
    p.submit(job("n", "nataraj"), 0)
    assert p.next_wakeup() is None  # a running job alone needs no timer
    p.submit(job("g1", "gana", deadline=30), 1)
    p.submit(job("g2", "gana", producer="b", deadline=20), 1)
    assert p.next_wakeup() == 20
    p.tick(20)
    assert p.next_wakeup() == 30


# R6 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nataraj", "gana", "extract"])
def test_r6_revoked_background_job_is_requeued(kind):
    p = policy()
    p.submit(job("j", kind), 0)
    p.submit(job("c", "chat"), 1)
    assert p.finish("j", 1.05, "revoked") == [Requeued("j"), *D("c", Tier.CHAT)]
    assert p.finish("c", 2, "done") == D("j", Tier.EXTRACT if kind == "extract" else Tier.FAIR)


def test_r6_revoked_chat_is_not_requeued():
    p = policy()
    p.submit(job("c", "chat"), 0)
    assert p.cancel("c", 1) == [Revoke("c", RevokeCause.CANCEL)]
    assert p.finish("c", 1.1, "revoked") == []
    assert p.snapshot()["queued"] == 0 and p.snapshot()["running"] is None


# R7 -------------------------------------------------------------------------------------
def test_r7_you_ran_you_pay_revoked_runs_and_swaps_included():
    p = SchedulerPolicy()
    p.submit(job("n", "nataraj", model="x"), 0)  # a swap: held time counts from Dispatch
    p.submit(job("c", "chat", model="x"), 4)
    p.finish("n", 4.5, "revoked")
    assert p.snapshot()["vruntime"]["kinds"]["nataraj"] == pytest.approx(4.5)
    assert p.snapshot()["vruntime"]["producers"]["nataraj"]["nataraj"] == pytest.approx(4.5)


# R8 -------------------------------------------------------------------------------------
def test_r8_two_ganas_alternate():
    p = policy()
    for i in range(3):
        p.submit(job(f"a{i}", "gana", producer="gana:A"), 0)
        p.submit(job(f"b{i}", "gana", producer="gana:B"), 0)
    order, now = ["a0"], 0.0
    for _ in range(5):
        now += 30
        (d,) = p.finish(order[-1], now, "done")
        order.append(d.job_id)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_r8_kind_level_before_producer_level():
    """Gana with two producers still gets the kind's half, not two thirds."""
    p = policy()
    for i in range(6):
        p.submit(job(f"n{i}", "nataraj"), 0)
        p.submit(job(f"a{i}", "gana", producer="A"), 0)
        p.submit(job(f"b{i}", "gana", producer="B"), 0)
    kinds, actions, now = [], p.finish("n0", 1, "done"), 1.0
    kinds.append("nataraj")
    while actions and len(kinds) < 12:
        (d,) = actions
        kinds.append(d.job_id[0])
        now += 1
        actions = p.finish(d.job_id, now, "done")
    assert kinds.count("n") + kinds.count("nataraj") == 6


def test_r8_weights_divide_the_charge():
    p = policy(weights={"gana:A": 2.0})
    for i in range(6):
        p.submit(job(f"a{i}", "gana", producer="gana:A"), 0)
        p.submit(job(f"b{i}", "gana", producer="gana:B"), 0)
    runs, actions, now = ["a0"], p.finish("a0", 1, "done"), 1.0
    while actions and len(runs) < 9:
        (d,) = actions
        runs.append(d.job_id)
        now += 1
        actions = p.finish(d.job_id, now, "done")
    assert sum(r.startswith("a") for r in runs) == 6  # twice the share of B


# R9 -------------------------------------------------------------------------------------
def test_r9_newcomer_starts_at_min_vruntime_of_present_flows():
    p = policy()
    p.submit(job("a0", "gana", producer="A"), 0)
    p.submit(job("a1", "gana", producer="A"), 0)
    p.finish("a0", 100, "done")  # A: 100 s of vruntime, a1 now running
    p.submit(job("b0", "gana", producer="B"), 100)
    assert p.snapshot()["vruntime"]["producers"]["gana"]["B"] == pytest.approx(100)


def test_r9_return_after_absence_is_seeded_but_short_pause_keeps_history():
    p = policy()
    p.submit(job("a0", "gana", producer="A"), 0)
    p.submit(job("b0", "gana", producer="B"), 0)
    p.finish("a0", 10, "done")          # A: 10, idle from t=10
    p.submit(job("b1", "gana", producer="B"), 10)
    p.finish("b0", 190, "done")         # B: 180, still present (b1 runs)
    p.submit(job("a1", "gana", producer="A"), 200)  # back after 190 s < 300: keeps 10
    assert p.snapshot()["vruntime"]["producers"]["gana"]["A"] == pytest.approx(10)
    p2 = policy(decay_period_s=1e9)
    p2.submit(job("a0", "gana", producer="A"), 0)
    p2.submit(job("b0", "gana", producer="B"), 0)
    p2.finish("a0", 10, "done")
    p2.submit(job("b1", "gana", producer="B"), 10)
    p2.finish("b0", 400, "done")        # B: 390
    p2.submit(job("a1", "gana", producer="A"), 400)  # back after 390 s > 300: seeded at min present = 390
    assert p2.snapshot()["vruntime"]["producers"]["gana"]["A"] == pytest.approx(390)


def test_r9_equal_vruntimes_go_to_the_flow_whose_oldest_job_came_first():
    p = policy()
    p.submit(job("c", "chat"), 0)
    p.submit(job("b0", "gana", producer="B"), 1)
    p.submit(job("a0", "gana", producer="A"), 2)
    assert p.finish("c", 3, "done") == D("b0", Tier.FAIR)


def test_r9_the_tie_reads_each_flows_oldest_job_on_any_model_even_on_the_loaded_model():
    p = policy()  # "m" loaded
    p.submit(job("c", "chat"), 0)
    p.submit(job("a_y", "gana", model="y", producer="A"), 1)  # A's oldest job, on y
    p.submit(job("b_m", "gana", producer="B"), 2)
    p.submit(job("a_m", "gana", producer="A"), 3)
    # on the loaded model B's job is older, but A's oldest job (any model) came first
    assert p.finish("c", 4, "done") == D("a_m", Tier.FAIR)


def test_r9_a_flows_oldest_job_is_its_oldest_in_any_tier_a_due_deadline_too():
    p = policy()  # "m" loaded
    p.submit(job("c", "chat"), 0)
    p.submit(job("g_due", "gana", model="y", deadline=1), 1)  # the gana flow's oldest, T3 once due
    p.submit(job("n_m", "nataraj"), 2)
    p.submit(job("g_m", "gana"), 3)
    # g_due (T3, on y) waits out its affinity wait; on the loaded model the kinds tie at
    # vruntime 0 and gana's oldest job came first (a hypothesis counterexample, 2026-12-02)
    assert p.finish("c", 4, "done") == D("g_m", Tier.FAIR)


# R10 ------------------------------------------------------------------------------------
def test_r10_vruntimes_halve_every_period_including_missed_halvings():
    p = policy()  # first call at t=0
    p.submit(job("a", "gana", producer="A"), 0)
    p.finish("a", 80, "done")
    assert p.snapshot()["vruntime"]["producers"]["gana"]["A"] == 80
    p.tick(299)
    assert p.snapshot()["vruntime"]["producers"]["gana"]["A"] == 80
    p.tick(300)
    assert p.snapshot()["vruntime"]["producers"]["gana"]["A"] == 40
    p.tick(1000)  # two more periods passed while dormant
    assert p.snapshot()["vruntime"]["producers"]["gana"]["A"] == 10


# R11 ------------------------------------------------------------------------------------
def test_r11_t2_skipped_over_budget_when_lower_tiers_have_work():
    p = policy()
    p.submit(job("e1", "extract"), 0)
    p.submit(job("e2", "extract"), 0)
    p.submit(job("n", "nataraj"), 0)
    assert p.finish("e1", 100, "done") == D("n", Tier.FAIR)
    assert p.snapshot()["t2"]["over_budget"] is True


def test_r11_work_conserving_when_t2_is_the_only_work():
    p = policy()
    p.submit(job("e1", "extract"), 0)
    p.submit(job("e2", "extract"), 0)
    assert p.finish("e1", 100, "done") == D("e2", Tier.EXTRACT)


def test_r11_hoisted_extracts_do_not_count():
    p = policy()
    p.set_foreground("extract", 0)
    p.submit(job("e1", "extract", foreground_hint=True), 0)
    p.submit(job("e2", "extract"), 0)
    p.submit(job("n", "nataraj"), 0)
    p.finish("e1", 100, "done")  # T1 time, not T2
    assert p.snapshot()["running"]["id"] == "e2"
    assert p.snapshot()["t2"]["t2_held_s"] == 0


def test_r11_window_slides():
    p = policy(window_s=100)
    p.submit(job("e1", "extract"), 0)
    p.submit(job("n1", "nataraj"), 0)
    p.submit(job("e2", "extract"), 0)
    assert p.finish("e1", 100, "done") == D("n1", Tier.FAIR)   # T2 held 100 % of [0, 100]
    p.submit(job("n2", "nataraj"), 100)
    # over [60, 160]: T2 40 s of 100 s held -> under budget again, although T2 had
    # 100 of 160 s since the start
    assert p.finish("n1", 160, "done") == D("e2", Tier.EXTRACT)
    assert p.snapshot()["t2"]["share"] == pytest.approx(0.4)


def test_r11_issue_10_a_share_of_one_is_never_exceeded_by_float_drift():
    p = SchedulerPolicy(PolicyConfig(t2_share=1.0))
    p.submit(job("n1", "nataraj", model="m1"), 9.8)
    assert p.submit(job("e1", "extract", model="m1"), 12.52) == [Revoke("n1", RevokeCause.ARRIVAL)]
    assert p.finish("n1", 12.52, "revoked") == [Requeued("n1"), *D("e1", Tier.EXTRACT, "m1")]
    p.submit(job("e2", "extract", model="m1"), 381.34)
    assert p.finish("e1", 381.34, "done") == D("e2", Tier.EXTRACT, "m1")  # was n1: a share of 1 + 7e-16
    assert p.snapshot()["t2"]["share"] == 1.0


def test_r11_issue_10_a_window_without_t2_time_is_never_over_budget():
    p = SchedulerPolicy(PolicyConfig(window_s=60, t2_share=0.0))
    p.submit(job("e1", "extract"), 0)
    p.finish("e1", 20.666, "done")
    p.submit(job("e2", "extract"), 26.326)
    p.finish("e2", 46.217, "done")
    p.submit(job("n1", "nataraj"), 46.217)
    p.submit(job("n2", "nataraj"), 50)
    assert p.submit(job("e3", "extract"), 50) == []  # T2 over its share of 0: it waits
    assert p.finish("n1", 205.011, "done") == D("e3", Tier.EXTRACT)  # was n2: 3.6e-15 s of "T2"
    assert p.snapshot()["t2"]["t2_held_s"] == 0.0


# R12 ------------------------------------------------------------------------------------
def test_r12_prefers_loaded_model_and_falls_through_tiers():
    p = policy()
    p.submit(job("c", "chat"), 0)
    p.submit(job("e_other", "extract", model="y"), 1)   # T2, other model
    p.submit(job("n_same", "nataraj"), 2)              # T4, loaded model
    assert p.finish("c", 3, "done") == D("n_same", Tier.FAIR)


def test_r12_swaps_when_nothing_on_the_loaded_model():
    p = policy()
    p.submit(job("c", "chat"), 0)
    p.submit(job("g", "gana", model="y"), 1)
    assert p.finish("c", 2, "done") == D("g", Tier.FAIR, "y", swap=True)


def test_r12_swaps_when_other_model_job_waited_past_the_bound():
    p = policy(max_affinity_wait_s=60)
    p.submit(job("n0", "nataraj"), 0)
    p.submit(job("g", "gana", model="y", producer="G"), 0)
    p.submit(job("n1", "nataraj"), 0)
    assert p.finish("n0", 30, "done") == D("n1", Tier.FAIR)
    p.submit(job("n2", "nataraj"), 30)
    assert p.finish("n1", 61, "done") == D("g", Tier.FAIR, "y", swap=True)


def test_r12_after_a_swap_the_new_model_is_favoured_batch():
    p = policy()
    p.submit(job("c", "chat", model="y"), 0)
    p.submit(job("n", "nataraj", model="m"), 0.5)
    p.submit(job("g1", "gana", model="y", producer="A"), 1)
    p.submit(job("g2", "gana", model="y", producer="B"), 1)
    assert p.finish("c", 2, "done") == D("g1", Tier.FAIR, "y")
    assert p.finish("g1", 3, "done") == D("g2", Tier.FAIR, "y")
    assert p.finish("g2", 4, "done") == D("n", Tier.FAIR, "m", swap=True)


def test_r12_the_bounded_wait_wins_over_a_post_swap_batch():
    p = policy(max_affinity_wait_s=60)  # "m" loaded
    p.submit(job("c", "chat", model="m2"), 0)  # swaps to m2
    p.submit(job("e", "extract"), 0)
    p.submit(job("g2", "gana", model="m2", producer="A"), 1)
    p.submit(job("g3", "gana", model="m2", producer="B"), 1)
    assert p.finish("c", 2, "done") == D("g2", Tier.FAIR, "m2")  # the batch on m2 first
    # e (on m) has waited 70 s > 60 s: it is taken next, before g3 on the loaded model
    assert p.finish("g2", 70, "done") == D("e", Tier.EXTRACT, "m", swap=True)


def test_r12_t0_and_t1_swap_at_once():
    p = policy()
    p.submit(job("n", "nataraj"), 0)
    p.set_foreground("gana", 0)
    assert p.submit(job("g", "gana", model="y"), 1) == [Revoke("n", RevokeCause.ARRIVAL)]
    assert p.finish("n", 1.1, "revoked") == [Requeued("n"), *D("g", Tier.FOREGROUND, "y", swap=True)]


# R13 ------------------------------------------------------------------------------------
def test_r13_chat_preempts_across_a_swap_then_the_picker_decides_again():
    p = policy()
    p.submit(job("n", "nataraj", model="m"), 0)
    assert p.submit(job("c", "chat", model="x"), 5) == [Revoke("n", RevokeCause.ARRIVAL)]
    assert p.finish("n", 5.05, "revoked") == [Requeued("n"), *D("c", Tier.CHAT, "x", swap=True)]
    assert p.finish("c", 8, "done") == D("n", Tier.FAIR, "m", swap=True)


# R14 ------------------------------------------------------------------------------------
def test_r14_defaults_and_configurable():
    c = PolicyConfig()
    assert (c.window_s, c.t2_share, c.decay_period_s, c.absence_s, c.max_affinity_wait_s) == (300, 0.6, 300, 300, 60)
    p = policy(t2_share=1.0)  # T2 may take everything: it is never skipped
    p.submit(job("e1", "extract"), 0)
    p.submit(job("e2", "extract"), 0)
    p.submit(job("n", "nataraj"), 0)
    assert p.finish("e1", 100, "done") == D("e2", Tier.EXTRACT)


# R15 ------------------------------------------------------------------------------------
def test_r15_pick_cost_does_not_grow_with_the_queue():
    small, large = calls_per_cycle(policy(), 100), calls_per_cycle(policy(), 10_000)
    assert large < 2 * small, (small, large)


def test_r5_a_deadline_passing_is_noticed_by_whatever_call_comes_first():
    for late_call in (lambda p: p.submit(job("n2", "nataraj"), 11),
                      lambda p: p.cancel("gone", 11),
                      lambda p: p.set_loaded_model("m", 11)):
        p = policy()
        p.submit(job("n", "nataraj"), 0)
        p.submit(job("gone", "gana", producer="x"), 0)
        p.submit(job("g", "gana", deadline=10), 1)
        assert late_call(p) == [Revoke("n", RevokeCause.DEADLINE)]
        assert p.tick(11) == []
