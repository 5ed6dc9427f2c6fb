"""The scheduler shell's lease protocol, with a fake device and no Ray (Ollama's
sched_test.go style): grants, fencing, revoke during a load, reclaiming dead holders and
dropping dead waiters. Whatever turns on time (a timeout, a deadline, a load in progress, the
reaper) runs on a `ManualClock`: driven, never slept for, so a busy host cannot change it."""
from __future__ import annotations

import asyncio

import pytest

from conftest import FakeDevice, ManualClock, lease_of, spec
from uniun_ray.runtime.protocol import JobDropped, QueueFull, UniunError
from uniun_ray.runtime.service import RuntimeConfig, SchedulerService


FAST = RuntimeConfig(lease_timeout_s=0.3, waiter_timeout_s=0.3, reap_period_s=0.05, max_queued=50)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_grant_after_swap_then_release_hands_over():
    async def go():
        dev = FakeDevice(load_s=0.05)
        s = SchedulerService(dev, FAST)
        await s.submit(spec("n1", "nataraj"))
        await s.submit(spec("n2", "nataraj"))
        lease = await lease_of(s, "n1")
        assert (lease.model_id, lease.swap_s, dev.loads) == ("m", 0.05, ["m"])
        assert await s.grant("n2", wait_s=0.05) is None       # still queued
        assert await s.release("n1", lease.epoch, "done") is False
        lease2 = await lease_of(s, "n2")
        assert lease2.epoch > lease.epoch and dev.loads == ["m"]  # no second swap
    run(go())


def test_chat_revokes_the_holder_which_resumes_after():
    async def go():
        dev = FakeDevice()
        s = SchedulerService(dev, FAST)
        await s.submit(spec("n", "nataraj"))
        lease = await lease_of(s, "n")
        await s.submit(spec("c", "chat"))
        await asyncio.sleep(0.01)
        assert dev.revoked == [lease.epoch]
        assert await s.renew("n", lease.epoch) is False          # the holder learns it too
        assert await s.release("n", lease.epoch, "revoked") is True   # re-queued
        chat = await lease_of(s, "c")
        await s.release("c", chat.epoch, "done")
        again = await lease_of(s, "n")
        assert again.epoch > chat.epoch
    run(go())


def test_revoke_during_a_model_load_never_grants_the_stale_job():
    async def go():
        clock = ManualClock()
        dev = FakeDevice(load_s=0.2, clock=clock)
        s = SchedulerService(dev, FAST, clock=clock)
        await s.submit(spec("g", "gana", model="y"))
        await clock.advance(0.05)                  # loading y
        await s.submit(spec("c", "chat", model="m"))
        await clock.advance(0.25)                  # y's load given up for the chat, m's ends
        chat = await lease_of(s, "c")              # g ended its turn unserved, chat swapped in
        assert dev.abandoned == ["y"] and dev.loads == ["m"] and chat.model_id == "m"   # R13: y's swap given up
        assert s.policy.job_state("g") == "queued"
    run(go())


def test_dead_holder_lease_is_reclaimed_and_the_device_moves_on():
    async def go():
        clock = ManualClock()
        dev = FakeDevice()
        s = SchedulerService(dev, FAST, clock=clock)
        await s.submit(spec("n", "nataraj"))
        lease = await lease_of(s, "n")                 # ... and the holder dies: no renew, no release
        await s.submit(spec("e", "extract"))
        await clock.advance()
        assert dev.revoked == [lease.epoch]            # e outranks n (R4), but n's holder never answers
        for _ in range(5):                             # the waiter keeps polling
            await clock.advance(0.05)
            assert await s.grant("e", wait_s=0) is None   # 0.25 s unrenewed: n's, within the lease timeout (0.3 s)
        await clock.advance(0.1)
        nxt = await lease_of(s, "e")                   # past it: reclaimed
        assert nxt.epoch > lease.epoch
        with pytest.raises(JobDropped, match="lease reclaimed"):
            await s.release("n", lease.epoch, "done")
    run(go())


def test_dead_waiter_is_dropped_and_nothing_leaks():
    async def go():
        clock = ManualClock()
        s = SchedulerService(FakeDevice(), FAST, clock=clock)
        await s.submit(spec("c", "chat"))
        chat = await lease_of(s, "c")
        await s.submit(spec("n", "nataraj"))       # its caller never polls
        for _ in range(5):                         # the chat holder stays alive
            await clock.advance(0.1)
            assert await s.renew("c", chat.epoch) is True
        with pytest.raises(JobDropped, match="stopped polling"):
            await lease_of(s, "n")
        await s.release("c", chat.epoch, "done")
        snap = await s.status()
        assert snap["queued"] == 0 and snap["running"] is None
    run(go())


def test_stale_and_double_release_are_refused():
    async def go():
        s = SchedulerService(FakeDevice(), FAST)
        await s.submit(spec("n", "nataraj"))
        lease = await lease_of(s, "n")
        with pytest.raises(JobDropped, match="no longer held"):
            await s.release("n", lease.epoch + 1, "done")
        with pytest.raises(ValueError, match="did not revoke"):
            await s.release("n", lease.epoch, "revoked")
        await s.release("n", lease.epoch, "done")
        with pytest.raises(JobDropped, match="ended: done"):
            await s.release("n", lease.epoch, "done")
    run(go())


def test_failed_load_fails_the_job_and_the_next_one_runs():
    async def go():
        dev = FakeDevice(fail={"broken"})
        s = SchedulerService(dev, FAST)
        await s.submit(spec("a", "gana", model="broken"))
        await s.submit(spec("b", "gana", model="m", producer="p2"))
        with pytest.raises(RuntimeError, match="cannot load broken"):
            await lease_of(s, "a")
        lease = await lease_of(s, "b")
        assert lease.model_id == "m" and dev.loads == ["m"]
    run(go())


def test_a_fault_of_the_schedulers_own_while_preparing_a_job_is_logged_recorded_and_fails_that_job(tmp_path, caplog):
    """The spawned `_prepare` task: an exception of the scheduler's own code there (here: handing
    out the lease, injected) is logged with its traceback, kept in `status` and the event log,
    and fails the job it held visibly (its holder's grant raises); the next job runs."""
    from uniun_ray.events.log import read

    async def go():
        s = SchedulerService(FakeDevice(), RuntimeConfig(event_log=str(tmp_path / "ev.jsonl"), reap_period_s=0.05))
        hand_out = s.leases.hand_out

        def broken_once(tracked, lease):
            if tracked.job.id == "a":
                raise RuntimeError("injected")
            hand_out(tracked, lease)
        s.leases.hand_out = broken_once
        await s.submit(spec("a", "gana"))
        await s.submit(spec("b", "gana", producer="p2"))
        with pytest.raises(UniunError, match="failed preparing it: RuntimeError: injected"):
            await lease_of(s, "a")
        lease = await lease_of(s, "b")
        await s.release("b", lease.epoch, "done")
        return await s.status()
    with caplog.at_level("ERROR", logger="uniun_ray.runtime.service"):
        status = run(go())
    assert [f["error"] for f in status["faults"]] == ["RuntimeError: injected"] and status["leases"] == {}
    assert status["devices"][0]["jobs"] == []   # the policy holds nothing for it
    logged = [r for r in caplog.records if "preparing a" in r.getMessage()]
    assert logged and logged[0].exc_info is not None          # with its traceback
    events = [(e["ev"], e["job"], e.get("outcome")) for e in read(tmp_path / "ev.jsonl") if e.get("job") == "a"]
    assert events[-2:] == [("fault", "a", None), ("finish", "a", "failed")]


def test_a_fault_after_the_fence_ends_the_epoch_it_fenced():
    """A fault of the scheduler's own after the job's epoch was fenced (here: handing out its
    lease, injected) fails the job and ends that epoch as a revoke does: the driver keeps it no
    more among the live ones (the next grant fences it) and the device refuses it at once."""
    async def go():
        dev = FakeDevice()
        s = SchedulerService(dev, FAST)
        driver, hand_out, fenced = next(iter(s.drivers.values())), s.leases.hand_out, []

        def broken_once(tracked, lease):
            if tracked.job.id == "a":
                fenced.append(lease.epoch)
                raise RuntimeError("injected")
            hand_out(tracked, lease)
        s.leases.hand_out = broken_once
        await s.submit(spec("a", "gana"))
        with pytest.raises(UniunError, match="failed preparing it"):
            await lease_of(s, "a")
        await asyncio.sleep(0.01)
        assert fenced and fenced[0] not in driver.live and fenced[0] in dev.revoked
        await s.submit(spec("b", "gana", producer="p2"))
        lease = await lease_of(s, "b")
        assert driver.live == {lease.epoch}   # its grant names b alone
        await s.release("b", lease.epoch, "done")
    run(go())


def test_cancel_queued_and_running():
    async def go():
        dev = FakeDevice()
        s = SchedulerService(dev, FAST)
        await s.submit(spec("n1", "nataraj"))
        await s.submit(spec("n2", "nataraj"))
        await s.submit(spec("n3", "nataraj"))
        lease = await lease_of(s, "n1")
        await s.cancel("n2")
        with pytest.raises(JobDropped, match="cancelled"):
            await lease_of(s, "n2")
        await s.cancel("n1")                       # running: fenced and finished at once
        await asyncio.sleep(0.01)
        assert lease.epoch in dev.revoked
        assert (await lease_of(s, "n3")).epoch > lease.epoch
        await s.cancel("n1")                       # idempotent
    run(go())


def test_deadline_timer_preempts_without_any_call():
    async def go():
        clock = ManualClock()
        dev = FakeDevice()
        s = SchedulerService(dev, RuntimeConfig(reap_period_s=10.0), clock=clock)
        await s.submit(spec("n", "nataraj"))
        lease = await lease_of(s, "n")
        await s.submit(spec("g", "gana", deadline=clock.time() + 0.2))
        await clock.advance(0.19)
        assert dev.revoked == []
        await clock.advance(0.02)                  # at the deadline (R5), not at the reaper's next round (10 s)
        assert dev.revoked == [lease.epoch]
    run(go())


def test_a_waiter_polling_through_a_revoked_load_gets_its_later_grant():
    async def go():
        clock = ManualClock()
        dev = FakeDevice(load_s=0.2, clock=clock)
        s = SchedulerService(dev, RuntimeConfig(waiter_timeout_s=30), clock=clock)
        await s.submit(spec("g", "gana", model="y"))
        waiting = asyncio.ensure_future(s.grant("g", wait_s=5))   # one long poll
        await clock.advance(0.05)
        await s.submit(spec("c", "chat", model="y"))              # revokes g while it loads
        await clock.advance(0.2)
        chat = await lease_of(s, "c")
        await s.release("c", chat.epoch, "done")
        lease = await waiting                                     # the same poll is answered
        assert lease is not None and lease.job_id == "g"
    run(go())


def test_bounded_queue_raises_queue_full_naming_the_limit():
    async def go():
        s = SchedulerService(FakeDevice(), FAST)
        for i in range(50):
            await s.submit(spec(f"e{i}", "extract"))
        with pytest.raises(QueueFull, match="extract queue is full: 50 jobs .* limit max_queued=50"):
            await s.submit(spec("e50", "extract"))
        await s.submit(spec("n", "nataraj"))          # other kinds are not affected
        assert s.policy.queued + (s.policy.running_job is not None) == 51
    run(go())


def test_event_log_tells_the_story_in_the_simulator_schema(tmp_path):
    from uniun_ray.events.log import read
    from uniun_ray.events.schema import validate

    async def go():
        dev = FakeDevice(load_s=0.01)
        s = SchedulerService(dev, RuntimeConfig(event_log=str(tmp_path / "ev.jsonl"), reap_period_s=0.05))
        await s.submit(spec("n", "nataraj"))
        lease = await lease_of(s, "n")
        await s.report_first_token("n", lease.epoch)
        await s.submit(spec("c", "chat"))
        await s.release("n", lease.epoch, "revoked")
        chat = await lease_of(s, "c")
        await s.release("c", chat.epoch, "done")
        again = await lease_of(s, "n")
        await s.release("n", again.epoch, "done")
    run(go())
    events = read(tmp_path / "ev.jsonl")
    validate(events)
    story = [(e["ev"], e.get("job")) for e in events]
    assert story == [("submit", "n"), ("dispatch", "n"), ("swap_start", "n"), ("swap_end", "n"),
                     ("first_token", "n"), ("submit", "c"), ("revoke", "n"), ("finish", "n"),
                     ("dispatch", "c"), ("finish", "c"), ("dispatch", "n"), ("finish", "n")]
    assert events[6]["reason"] == "arrival of chat job c"


def test_event_log_rotates_and_reads_back_in_order(tmp_path):
    from uniun_ray.events.log import EventLog, read

    log = EventLog(tmp_path / "ev.jsonl", max_bytes=2_000, backups=50)
    for i in range(300):
        log.write({"t": float(i), "ev": "foreground", "kind": None, "subject": None})
    log.close()
    assert len(list(tmp_path.glob("ev.jsonl.*"))) > 3
    assert [e["t"] for e in read(tmp_path / "ev.jsonl")] == [float(i) for i in range(300)]


def test_a_cancel_that_overtakes_its_submit_refuses_the_submit():
    """The client's first call (`acquire`) both submits and waits; a caller interrupted
    meanwhile cancels, and that cancel may reach the scheduler first: the submit is then
    refused, so nothing is left queued for a caller that is gone."""
    async def go():
        s = SchedulerService(FakeDevice(), FAST)
        await s.cancel("n")
        with pytest.raises(JobDropped, match="before its submit arrived"):
            await s.acquire(spec("n", "nataraj"), 0.1, "session")
        assert (await s.status())["queued"] == 0
        lease = await s.acquire(spec("m", "nataraj"), 1.0, "session")   # one call: queued and granted
        assert lease.job_id == "m"
    run(go())


# -- a pool of devices (SPEC §5) ---------------------------------------------------------------
def pool(n: int = 2, **fake) -> dict:
    return {f"cpu{i}": FakeDevice(**fake) for i in range(n)}


def test_two_jobs_on_two_models_run_at_once_each_on_its_own_device(tmp_path):
    from uniun_ray.events.log import read

    async def go():
        devices = pool()
        s = SchedulerService(devices, RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        await s.submit(spec("n", "nataraj", model="a"))
        await s.submit(spec("g", "gana", model="b"))
        n, g = await lease_of(s, "n"), await lease_of(s, "g")    # both held at the same time
        assert (n.device, g.device) == ("cpu0", "cpu1") and n.epoch != g.epoch
        assert (devices["cpu0"].loads, devices["cpu1"].loads) == (["a"], ["b"])
        snap = await s.status()
        assert [(d["device"], d["loaded_model"], d["running"]["id"]) for d in snap["devices"]] == \
            [("cpu0", "a", "n"), ("cpu1", "b", "g")]
        await s.release("n", n.epoch, "done")
        await s.release("g", g.epoch, "done")
    run(go())
    runs = {(e["ev"], e["job"]): e.get("device") for e in read(tmp_path / "ev.jsonl") if "job" in e}
    assert runs[("dispatch", "n")] == runs[("swap_end", "n")] == runs[("finish", "n")] == "cpu0"
    assert runs[("dispatch", "g")] == runs[("swap_start", "g")] == runs[("finish", "g")] == "cpu1"


def test_a_chat_on_a_busy_pool_revokes_exactly_the_lowest_ranked_job_at_its_own_device():
    async def go():
        devices = pool()
        s = SchedulerService(devices, FAST)
        await s.submit(spec("e", "extract"))                       # T2
        await s.submit(spec("n", "nataraj"))                       # T4: the lowest ranked
        e, n = await lease_of(s, "e"), await lease_of(s, "n")
        await s.submit(spec("c", "chat"))
        await asyncio.sleep(0.01)
        assert devices[n.device].revoked == [n.epoch] and devices[e.device].revoked == []
        assert await s.renew("e", e.epoch) is True                  # the other job runs on
        assert await s.release("n", n.epoch, "revoked") is True
        chat = await lease_of(s, "c")
        assert chat.device == n.device and chat.epoch > max(e.epoch, n.epoch)
    run(go())


def test_a_restarted_scheduler_fences_above_what_each_device_saw():
    async def go():
        devices = pool()
        devices["cpu0"].epoch, devices["cpu1"].epoch = 41, 7       # granted by the previous incarnation
        s = SchedulerService(devices, FAST)
        await s.submit(spec("n", "nataraj", model="a"))
        await s.submit(spec("g", "gana", model="b"))
        n, g = await lease_of(s, "n"), await lease_of(s, "g")
        assert n.epoch > 41 and g.epoch > 7 and n.epoch != g.epoch
        await s.release("g", g.epoch, "done")
        await s.submit(spec("g2", "gana", model="b"))
        assert (await lease_of(s, "g2")).epoch > max(n.epoch, g.epoch)   # one clock for the pool
    run(go())


def test_a_device_gone_for_good_leaves_the_pool_and_its_job_completes_on_another(tmp_path):
    from uniun_ray.events.log import read

    async def go():
        devices = pool()
        s = SchedulerService(devices, RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        await s.submit(spec("n", "nataraj", model="a"))
        await s.submit(spec("g", "gana", model="b"))
        n, g = await lease_of(s, "n"), await lease_of(s, "g")
        devices["cpu0"].gone = True                                  # killed under n
        assert await s.device_lost("n", n.epoch, "killed") is True   # re-queued
        assert [d["device"] for d in (await s.status())["devices"]] == ["cpu1"]
        assert await s.grant("n", wait_s=0.05) is None               # cpu1 is busy with g
        await s.release("g", g.epoch, "done")
        again = await lease_of(s, "n")
        assert again.device == "cpu1" and devices["cpu1"].loads == ["b", "a"]
        assert s.leases.jobs["n"].device_faults == 0                 # not the job's fault
        await s.release("n", again.epoch, "done")
    run(go())
    events = read(tmp_path / "ev.jsonl")
    removed = [e for e in events if e["ev"] == "device"]
    assert [(e["device"], e["change"]) for e in removed] == [("cpu0", "removed")]
    finishes = [(e["outcome"], e.get("requeued"), e["device"]) for e in events if e["ev"] == "finish" and e["job"] == "n"]
    assert finishes == [("failed", True, "cpu0"), ("done", False, "cpu1")]


def test_a_job_whose_device_is_gone_is_told_it_was_requeued_even_when_it_runs_again_at_once():
    async def go():
        devices = pool()
        s = SchedulerService(devices, FAST)
        await s.submit(spec("n", "nataraj"))
        lease = await lease_of(s, "n")
        devices[lease.device].gone = True
        assert await s.device_lost("n", lease.epoch, "killed") is True     # and already dispatched again
        assert (await lease_of(s, "n")).device != lease.device
    run(go())


def test_a_device_gone_while_loading_hands_its_job_to_another_device():
    async def go():
        clock = ManualClock()
        devices = pool(load_s=0.1, clock=clock)
        s = SchedulerService(devices, FAST, clock=clock)
        await s.submit(spec("n", "nataraj", model="a"))
        await clock.advance(0.02)                      # loading on cpu0 ...
        devices["cpu0"].gone = True                    # ... which dies
        await clock.advance(0.2)                       # its load ends so; cpu1's load of a follows
        lease = await lease_of(s, "n")
        assert lease.device == "cpu1" and s.policy.devices == ("cpu1",)
    run(go())


def test_a_restarted_device_stays_in_the_pool_and_reloads():
    async def go():
        devices = pool(1)
        s = SchedulerService(devices, FAST)
        await s.submit(spec("n", "nataraj", model="a"))
        lease = await lease_of(s, "n")
        assert await s.device_lost("n", lease.epoch, "restarted") is True    # it answers again: not gone
        again = await lease_of(s, "n")
        assert again.device == "cpu0" and devices["cpu0"].loads == ["a", "a"]
        assert s.leases.jobs["n"].device_faults == 1
    run(go())


def test_a_device_added_takes_waiting_work_at_once():
    async def go():
        s = SchedulerService(pool(1), FAST)
        await s.submit(spec("n", "nataraj"))
        await s.submit(spec("g", "gana"))
        await lease_of(s, "n")
        assert await s.grant("g", wait_s=0.05) is None
        s.add_device("cpu1", FakeDevice())
        assert (await lease_of(s, "g")).device == "cpu1"
        with pytest.raises(ValueError, match="already in the pool"):
            s.add_device("cpu1", FakeDevice())
    run(go())


# -- a device that leaves under its running job (its node died, issue 29) ----------------------
def test_a_busy_device_removed_puts_its_job_back_and_its_holder_resumes_elsewhere(tmp_path):
    from uniun_ray.events.log import read

    async def go():
        devices = pool()
        s = SchedulerService(devices, RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        for job in ("n", "g", "q"):
            await s.submit(spec(job, {"n": "nataraj", "g": "gana", "q": "nataraj"}[job]))
        n, g = await lease_of(s, "n"), await lease_of(s, "g")
        s.remove_device(n.device, "its node died")               # n runs there: back at its place
        assert await s.renew("g", g.epoch) is True
        assert await s.device_lost("n", n.epoch, "ActorDiedError") is True   # its calls failed with the node
        with pytest.raises(JobDropped):
            await s.renew("n", n.epoch)                          # that lease is over
        await s.release("g", g.epoch, "done")
        again = await lease_of(s, "n")                           # before q, queued after it (R6)
        assert again.device == g.device and again.epoch > g.epoch
        await s.release("n", again.epoch, "done")
        await s.release("q", (await lease_of(s, "q")).epoch, "done")
        assert s.policy.devices == (g.device,) and s.leases.jobs == {}
    run(go())
    finishes = [(e["job"], e["outcome"], e.get("requeued")) for e in read(tmp_path / "ev.jsonl") if e["ev"] == "finish"]
    assert finishes == [("n", "failed", True), ("g", "done", False), ("n", "done", False), ("q", "done", False)]


def test_a_holder_that_finished_as_its_device_left_ends_its_job_once():
    """The work completed, but the scheduler had already put the job back (its node died
    between the last token and the release): the job ends there, and is not run again."""
    async def go():
        devices = pool()
        s = SchedulerService(devices, FAST)
        await s.submit(spec("n", "nataraj"))
        n = await lease_of(s, "n")
        s.remove_device(n.device, "its node died")
        elsewhere = await lease_of(s, "n")                       # dispatched again at once ...
        assert await s.release("n", n.epoch, "done") is False    # ... and withdrawn: it was done
        await asyncio.sleep(0.01)
        assert devices[elsewhere.device].revoked == [elsewhere.epoch] and s.leases.jobs == {}
        assert s.policy.snapshot()["queued"] == 0 and not s.policy.running_jobs
    run(go())


def test_a_device_removed_while_loading_leaves_its_job_to_the_next_dispatch():
    """The load on a device that left the pool fails late: the job, already back in the queue
    and dispatched elsewhere, is neither failed by it nor counted a device fault."""
    import gc

    async def go():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        clock = ManualClock()
        devices = pool(load_s=0.1, clock=clock)
        s = SchedulerService(devices, FAST, clock=clock)
        await s.submit(spec("n", "nataraj", model="a"))
        await clock.advance(0.02)                                # loading on cpu0 ...
        devices["cpu0"].fail = {"a"}                             # ... which will fail
        s.remove_device("cpu0", "its node died")
        await clock.advance(0.1)                                 # cpu1 loads a; the stale load fails
        lease = await lease_of(s, "n")
        assert lease.device == "cpu1" and s.leases.jobs["n"].lease == lease
        assert s.leases.jobs["n"].device_faults == 0
        await s.release("n", lease.epoch, "done")
        gc.collect()                                             # a task that raised says so now
        assert errors == []                                      # the stale load ended quietly
    run(go())


class SlottedDevice(FakeDevice):
    """A device that chooses its slots after each load, as the ModelActor does (R25), with a
    slow CPU's step profile: a second row doubles a step of 100 ms, so nothing may decode beside
    a chat (R23: past both 1.25x its step alone and the floor)."""

    def __init__(self, slots: int = 3, profile: dict[int, float] | None = None) -> None:
        super().__init__()
        self.count, self.asked = slots, []
        self.profile = profile or {1: 0.1, 2: 0.2, 4: 0.4}

    async def slots(self, setting: int | None) -> dict:
        self.asked.append(setting)
        return {"slots": setting or self.count, "step_profile": dict(self.profile), "auto": setting is None}


class ServingDevice(SlottedDevice):
    """A slotted device that also says the step times it serves (`steps`, as the ModelActor):
    the profile measured at load until the test sets `served`."""

    def __init__(self, slots: int, profile: dict[int, float]) -> None:
        super().__init__(slots, profile)
        self.served: dict[int, float] | None = None
        self.steps_asked = 0

    async def steps(self) -> dict:
        self.steps_asked += 1
        return {"model": self.loads[-1] if self.loads else None, "step_profile": dict(self.served or self.profile)}


def test_the_step_times_a_busy_device_serves_reach_the_policy_and_bound_a_chats_companions():
    """R23: the profile measured at load lets both background jobs decode beside a chat (3 rows:
    70 ms, within the 75 ms floor); then the device serves slower steps (longer contexts, a busy
    host: 90 ms at 3 rows). The reaper's next round asks the busy device, the policy reacts: the
    lower-ranked background job is revoked, and status shows the served profile. An idle device
    is not asked."""
    async def go():
        clock = ManualClock()
        dev = ServingDevice(slots=3, profile={1: 0.050, 2: 0.060, 3: 0.070})
        s = SchedulerService(dev, RuntimeConfig(reap_period_s=1.0), clock=clock)
        for i in range(2):
            await s.submit(spec(f"n{i}", "nataraj", producer=f"nataraj:{i}"))
        leases = [await lease_of(s, f"n{i}") for i in range(2)]
        await s.submit(spec("c", "chat"))
        chat = await lease_of(s, "c")
        await clock.advance(1.0)
        assert dev.steps_asked == 1 and dev.revoked == []          # asked; nothing new served
        dev.served = {1: 0.050, 2: 0.060, 3: 0.090}
        await clock.advance(1.0)
        assert dev.steps_asked == 2 and dev.revoked == [leases[1].epoch]
        assert (await s.status())["devices"][0]["step_profile"] == dev.served
        assert await s.release("n1", leases[1].epoch, "revoked") is True
        await s.release("c", chat.epoch, "done")
        await s.release("n0", leases[0].epoch, "done")
        again = await lease_of(s, "n1")
        await s.release("n1", again.epoch, "done")
        await clock.advance(5.0)
        assert dev.steps_asked == 2                                # idle: not asked
    run(go())


def test_slots_fill_after_the_load_and_a_chat_keeps_its_step_by_revoking_its_companions(tmp_path):
    async def go():
        dev = SlottedDevice(slots=3)
        s = SchedulerService(dev, RuntimeConfig(event_log=str(tmp_path / "ev.jsonl")))
        for i in range(3):
            await s.submit(spec(f"n{i}", "nataraj", producer=f"nataraj:{i}"))
        leases = [await lease_of(s, f"n{i}") for i in range(3)]   # one slot until the load said 3
        while dev.live != tuple(sorted(lease.epoch for lease in leases)):   # the joiners' one grant notice
            await asyncio.sleep(0.01)
        assert dev.asked == [None]
        # no free slot: one revoke (R22), whose slot the chat takes at once, before the revoked
        # job released it; then R23: none may stay beside the chat
        await s.submit(spec("c", "chat"))
        chat = await lease_of(s, "c")
        await asyncio.sleep(0.01)                                  # (the revokes reach the device)
        assert sorted(dev.revoked) == sorted(lease.epoch for lease in leases)
        assert await s.release("n2", leases[2].epoch, "revoked") is True
        # the chat's grant reached the device (on its own, or before the revokes beside it), and
        # fences the companion that left already
        assert dev.epoch == chat.epoch and leases[2].epoch not in dev.live
        return await s.status()
    status = run(go())
    assert status["devices"][0]["slots"] == 3 and status["devices"][0]["slots_auto"] is True
    from uniun_ray.events.log import read
    causes = [(e["job"], e["cause"], e["reason"]) for e in read(tmp_path / "ev.jsonl") if e["ev"] == "revoke"]
    assert [c[:2] for c in causes] == [("n2", "arrival"), ("n1", "step"), ("n0", "step")]
    assert "step" in causes[1][2]


class OrderedDevice(FakeDevice):
    """A device that records its grants and revokes in the order they reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    async def grant(self, epoch: int, live: tuple[int, ...] = (), model: str | None = None) -> None:
        await super().grant(epoch, live, model)
        self.calls.append(("grant", epoch))

    async def revoke(self, epoch: int) -> None:
        await super().revoke(epoch)
        self.calls.append(("revoke", epoch))


def test_grant_notices_are_coalesced_and_a_revoke_comes_after_its_epochs_notice():
    async def go():
        dev = OrderedDevice()
        s = SchedulerService(dev, RuntimeConfig(grant_notice_s=60.0))
        epochs = []
        for i in range(4):                        # short jobs one after another: the first grant is
            await s.submit(spec(f"g{i}", "gana"))  # the swap's (confirmed), the others wait for a notice
            lease = await lease_of(s, f"g{i}")
            epochs.append(lease.epoch)
            await s.release(f"g{i}", lease.epoch, "done")
        await s.submit(spec("n", "nataraj"))
        held = await lease_of(s, "n")
        assert dev.calls == [("grant", epochs[0])]
        await s.submit(spec("c", "chat"))         # revokes n, an epoch the device was not told yet
        while len(dev.calls) < 3:
            await asyncio.sleep(0.01)
        # one notice for the four leases since (the newest), before the revoke that fences it
        assert dev.calls == [("grant", epochs[0]), ("grant", held.epoch), ("revoke", held.epoch)]
        assert dev.live == (held.epoch,)
    run(go())


def test_a_grant_notice_waits_at_most_its_period():
    async def go():
        dev = OrderedDevice()
        s = SchedulerService(dev, RuntimeConfig(grant_notice_s=0.5))
        leases = []
        for i in range(3):
            await s.submit(spec(f"g{i}", "gana"))
            leases.append(await lease_of(s, f"g{i}"))
            await s.release(f"g{i}", leases[-1].epoch, "done")
        while dev.epoch != leases[-1].epoch:      # no revoke: the waiting notice goes out by itself
            await asyncio.sleep(0.01)
        assert [epoch for _, epoch in dev.calls] == [leases[0].epoch, leases[-1].epoch]
    run(go())


def test_the_reaper_wakes_early_only_for_a_sooner_wake_up():
    from uniun_ray.runtime.reaper import Reaper

    async def go():
        clock = ManualClock()
        due, ticks = [None], []
        pending = lambda: due[0] if due[0] is not None and due[0] > clock.time() else None   # noqa: E731 (the policy's)
        reaper = Reaper(60.0, pending, lambda: ticks.append(clock.time()), lambda mono: (), None, clock=clock)
        reaper.ensure_running()
        await clock.advance(0.01)                 # asleep for its period: nothing is due
        reaper.rearm()                            # a submit without a deadline: it sleeps on
        await clock.advance(0.05)
        assert ticks == []
        rearmed, due[0] = clock.time(), clock.time() + 0.05   # one with a deadline: it wakes (and plans anew)
        reaper.rearm()
        await clock.advance(0.049)
        assert ticks == [rearmed]
        await clock.advance(0.002)                # at the deadline, long before its period
        assert ticks == [rearmed, due[0]]
        await clock.advance(59.0)                 # nothing due: it sleeps its period out
        assert len(ticks) == 2
        await clock.advance(1.0)
        assert len(ticks) == 3
        reaper._task.cancel()
    run(go())
