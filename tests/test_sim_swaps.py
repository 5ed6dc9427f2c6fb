"""The simulator with swap kinds (issue 37), on its virtual clock: a model that was on the device
comes back as its profile keeps it (a switch, a warm copy), each swap's kind and seconds are
logged and counted, the policy is given what the next swap to each kept model costs (R12),
and a swap to another model than a chat's is given up for the chat (R13)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from uniun_ray.events.schema import COLD, SWITCH, WARM, validate
from uniun_ray.policy import Job, SchedulerPolicy
from uniun_ray.sim.device import DeviceProfile, ModelSpeed
from uniun_ray.sim.metrics import measure, swap_s_per_device_h
from uniun_ray.sim.simulator import simulate
from uniun_ray.sim.workload import Arrival, SimJob, Workload

DEVICE = DeviceProfile("test", {"m1": ModelSpeed(0.1, 0.01, 2.0, warm_s=0.5, switch_s=0.01),
                                "m2": ModelSpeed(0.1, 0.01, 3.0, warm_s=0.5, switch_s=0.01)},
                       revoke_delay_s=0.05, prefill_chunk=256, keeps=SWITCH)


def arrival(t, job_id, kind, model, out=10):
    return Arrival(t, SimJob(Job(job_id, kind, model, kind), 100, out))


def ends(events):
    return [(e["model"], e["swap_kind"], e["seconds"], e.get("abandoned", False))
            for e in events if e["ev"] == "swap_end"]


@pytest.mark.parametrize("keeps, back", [(COLD, 2.0), (WARM, 0.5), (SWITCH, 0.01)])
def test_a_model_comes_back_as_the_profile_keeps_it_and_the_swaps_are_counted_by_kind(keeps, back):
    w = Workload("back", 0, "", arrivals=(arrival(0, "a", "nataraj", "m1"), arrival(0, "b", "gana", "m2"),
                                          arrival(5.0, "c", "nataraj", "m1")))   # while b runs
    policy = SchedulerPolicy()
    events = simulate(policy, w, replace(DEVICE, keeps=keeps)).events
    validate(events)
    kinds = [e["swap_kind"] for e in events if e["ev"] == "swap_end"]
    assert ends(events)[-1] == ("m1", keeps, back, False) and kinds[:2] == [COLD, COLD]
    m = measure(events)
    assert m.swaps_by_kind == {COLD: 2} | ({keeps: 1} if keeps != COLD else {COLD: 3})
    assert m.swap_s_by_kind[COLD] == pytest.approx(5.0 + (2.0 if keeps == COLD else 0))
    assert swap_s_per_device_h(m) == pytest.approx(m.swap_s / (m.makespan_s / 3600))
    # R12: after the last swap (to m1), a swap back to m2 would cost what the profile keeps it at
    assert policy.snapshot()["swap_cost_s"]["dev0"]["m2"] == {COLD: 3.0, WARM: 0.5, SWITCH: 0.01}[keeps]


def test_a_chat_gives_up_a_swap_to_another_model_and_waits_for_one_to_its_own():
    """A Nataraj's cold load of m2 (3 s, from 3 s on) under way when a chat on m1 arrives at 4 s:
    the load is given up at once and m1 comes back as a switch; a chat on m2 waits for the load."""
    def run(chat_model):
        w = Workload("r13", 0, "", arrivals=(arrival(0, "first", "nataraj", "m1", out=1),
                                             arrival(0.5, "n", "nataraj", "m2"), arrival(4.0, "c", "chat", chat_model)))
        events = simulate(SchedulerPolicy(), w, DEVICE).events
        validate(events)
        first_token = next(e["t"] for e in events if e["ev"] == "first_token" and e["job"] == "c")
        return ends(events), first_token
    other, first_token = run("m1")
    assert other[1:] == [("m2", COLD, pytest.approx(1.0), True), ("m1", SWITCH, 0.01, False),
                         ("m2", COLD, 3.0, False)] and first_token < 6.0   # the Nataraj ran after, loading anew
    own, first_token = run("m2")
    assert not any(abandoned for *_, abandoned in own) and first_token > 6.0
