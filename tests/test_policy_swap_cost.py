"""R12 with measured swap costs (issue 37), on a virtual clock: a job's affinity wait follows the
cost of the swap it would cause (`picker.affinity_bound`): a 20 ms switch holds an other-model
job for a fraction of a second, a cold load of the reference cost or more (or of unknown cost)
for the whole `max_affinity_wait_s`, and T0/T1 never wait."""
from __future__ import annotations

import pytest

from policy_support import job
from uniun_ray.policy import Dispatch, PolicyConfig, Requeued, Revoke, RevokeCause, SchedulerPolicy, Tier
from uniun_ray.policy.picker import affinity_bound


def policy(*devices: str, **cfg) -> SchedulerPolicy:
    p = SchedulerPolicy(PolicyConfig(**cfg), devices=devices or ("dev0",))
    for device in p.devices:
        p.set_loaded_model("m", 0.0, device=device)
    return p


def test_the_bound_is_the_whole_wait_for_a_costly_or_unknown_swap_and_shrinks_with_a_cheap_one():
    assert affinity_bound(60, 10, None) == 60
    assert affinity_bound(60, 10, 12.0) == 60      # a cold 12 s load still batches work
    assert affinity_bound(60, 10, 5.0) == 30
    assert affinity_bound(60, 10, 0.02) == pytest.approx(0.12)   # a 20 ms switch


def test_an_other_model_job_waits_by_its_swaps_cost():
    """The running job's model keeps the device (R12) only as long as the other model's swap
    is worth: 0.12 s for a 20 ms switch, not 60 s; the end of that wait is the event."""
    p = policy()
    p.set_swap_cost("other", "dev0", 0.02)
    p.submit(job("n", "nataraj"), 0)
    assert p.submit(job("g", "gana", model="other", deadline=1), 1) == []   # inside its (short) wait
    assert p.next_wakeup() == pytest.approx(1.12)
    assert p.tick(p.next_wakeup()) == [Revoke("n", RevokeCause.AFFINITY)]
    assert p.finish("n", 1.2, "revoked") == [Requeued("n"), Dispatch("g", "other", True, Tier.DEADLINE)]


def test_a_cold_swap_still_batches_the_loaded_models_work():
    """With the other model's swap a cold load (12 s, above the reference), the queued job on
    the loaded model goes first for the whole minute, as without measured costs."""
    p = policy()
    p.set_swap_cost("other", "dev0", 12.0)
    p.submit(job("n1", "nataraj"), 0)
    p.submit(job("g", "gana", model="other", deadline=1), 1)
    p.submit(job("n2", "nataraj"), 2)
    assert p.next_wakeup() == pytest.approx(61)
    assert p.finish("n1", 30, "done") == [Dispatch("n2", "m", False, Tier.FAIR)]


def test_a_new_measure_moves_the_wait_and_is_an_event_when_given_the_time():
    p = policy()
    p.submit(job("n", "nataraj"), 0)
    p.submit(job("g", "gana", model="other", deadline=1), 1)
    assert p.next_wakeup() == pytest.approx(61)   # unknown cost: the whole wait
    assert p.set_swap_cost("other", "dev0", 0.5, now=10) == [Revoke("n", RevokeCause.AFFINITY)]  # 3 s: over


def test_the_cheapest_device_of_the_pool_sets_the_wait_and_a_removed_device_forgets_its_costs():
    p = policy("a", "b")
    p.set_swap_cost("other", "a", 12.0)
    p.set_swap_cost("other", "b", 0.02)
    p.submit(job("n1", "nataraj"), 0)
    p.submit(job("n2", "nataraj"), 0)
    p.submit(job("g", "gana", model="other", deadline=1), 1)
    assert p.next_wakeup() == pytest.approx(1.12)
    p.remove_device("b", 1.1)   # n2 goes back to its queue; g's wait is a's cost now
    assert p.next_wakeup() == pytest.approx(61)
    p.add_device("b", 1.1)
    assert p.snapshot()["swap_cost_s"] == {"a": {"other": 12.0}, "b": {}}


def test_bad_swap_costs_are_refused_and_change_nothing():
    p = policy()
    for model, device, seconds in (("", "dev0", 1.0), ("other", "nowhere", 1.0), ("other", "dev0", -1.0)):
        with pytest.raises(ValueError):
            p.set_swap_cost(model, device, seconds)
    p.submit(job("n", "nataraj"), 0)
    p.submit(job("g", "gana", model="other", deadline=1), 1)
    assert p.next_wakeup() == pytest.approx(61)
    with pytest.raises(ValueError, match="affinity_full_swap_s"):
        PolicyConfig(affinity_full_swap_s=0)
