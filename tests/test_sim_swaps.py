"""The simulator with swap kinds (issue 37), on its virtual clock: a model that was on the device
comes back as its profile keeps it (a switch, a warm copy), each swap's kind and seconds are
logged and counted, the policy is given what the next swap to each kept model costs (R12),
and a swap to another model than a chat's is given up for the chat (R13)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from uniun_ray.events.schema import COLD, SWITCH, WARM, validate
from uniun_ray.policy import Job, SchedulerPolicy
from uniun_ray.sim.device import GEMMA3, PROFILES, DeviceProfile, ModelSpeed
from uniun_ray.sim.metrics import chat_waits, measure, p99_chat, swap_s_per_device_h
from uniun_ray.sim.simulator import AUTO, simulate
from uniun_ray.sim.workload import Arrival, SimJob, Workload
from uniun_ray.sim.workloads import generate

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


# -- the pool goal's instruments (issue 37): the slots the runtime's "auto" gives, a chat's prefill,
# -- and what a chat waited for -------------------------------------------------------------------
#: m1 batches (4 jobs step in 0.16 s, one in 0.1 s; "auto" gives it 4; R23 keeps one job beside a
#: chat: step(2) = 0.12 s <= 1.25 x 0.1 s); m2 cannot (1 slot).
AUTO_DEVICE = DeviceProfile("auto", {"m1": ModelSpeed(0.1, 0.01, 2.0, ((1, 1.0), (4, 1.6)), switch_s=0.01,
                                                      auto_slots=4),
                                     "m2": ModelSpeed(0.1, 0.01, 3.0, switch_s=0.01)},
                            revoke_delay_s=0.05, prefill_chunk=10, keeps=SWITCH)


def nataraj(n, model, at=0.0, first=0, prompt=1, out=50):
    return tuple(Arrival(at, SimJob(Job(f"N{i}", "nataraj", model, f"nataraj:{i}"), prompt, out))
                 for i in range(first, first + n))


def test_with_auto_slots_a_device_takes_the_slots_of_each_model_it_loads():
    """As the runtime's default (R25): 1 slot before the first load, then after each swap the
    loaded model's own count, given to the policy (`set_slots`) and logged."""
    w = Workload("auto", 0, "", arrivals=nataraj(5, "m1") + nataraj(2, "m2", first=5))
    policy = SchedulerPolicy(slots=1)
    events = simulate(policy, w, AUTO_DEVICE, slots=AUTO).events
    validate(events)
    assert [(e["model"], e["slots"]) for e in events if e["ev"] == "slots"] == [("m1", 4), ("m2", 1)]
    assert max(e["batch"] for e in events if e["ev"] == "dispatch" and e["model"] == "m1") == 4
    assert policy.snapshot()["devices"][0]["slots"] == 1


def test_the_profiles_auto_slots_are_what_the_runtime_chooses_on_their_curves():
    from uniun_ray.models.runner.profile import CPU_BATCHES, CUDA_BATCHES, auto_slots

    for profile, sizes in ((PROFILES["cpu"], CPU_BATCHES), (PROFILES["gpu"], CUDA_BATCHES)):
        for model, speed in profile.models.items():
            chosen = auto_slots({b: speed.step_s(b) for b in sizes}) if model != GEMMA3 else 1  # sliding window
            assert speed.auto_slots == chosen, (profile.name, model)


def test_a_chat_reads_its_prompt_in_one_pass_beside_decoding_jobs():
    """As the engine's Batch (a chat's TTFT is the goal): a 100-token chat joining m1 beside a
    decoding Nataraj (kept there, R23) is one step of its whole prefill (1 s) plus what the
    Nataraj's row adds to a pass (step(1) - fixed = 0.02 s), not ten 10-token chunks each
    carrying that row (1.2 s)."""
    chat = Arrival(5.0, SimJob(Job("c", "chat", "m1", "chat"), 100, 5))
    w = Workload("one-pass", 0, "", arrivals=nataraj(1, "m1", prompt=1, out=200) + (chat,))
    events = simulate(SchedulerPolicy(slots=2), w, AUTO_DEVICE, slots=2).events
    validate(events)
    assert not any(e["ev"] == "revoke" for e in events)
    first = next(e["t"] for e in events if e["ev"] == "first_token" and e["job"] == "c")
    speed = AUTO_DEVICE.speed("m1")
    assert first - 5.0 == pytest.approx(1.0 + speed.step_s(1) - speed.fixed_s, abs=0.1)  # joins at the next step


def test_chat_waits_say_what_the_p99_chat_waited_for():
    """A chat arriving while a Gana loads m2 on one slot: the load is given up (R13), m1 comes
    back as a switch; then its own prefill. A second chat behind it on one slot queues behind it."""
    w = Workload("waits", 0, "", arrivals=(
        Arrival(0.0, SimJob(Job("n", "nataraj", "m1", "nataraj"), 1, 1)),
        Arrival(0.5, SimJob(Job("g", "gana", "m2", "gana"), 100, 50)),
        Arrival(3.0, SimJob(Job("c1", "chat", "m1", "chat:1"), 200, 30)),
        Arrival(3.5, SimJob(Job("c2", "chat", "m1", "chat:2"), 50, 5))))
    events = simulate(SchedulerPolicy(), w, AUTO_DEVICE).events
    waits = {w.job: w for w in chat_waits(events)}
    c1, c2 = waits["c1"], waits["c2"]
    assert c1.behind == ("1 gana",) and c1.swap == pytest.approx(0.01) and c1.prefill_tokens == 200
    assert c1.compute == pytest.approx(2.0) and c1.ttft == pytest.approx(c1.queued + c1.swap + c1.compute)
    assert c2.behind == ("1 chat",) and c2.queued > 3.0 and c2.swap == 0.0
    assert p99_chat(events) == max(waits.values(), key=lambda w: w.ttft) and "behind 1 chat" in c2.describe()


def test_the_pool_chats_workload_has_over_a_hundred_chats():
    chats = [e for e in simulate(SchedulerPolicy(slots=1), generate("pool_chats", 1), PROFILES["cpu-warm"],
                                 slots=AUTO).events if e["ev"] == "first_token" and e["kind"] == "chat"]
    assert len(chats) >= 100


def test_with_auto_slots_no_dispatch_exceeds_the_count_its_model_got_on_the_device():
    """R25 during a swap: once a model's count is known on a device (its first load's end), a
    swap back to it dispatches no more jobs than that count (gemma-3-270m: 1, a sliding window)
    while it loads, not the previous model's 16. Only a first load, whose count is not known
    yet, may get the previous count's jobs (the engine queues those beyond its own)."""
    profile = PROFILES["cpu-warm"]
    events = simulate(SchedulerPolicy(slots=1), generate("pool_chats", 1), profile, slots=AUTO).events
    measured, over = set(), []
    for e in events:
        if e["ev"] == "slots":
            measured.add((e["device"], e["model"]))
        elif e["ev"] == "dispatch" and e["batch"] > profile.speed(e["model"]).auto_slots:
            over.append(((e["device"], e["model"]) in measured, e["job"]))
    assert sum(e["ev"] == "dispatch" and e["model"] == GEMMA3 for e in events) > 200
    assert [job for known, job in over if known] == []
