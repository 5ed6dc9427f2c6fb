"""Bad input: a ValueError that names the problem, and the policy's state unchanged."""
from __future__ import annotations

import copy
import math

import pytest

from policy_support import job
from uniun_ray.policy import Job, PolicyConfig, Revoke, RevokeCause, SchedulerPolicy


@pytest.mark.parametrize("fields, message", [
    (dict(id="x", kind="video", model_id="m"), "unknown kind 'video'"),
    (dict(id="", kind="chat", model_id="m"), "job id must be a non-empty string"),
    (dict(id=7, kind="chat", model_id="m"), "job id must be a non-empty string"),
    (dict(id="x", kind="chat", model_id=""), "model_id must be a non-empty string"),
    (dict(id="x", kind="gana", model_id="m", deadline=math.nan), "deadline must be a finite number"),
    (dict(id="x", kind="gana", model_id="m", deadline=math.inf), "deadline must be a finite number"),
    (dict(id="x", kind="gana", model_id="m", deadline="soon"), "deadline must be a finite number"),
    (dict(id="x", kind="gana", model_id="m", producer=""), "producer must be a non-empty string"),
    (dict(id="x", kind="extract", model_id="m", foreground_hint="yes"), "foreground_hint must be a bool"),
])
def test_bad_job_is_rejected_with_a_named_problem(fields, message):
    with pytest.raises(ValueError, match=message):
        Job(**fields)


def busy_policy() -> SchedulerPolicy:
    p = SchedulerPolicy()
    p.submit(job("n1", "nataraj"), 0)
    p.submit(job("n2", "nataraj"), 1)
    p.submit(job("g", "gana", model="y", deadline=50), 2)
    return p


BAD_CALLS = [
    ("duplicate id", lambda p: p.submit(job("n2", "nataraj"), 3), "duplicate job id 'n2'"),
    ("running id reused", lambda p: p.submit(job("n1", "gana"), 3), "duplicate job id 'n1'"),
    ("not a Job", lambda p: p.submit({"id": "x"}, 3), "submit takes a Job"),
    ("finish unknown", lambda p: p.finish("nope", 3, "done"), "unknown job"),
    ("finish queued", lambda p: p.finish("n2", 3, "done"), "queued, not running"),
    ("cancel unknown", lambda p: p.cancel("nope", 3), "unknown job"),
    ("cancel for a cause not the caller's", lambda p: p.cancel("n1", 3, cause="arrival"),
     "cause must be one of cancel, reclaim"),
    ("cancel for no known cause", lambda p: p.cancel("n1", 3, cause="bored"), "cause must be one of"),
    ("unknown outcome", lambda p: p.finish("n1", 3, "exploded"), "unknown outcome 'exploded'"),
    ("revoked without Revoke", lambda p: p.finish("n1", 3, "revoked"), "never revoked"),
    ("time backwards", lambda p: p.tick(1.5), "time went backwards"),
    ("time backwards submit", lambda p: p.submit(job("z", "chat"), 0.5), "time went backwards"),
    ("nan time", lambda p: p.tick(math.nan), "now must be a finite number"),
    ("bad foreground kind", lambda p: p.set_foreground("video", 3), "unknown kind"),
    ("subject without kind", lambda p: p.set_foreground(None, 3, subject="n"), "needs a foreground kind"),
    ("empty subject", lambda p: p.set_foreground("extract", 3, subject=""), "subject must be a non-empty"),
]


@pytest.mark.parametrize("name, call, message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_and_leaves_state_unchanged(name, call, message):
    p = busy_policy()
    before = copy.deepcopy(p.snapshot())
    with pytest.raises(ValueError, match=message):
        call(p)
    assert p.snapshot() == before
    # and the policy still works afterwards
    assert p.submit(job("c", "chat"), 3) == [Revoke("n1", RevokeCause.ARRIVAL)]


def test_finish_twice_is_named():
    p = busy_policy()
    p.finish("n1", 3, "done")
    with pytest.raises(ValueError, match=r"finish\('n1'\): the job already ended \(done\)"):
        p.finish("n1", 4, "done")


def test_cancel_queued_and_running():
    p = busy_policy()
    assert p.cancel("n2", 3) == []
    assert [j["id"] for t in p.snapshot()["tiers"].values() for j in t] == ["g"]
    assert p.cancel("n1", 4) == [Revoke("n1", RevokeCause.CANCEL)]
    assert p.cancel("n1", 4) == []  # a second cancel sends no second Revoke
    actions = p.finish("n1", 4.05, "revoked")  # cancelled: ends, not re-queued
    assert [a.job_id for a in actions] == ["g"]
    with pytest.raises(ValueError, match="already ended"):
        p.cancel("n1", 5)


def test_reclaim_of_a_dead_holder_revokes_with_its_cause_and_never_requeues():
    p = busy_policy()
    assert p.cancel("n1", 3, cause="reclaim") == [Revoke("n1", RevokeCause.RECLAIM)]
    assert [a.job_id for a in p.finish("n1", 3.5, "revoked")] == ["n2"]  # no Requeued


def test_cancelled_job_that_completed_anyway_is_not_requeued():
    p = busy_policy()
    p.cancel("n1", 3)
    p.finish("n1", 3.01, "done")
    assert p.snapshot()["running"]["id"] == "n2"


@pytest.mark.parametrize("fields, message", [
    (dict(window_s=0), "window_s must be > 0"),
    (dict(t2_share=1.5), r"t2_share must be within \[0, 1\]"),
    (dict(max_affinity_wait_s=-1), "max_affinity_wait_s must be >= 0"),
    (dict(decay_period_s=math.nan), "decay_period_s must be a finite number"),
    (dict(weights={"gana:1": 0}), "weight of 'gana:1' must be > 0"),
])
def test_bad_config(fields, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**fields)
