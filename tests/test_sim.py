"""The simulator, baselines, workloads, metrics, pictures and bench (issue 4). Fast, no Ray."""
from __future__ import annotations

from dataclasses import replace

import pytest

from uniun_ray.policy import Dispatch, Job, Kind, Requeued, Revoke, RevokeCause, SchedulerPolicy, Tier
from uniun_ray.sim import bench, plots
from uniun_ray.sim.baselines import Fifo, StrictPriority, TwoLaneQueue
from uniun_ray.sim.batch import Progress, plan
from uniun_ray.sim.device import DeviceProfile, ModelSpeed
from uniun_ray.events import log
from uniun_ray.events.schema import validate
from uniun_ray.sim.metrics import T2Window, jain_of, measure, t2_windows
from uniun_ray.sim.simulator import ContractError, simulate
from uniun_ray.events.trace import Trace
from uniun_ray.sim.workload import Arrival, Flow, FlowStep, SimJob, Workload
from uniun_ray.sim.workloads import SLOT_WORKLOADS, WORKLOADS, generate

# -- metrics on a hand-checked log ----------------------------------------------------------
JOBS = {  # id: (kind, producer, model, deadline)
    "A": ("nataraj", "nataraj", "m1", None),
    "B": ("gana", "gana:1", "m1", None),
    "E": ("extract", "extract", "m1", None),
    "C": ("chat", "chat", "m1", None),
    "D": ("gana", "gana:2", "m2", 13.0),
    "F": ("nataraj", "nataraj", "m2", None),
}


def ev(t, kind, job=None, **fields):
    event = {"t": t, "ev": kind}
    if job is not None:
        k, producer, model, deadline = JOBS[job]
        event.update(job=job, kind=k, producer=producer, model=model)
        if kind == "submit":
            event.update(deadline=deadline, foreground_hint=False, subject=None)
    event.update(fields)
    return event


HAND_LOG = [
    ev(0.0, "submit", "A"), ev(0.0, "submit", "B"), ev(0.0, "submit", "E"),
    ev(0.0, "dispatch", "A", swap=True), ev(0.0, "swap_start", "A", **{"from": None}), ev(1.0, "swap_end", "A"),
    ev(1.5, "first_token", "A"), ev(3.0, "finish", "A", outcome="done"),
    ev(3.0, "dispatch", "B", swap=False), ev(3.2, "first_token", "B"),
    ev(5.0, "submit", "C"), ev(5.0, "revoke", "B"), ev(5.5, "finish", "B", outcome="revoked"),
    ev(5.5, "dispatch", "C", swap=False), ev(6.5, "first_token", "C"), ev(7.0, "finish", "C", outcome="done"),
    ev(7.0, "dispatch", "E", swap=False), ev(7.5, "first_token", "E"), ev(9.0, "finish", "E", outcome="done"),
    ev(9.0, "dispatch", "B", swap=False), ev(11.0, "finish", "B", outcome="done"),
    ev(12.0, "submit", "D"), ev(12.0, "dispatch", "D", swap=True), ev(12.0, "swap_start", "D", **{"from": "m1"}),
    ev(14.5, "swap_end", "D"), ev(15.0, "first_token", "D"), ev(16.0, "finish", "D", outcome="done"),
    ev(16.0, "submit", "F"), ev(17.0, "dispatch", "F", swap=False), ev(17.5, "first_token", "F"),
    ev(18.0, "finish", "F", outcome="done"),
]


def test_hand_checked_log_gives_exact_metrics():
    validate(HAND_LOG)
    m = measure(HAND_LOG, window_s=10.0)
    assert (m.jobs, m.unfinished, m.makespan_s) == (6, 0, 18.0)
    # C: submitted 5.0, dispatched 5.5 (B stopped), first token 6.5.
    assert (m.chat_n, m.chat_failed) == (1, 0)
    assert m.ttft_p50 == m.ttft_p99 == m.ttft_max == pytest.approx(1.5)
    assert m.chat_delay_p99 == pytest.approx(0.5)
    assert m.revokes == 1
    assert (m.swaps, m.swap_s) == (2, pytest.approx(3.5))
    assert m.forced_swaps == 1  # the T0/T1 runs (C) use one model
    # R7: held time, dispatch to finish, swaps included; B pays for its revoked run too.
    assert m.service == pytest.approx({"nataraj": 4.0, "gana:1": 4.5, "chat": 1.5, "extract": 2.0, "gana:2": 4.0})
    # Only {nataraj, gana:1} are ever backlogged together, over [0, 3): A got 3 s, B none.
    assert m.jain_t4 == pytest.approx(0.5)
    assert jain_of(HAND_LOG, ["nataraj", "gana:1"]) == pytest.approx(0.5)
    # Window [0, 10): 10 s held, 2 s of it by E at T2, T4 outstanding throughout.
    # Window [10, 18): no T2, and no T3/T4 work during [11, 12).
    assert m.t2_share_max == pytest.approx(0.2)
    assert m.t2_share_max_t34_backlogged == pytest.approx(0.2)
    assert t2_windows(HAND_LOG, 10.0) == [T2Window(0.0, pytest.approx(10.0), pytest.approx(2.0), pytest.approx(2.0), True),
                                          T2Window(10.0, pytest.approx(6.0), 0.0, 0.0, False)]
    assert (m.t3_jobs, m.t3_late_max) == (1, pytest.approx(-1.0))  # D started 1 s before its deadline
    assert m.idle_while_waiting_s == pytest.approx(1.0)  # F waited on an idle device over [16, 17)
    assert m.longest_wait == pytest.approx({"nataraj": 1.0, "gana:1": 3.5, "extract": 7.0, "chat": 0.5})


def test_tiers_are_derived_from_the_log():
    trace = Trace(HAND_LOG)
    assert [(r.job, r.tier) for r in trace.runs] == [
        ("A", 4), ("B", 4), ("C", 0), ("E", 2), ("B", 4), ("D", 4), ("F", 4)]


# -- the simulator's costs ------------------------------------------------------------------
DEVICE = DeviceProfile("test", {"m1": ModelSpeed(0.1, 0.01, 2.0), "m2": ModelSpeed(0.1, 0.01, 3.0)},
                       revoke_delay_s=0.05, prefill_chunk=256)


def spec(job_id, kind, model, prompt, out):
    return SimJob(Job(job_id, kind, model, kind), prompt, out)


def times(events, kind, job):
    return [e["t"] for e in events if e["ev"] == kind and e["job"] == job]


def test_fifo_charges_swap_prefill_and_decode():
    w = Workload("tiny", 0, "", arrivals=(Arrival(0.0, spec("J1", "nataraj", "m1", 100, 10)),
                                          Arrival(1.0, spec("J2", "gana", "m2", 50, 5))))
    events = simulate(Fifo(), w, DEVICE).events
    validate(events)
    # J1: swap 0-2, prefill 100 x 0.01 gives token 1 at 3.0, 9 more steps of 0.1.
    assert times(events, "swap_end", "J1") == [2.0]
    assert times(events, "first_token", "J1") == [pytest.approx(3.0)]
    assert times(events, "finish", "J1") == [pytest.approx(3.9)]
    # J2 waits, swaps to m2 (3 s), prefills 50 tokens, decodes 4 more.
    assert times(events, "dispatch", "J2") == [pytest.approx(3.9)]
    assert times(events, "swap_end", "J2") == [pytest.approx(6.9)]
    assert times(events, "first_token", "J2") == [pytest.approx(7.4)]
    assert times(events, "finish", "J2") == [pytest.approx(7.8)]


@pytest.mark.parametrize("chat_at, stop, tokens", [
    (1.0, 2.05, 0),    # during the swap: the load completes, no token
    (2.5, 3.05, 1),    # during the prefill: it ends with the first token
    (3.25, 3.35, 4),   # while decoding: the next boundary is token 4 at 3.3
])
@pytest.mark.parametrize("kv_cache", [False, True])
def test_revoke_stops_at_next_token_boundary_plus_delay_and_resumes(chat_at, stop, tokens, kv_cache):
    w = Workload("tiny", 0, "", arrivals=(Arrival(0.0, spec("N", "nataraj", "m1", 100, 20)),
                                          Arrival(chat_at, spec("C", "chat", "m1", 10, 2))))
    device = replace(DEVICE, kv_cache_tokens=20_000 if kv_cache else 0)
    events = simulate(StrictPriority(), w, device).events
    finishes = [e for e in events if e["ev"] == "finish" and e["job"] == "N"]
    assert [(f["t"], f["outcome"], f["tokens"]) for f in finishes[:1]] == [(pytest.approx(stop), "revoked", tokens)]
    assert times(events, "dispatch", "C") == [pytest.approx(stop)]
    resume = stop + 0.2  # chat: 10-token prefill, one decode step
    # R6: without a cache, re-prefill prompt + produced tokens (recompute); with one, the KV read
    # before the revoke is kept and only the last produced token is read. Then decode the rest.
    prefilled = 1 if kv_cache and tokens else 100 + tokens
    end = resume + prefilled * 0.01 + (20 - tokens - 1) * 0.1
    assert (finishes[1]["t"], finishes[1]["outcome"], finishes[1]["tokens"]) == (pytest.approx(end), "done", 20)
    assert len(times(events, "first_token", "N")) == 1


@pytest.mark.parametrize("chat_at, stop, tokens, read", [
    (2.1, 2.45, 0, 40),    # in the first 40-token chunk (2.0-2.4): stops at its end, nothing produced
    (2.5, 2.85, 0, 80),    # in the second (2.4-2.8): without a KV cache the prefill done so far is lost
    (2.9, 3.05, 1, 100),   # in the last (2.8-3.0): it ends with the first token
])
@pytest.mark.parametrize("kv_cache", [False, True])
def test_a_revoke_in_prefill_stops_at_the_next_chunk_end(chat_at, stop, tokens, read, kv_cache):
    device = DeviceProfile("chunked", DEVICE.models, revoke_delay_s=0.05, prefill_chunk=40,
                           kv_cache_tokens=20_000 if kv_cache else 0)
    w = Workload("tiny", 0, "", arrivals=(Arrival(0.0, spec("N", "nataraj", "m1", 100, 20)),
                                          Arrival(chat_at, spec("C", "chat", "m1", 10, 2))))
    events = simulate(StrictPriority(), w, device).events
    finishes = [(e["t"], e["outcome"], e["tokens"]) for e in events if e["ev"] == "finish" and e["job"] == "N"]
    assert finishes[0] == (pytest.approx(stop), "revoked", tokens)
    first = times(events, "first_token", "N")
    assert len(first) == 1 and (first[0] < stop) == (tokens == 1)  # no token before the last chunk ends
    resume = stop + 0.2  # chat: 10-token prefill, one decode step
    # The resumed run reads the context again, in chunks (without a cache, all of it; with one,
    # what the revoked run had not read), then decodes the rest.
    prefilled = 100 + tokens - (read if kv_cache else 0)
    assert finishes[1] == (pytest.approx(resume + prefilled * 0.01 + (20 - tokens - 1) * 0.1), "done", 20)


def test_a_flow_keeps_its_depth_and_thinks_before_the_next_step():
    steps = (FlowStep(100, 10), FlowStep(100, 10), FlowStep(100, 10, think_s=0.5))
    w = Workload("tiny", 0, "", flows=(Flow("nataraj", "nataraj", "m1", 1.0, steps, depth=2),))
    events = simulate(Fifo(), w, DEVICE).events
    submits = [(e["job"], e["t"]) for e in events if e["ev"] == "submit"]
    # Two at the start; the third 0.5 s after the first one ends (swap 2 + 1.0 + 0.9).
    assert submits == [("nataraj#0", 1.0), ("nataraj#1", 1.0), ("nataraj#2", pytest.approx(5.4))]


def test_a_policy_that_breaks_the_contract_is_caught():
    class Greedy(Fifo):
        def submit(self, job, now):
            super().submit(job, now)
            return [Dispatch(job.id, job.model_id, True, Tier.FAIR)]

    w = Workload("tiny", 0, "", arrivals=(Arrival(0.0, spec("J1", "nataraj", "m1", 10, 5)),
                                          Arrival(0.1, spec("J2", "nataraj", "m1", 10, 5))))
    with pytest.raises(ContractError, match="while 'J1' is running"):
        simulate(Greedy(), w, DEVICE)


# -- the baselines' defining behaviour ------------------------------------------------------
def job(job_id, kind, model="m1"):
    return Job(job_id, Kind(kind), model)


def test_two_lane_chat_waits_behind_nataraj_on_the_high_lane():
    q = TwoLaneQueue()
    assert q.submit(job("n1", "nataraj"), 0.0) == [Dispatch("n1", "m1", True, Tier.FAIR)]
    assert q.submit(job("n2", "nataraj"), 0.1) == []
    assert q.submit(job("c", "chat"), 0.2) == []  # no preemption
    assert q.finish("n1", 5.0, "done") == [Dispatch("n2", "m1", False, Tier.FAIR)]  # FIFO on the high lane
    assert q.finish("n2", 9.0, "done") == [Dispatch("c", "m1", False, Tier.CHAT)]


def test_two_lane_pauses_the_low_lane_while_chat_is_in_front():
    q = TwoLaneQueue()
    q.set_foreground(Kind.CHAT, 0.0)
    assert q.submit(job("e", "extract"), 1.0) == []  # idle device, paused lane
    assert q.set_foreground(None, 2.0) == [Dispatch("e", "m1", True, Tier.EXTRACT)]


def test_fifo_never_preempts():
    q = Fifo()
    q.submit(job("n", "nataraj"), 0.0)
    q.submit(job("e", "extract"), 0.5)
    assert q.submit(job("c", "chat"), 1.0) == []
    assert q.finish("n", 2.0, "done") == [Dispatch("e", "m1", False, Tier.EXTRACT)]


def test_strict_priority_preempts_and_requeues_in_place():
    q = StrictPriority()
    q.submit(job("n1", "nataraj"), 0.0)
    q.submit(job("n2", "nataraj"), 0.1)
    assert q.submit(job("c", "chat", "m2"), 1.0) == [Revoke("n1", RevokeCause.ARRIVAL)]
    assert q.finish("n1", 1.1, "revoked") == [Requeued("n1"), Dispatch("c", "m2", True, Tier.CHAT)]  # no affinity: swap
    assert q.finish("c", 2.0, "done") == [Dispatch("n1", "m1", True, Tier.FAIR)]  # n1 kept its place


# -- workloads ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list({**WORKLOADS, **SLOT_WORKLOADS}))
def test_workloads_are_reproducible_from_their_seed(name):
    w = generate(name, 7)
    assert w.to_json() == generate(name, 7).to_json()
    assert w.to_json() != generate(name, 8).to_json()
    assert Workload.from_json(w.to_json()) == w


@pytest.mark.parametrize("name", ["issue118", "backfill", "ganas", "foreground"])
def test_real_policy_runs_every_workload_to_the_end(name):
    result = simulate(SchedulerPolicy(), generate(name, 1))
    validate(result.events)
    assert result.unfinished == []


def test_a_simulated_day_runs_in_seconds():
    result = simulate(SchedulerPolicy(), generate("mixed_day", 1))
    jobs = sum(e["ev"] == "submit" for e in result.events)
    print(f"\nmixed_day: {jobs} jobs, {result.end / 3600:.1f} simulated hours, {result.wall_s:.2f} s wall")
    assert result.unfinished == []


# -- pictures and the bench ------------------------------------------------------------------
def test_pictures_render_from_a_jsonl_log(tmp_path):
    result = simulate(SchedulerPolicy(), generate("issue118", 1))
    log.write(result.events, tmp_path / "run.jsonl")
    trace = Trace(log.read(tmp_path / "run.jsonl"))
    plots.timeline(trace, tmp_path / "timeline.png", "issue118")
    plots.service(trace, tmp_path / "service.png")
    plots.ttft_cdf({"uniun": trace}, tmp_path / "ttft.png")
    assert all((tmp_path / f).stat().st_size > 0 for f in ("timeline.png", "service.png", "ttft.png"))


def test_bench_writes_tables_and_goals(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--workloads", "issue118", "ganas", "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "## issue118" in text and "## Goals" in text and "| two-lane |" in text
    assert (tmp_path / "bench.md").read_text().strip() == text.strip()
    assert (tmp_path / "workloads" / "ganas.json").exists()


# -- a pool of devices (SPEC §5) ------------------------------------------------------------
def test_a_pool_runs_jobs_on_different_models_at_once_and_names_the_device():
    w = Workload("tiny", 0, "", arrivals=(Arrival(0.0, spec("A", "nataraj", "m1", 10, 50)),
                                          Arrival(0.0, spec("B", "gana", "m2", 10, 5)),
                                          Arrival(1.0, spec("C", "chat", "m2", 10, 2))))
    devices = ("d0", "d1")
    events = simulate(SchedulerPolicy(devices=devices), w, DEVICE, devices).events
    validate(events)
    runs: dict = {}
    for e in events:
        if e["ev"] == "dispatch":
            runs.setdefault(e["job"], e)  # each job's first run
    assert (runs["A"]["device"], runs["B"]["device"]) == ("d0", "d1") and runs["A"]["t"] == runs["B"]["t"] == 0.0
    # the chat on m2 revokes the runner that holds m2 (R18), then runs there without a swap
    assert [(e["job"], e["device"]) for e in events if e["ev"] == "revoke"] == [("B", "d1")]
    assert runs["C"]["device"] == "d1" and runs["C"]["swap"] is False
    assert all("device" in e for e in events if e["ev"] in ("dispatch", "swap_start", "swap_end", "first_token",
                                                             "revoke", "finish"))
    assert Trace(events).devices == {"d0": None, "d1": None} and measure(events).idle_while_waiting_s == 0.0


def test_bench_devices_writes_the_pool_table_and_goals(tmp_path, capsys):
    assert bench.main(["--devices", "1,2", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "pool.md").read_text()
    assert "| devices | background tok/h |" in text and "| 2 |" in text
    assert "background throughput >= 1.8x at 2 devices" in text and "swaps per device-hour" in text
    with pytest.raises(SystemExit):
        bench.main(["--devices", "0,x"])


def test_a_conversation_turn_prefills_only_its_new_message_and_a_swap_empties_the_cache():
    steps = (FlowStep(50, 10), FlowStep(80, 10, think_s=1.0))   # turn 2 = turn 1 (60) + a 20-token message
    talk = Flow("chat:u", "chat", "m1", 0.0, steps, conversation=True)
    swapper = Arrival(3.0, spec("G", "gana", "m2", 10, 2))       # between the turns: a swap to m2 and back
    for arrivals, expected in (((), [50, 80 - 60]), ((swapper,), [50, 80])):
        events = simulate(Fifo(), Workload("talk", 0, "", arrivals=arrivals, flows=(talk,)), DEVICE).events
        prefills = [e["prefill_tokens"] for e in events if e["ev"] == "dispatch" and e["kind"] == "chat"]
        assert prefills == expected
    no_cache = simulate(Fifo(), Workload("talk", 0, "", flows=(talk,)), replace(DEVICE, kv_cache_tokens=0)).events
    assert [e["prefill_tokens"] for e in no_cache if e["ev"] == "dispatch"] == [50, 80]


def test_prefill_chunks_are_sized_by_time_unless_fixed():
    assert DeviceProfile("t", DEVICE.models).chunk_tokens(ModelSpeed(0.1, 0.01, 2.0)) == 20   # two decode steps
    assert DEVICE.chunk_tokens(ModelSpeed(0.1, 0.01, 2.0)) == 256
    timed = DeviceProfile("timed", DEVICE.models, revoke_delay_s=0.05)
    w = Workload("tiny", 0, "", arrivals=(Arrival(0.0, spec("N", "nataraj", "m1", 100, 20)),
                                          Arrival(2.25, spec("C", "chat", "m1", 10, 2))))
    finish = next(e for e in simulate(StrictPriority(), w, timed).events if e["ev"] == "finish")
    assert finish["t"] == pytest.approx(2.4 + 0.05)   # the 20-token chunk under way (2.2-2.4) ends first


# -- slots: several jobs decoding together on one device (SPEC §6) ----------------------------
#: m1 steps 4 jobs in 0.2 s (twice one job's 0.1 s): 4 jobs get 20 tok/s where one gets 10.
BATCHED = DeviceProfile("batched", {"m1": ModelSpeed(0.1, 0.01, 2.0, ((1, 1.0), (4, 2.0))),
                                    "m2": ModelSpeed(0.1, 0.01, 3.0)}, revoke_delay_s=0.05, prefill_chunk=256)


def nataraj(n, prompt=1, out=101, at=0.0, model="m1", first=0):
    return tuple(Arrival(at, SimJob(Job(f"N{i}", "nataraj", model, f"nataraj:{i}"), prompt, out))
                 for i in range(first, first + n))


def slotted(arrivals, slots, device=BATCHED, devices=("dev0",)):
    w = Workload("slots", 0, "", arrivals=tuple(sorted(arrivals, key=lambda a: a.t)))
    events = simulate(SchedulerPolicy(devices=devices, slots=slots), w, device, devices, slots).events
    validate(events)
    return events


def test_one_job_on_a_device_with_slots_runs_as_on_a_device_with_one():
    w = Workload("one", 0, "", arrivals=nataraj(1, prompt=300, out=20))
    one, four = (simulate(SchedulerPolicy(slots=s), w, BATCHED, slots=s).events for s in (1, 4))
    assert [(e["ev"], e["t"]) for e in one] == [(e["ev"], pytest.approx(e["t"])) for e in four]


def test_a_batch_decodes_each_job_a_token_per_step_of_the_batch_size():
    events = slotted(nataraj(4), slots=4)
    assert [(e["job"], e["slot"], e["swap"]) for e in events if e["ev"] == "dispatch"] == [
        ("N0", 0, True), ("N1", 1, False), ("N2", 2, False), ("N3", 3, False)]
    # After the 2 s load the four prefills (1 token each) ride one per step; once N3 has its first
    # token, N0 has 4 and every step of 0.2 s gives each job one: 4 tokens per 0.2 s, 20 tok/s.
    assert times(events, "first_token", "N0") == [pytest.approx(2.01)]
    last_joined = times(events, "first_token", "N3")[0]
    assert times(events, "finish", "N0") == [pytest.approx(last_joined + (101 - 4) * 0.2)]
    alone = slotted(nataraj(1), slots=4)          # one job: 10 tok/s
    assert times(alone, "finish", "N0") == [pytest.approx(2.01 + 100 * 0.1)]


def test_a_device_never_holds_more_jobs_than_its_slots():
    events = slotted(nataraj(7, prompt=50, out=30) + nataraj(3, prompt=50, out=30, model="m2", first=7), slots=3,
                     devices=("d0", "d1"))
    held, most = {"d0": 0, "d1": 0}, 0
    for e in events:
        if e["ev"] == "dispatch":
            held[e["device"]] += 1
            assert e["batch"] == held[e["device"]] <= 3 and 0 <= e["slot"] < 3
        elif e["ev"] == "finish":
            held[e["device"]] -= 1
        most = max(most, *held.values())
    assert most == 3 and measure(events).batch_max == 3


def test_a_revoke_stops_one_job_at_the_next_step_and_the_others_go_on():
    extract = Arrival(3.0, SimJob(Job("E", "extract", "m1"), 1, 5))
    events = slotted(nataraj(2) + (extract,), slots=2)
    # N1's one-token prefill rides in N0's step from 2.01: one pass, 0.01 s of chunk plus what N0's
    # row adds to a pass, step(1) less the curve's fixed part (2 step(1) - step(2) = 0.0667 s).
    assert times(events, "first_token", "N1") == [pytest.approx(2.01 + 0.01 + 0.1 - 0.2 / 3)]
    # Then they step together (0.1333 s a step at batch 2); the extract outranks them with no slot
    # free: one revoke, of the last dispatched, which stops at the end of the step under way.
    revokes = [(e["job"], e["batch"], e["cause"]) for e in events if e["ev"] == "revoke"]
    assert revokes == [("N1", 2, "arrival")]
    stop = times(events, "first_token", "N1")[0] + 8 * (0.1 + 0.1 / 3)
    n1 = [(e["t"], e["outcome"], e["tokens"]) for e in events if e["ev"] == "finish" and e["job"] == "N1"]
    assert n1[0] == (pytest.approx(stop + 0.05), "revoked", 1 + 8)
    # N1 hands its slot to E at once (R22); E joins at the very step boundary where N1 stops,
    # before N1's finish is even reported, and its prefill rides in N0's step as N1's did
    assert [(e["t"], e["slot"]) for e in events if e["ev"] == "dispatch" and e["job"] == "E"] == [(3.0, 1)]
    assert times(events, "first_token", "E") == [pytest.approx(stop + 0.01 + 0.1 - 0.2 / 3)]
    n0 = [(e["outcome"], e["tokens"]) for e in events if e["ev"] == "finish" and e["job"] == "N0"]
    assert n0 == [("done", 101)]   # never stopped: its tokens kept coming beside the stop and the join
    trace = Trace(events)
    assert [(r.job, r.revoke_batch, r.revoke_cause) for r in trace.runs if r.revoked_at] == [("N1", 2, "arrival")]
    assert {(r.job, r.batch) for r in trace.runs} >= {("N0", 1), ("N1", 2), ("E", 2)}


def test_the_contract_with_slots_is_checked():
    class Cramming(Fifo):   # dispatches every job at once, in slot 0
        def submit(self, job, now):
            return [Dispatch(job.id, job.model_id, job.id == "N0", Tier.FAIR)]

    with pytest.raises(ContractError, match="slot 0 while 'N0' is running"):
        simulate(Cramming(), Workload("cram", 0, "", arrivals=nataraj(2)), BATCHED, slots=2)

    class Swapping(Fifo):   # swaps a device that still holds a job
        def submit(self, job, now):
            return [Dispatch(job.id, job.model_id, True, Tier.FAIR, slot=int(job.id[1:]))]

    with pytest.raises(ContractError, match="a device swaps only when empty"):
        simulate(Swapping(), Workload("swap", 0, "", arrivals=nataraj(2)), BATCHED, slots=2)
    with pytest.raises(ContractError, match="slot 2: it has 2 slot"):
        simulate(Swapping(), Workload("far", 0, "", arrivals=nataraj(1, first=2)), BATCHED, slots=2)


def test_idle_while_waiting_counts_a_device_idle_beside_a_full_one():
    log = [ev(0.0, "submit", "A"), ev(0.0, "submit", "B"), ev(0.0, "submit", "E"),
           ev(0.0, "dispatch", "A", swap=True, device="d0"), ev(0.0, "dispatch", "B", swap=False, device="d0", batch=2),
           ev(0.0, "dispatch", "E", swap=True, device="d1"), ev(1.0, "finish", "E", outcome="done", device="d1"),
           ev(2.0, "submit", "F"), ev(5.0, "finish", "A", outcome="done", device="d0"),
           ev(5.0, "dispatch", "F", swap=True, device="d0"), ev(6.0, "finish", "F", outcome="done", device="d0"),
           ev(6.0, "finish", "B", outcome="done", device="d0")]
    m = measure(log)
    assert m.idle_while_waiting_s == pytest.approx(3.0)   # F waited [2, 5) while d1 held nothing
    assert (m.batch_mean, m.batch_max) == (pytest.approx(5 / 4), 2)


def test_bench_slots_writes_the_slot_table_and_goals(tmp_path, capsys):
    assert bench.main(["--slots", "1,2", "--workloads", "issue118", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "slots.md").read_text()
    assert "| slots | background tok/h |" in text and "\n| 2 |" in text
    assert "issue118: chat TTFT p99 <= the first's + one step, at 2 slots" in text
    assert "issue118: swaps per device-hour no more, at 2 slots" in text


def test_a_step_reads_the_chunk_of_the_best_tier_joiner_first():
    speed = BATCHED.speed("m1")
    background, chat = Progress(500, 500, 10, 500, 0, tier=4), Progress(50, 50, 10, 50, 0, tier=0)
    epoch = plan([background, chat], 0.0, speed, 256)
    assert (epoch.reader, epoch.chunk, epoch.count) == (chat, 50, 1)
    assert epoch.advance(epoch.end) == [chat] and (chat.tokens, background.to_read) == (1, 500)
