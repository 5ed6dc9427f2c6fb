"""Issue 37 in the scheduler's shell, with fake devices and no Ray: every swap's kind and time
reach the event log, `status` and the policy (R12: what the next swap to each model would
cost), a chat never waits for a swap to another model than its own (R13), and the warm start
loads the chat model before the runtime is ready."""
from __future__ import annotations

import asyncio

import pytest

from conftest import FakeDevice, ManualClock, lease_of, spec
from uniun_ray.events.log import read
from uniun_ray.models.swap import COLD, HOST, RESIDENT, SWITCH, WARM, Swap
from uniun_ray.runtime.driver import COPY_BYTES_PER_S, FIRST_SWITCH_S, DeviceDriver
from uniun_ray.runtime.service import RuntimeConfig, SchedulerService
from uniun_ray.runtime.warmstart import WarmStart


class WarmDevice(FakeDevice):
    """Keeps every model it swapped out warm: a swap back is a warm copy of `warm_s`."""

    def __init__(self, cold_s: float, warm_s: float) -> None:
        super().__init__(load_s=cold_s)
        self.cold_s, self.warm_s = cold_s, warm_s

    async def load(self, model_id: str) -> Swap:
        warm = model_id in self.loads
        self.load_s = self.warm_s if warm else self.cold_s
        await super().load(model_id)
        kept = {m: HOST for m in dict.fromkeys(self.loads) if m != model_id}
        return Swap(model_id, WARM if warm else COLD, self.load_s, kept=kept)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def one_job(s: SchedulerService, job_id: str, model: str) -> None:
    await s.submit(spec(job_id, "nataraj", model=model))
    lease = await lease_of(s, job_id)
    await s.release(job_id, lease.epoch, "done")


def test_each_swaps_kind_and_time_reach_the_log_the_status_and_the_policy(tmp_path):
    async def go():
        s = SchedulerService(WarmDevice(cold_s=0.05, warm_s=0.001),
                             RuntimeConfig(event_log=str(tmp_path / "ev.jsonl"), reap_period_s=0.05))
        costs = []   # what a swap away from the loaded model costs, as the policy has it
        for n, (model, other) in enumerate((("a", "b"), ("b", "a"), ("a", "b"), ("b", "a"))):
            await one_job(s, f"n{n}", model)
            costs.append(s.policy.snapshot()["swap_cost_s"]["dev0"].get(other))
        return costs, await s.status()
    costs, status = run(go())
    # after b's cold load a's swap back would be a warm copy of unknown size, none measured yet:
    # its cold time; once a came back warm, b's first copy back is priced at a's (`_first`)
    assert costs == [None, 0.05, 0.001, 0.001]
    swaps = status["devices"][0]["swaps"]
    assert (swaps["last"]["kind"], swaps["last"]["kept"]) == (WARM, {"a": HOST})
    assert swaps["measured"] == {"a": {COLD: 0.05, WARM: 0.001}, "b": {COLD: 0.05, WARM: 0.001}}
    ends = [e for e in read(tmp_path / "ev.jsonl") if e["ev"] == "swap_end"]
    assert [(e["model"], e["swap_kind"], e["seconds"]) for e in ends] == [
        ("a", COLD, 0.05), ("b", COLD, 0.05), ("a", WARM, 0.001), ("b", WARM, 0.001)]


def test_a_chat_abandons_a_swap_to_another_model_and_waits_for_its_own():
    """R13: a Nataraj's swap in flight to y is given up for a chat on m (the chat does not
    wait for y's load), and the Nataraj runs later; a swap to the chat's own model is waited
    for and serves the chat, loaded once."""
    async def go(chat_model: str):
        clock = ManualClock()
        dev = FakeDevice(load_s=0.3, clock=clock)
        s = SchedulerService(dev, RuntimeConfig(reap_period_s=0.05), clock=clock)
        await s.submit(spec("n", "nataraj", model="y"))
        await clock.advance(0.05)                  # loading y
        await s.submit(spec("c", "chat", model=chat_model))
        await clock.advance(0.35)                  # m's load, or the rest of y's
        chat = await lease_of(s, "c")
        await s.release("c", chat.epoch, "done")
        await clock.advance(0.35)                  # y's load again, where it was given up
        again = await lease_of(s, "n")             # requeued, not failed: the job is not lost
        await s.release("n", again.epoch, "done")
        return dev
    other = run(go("m"))
    assert (other.abandoned, other.loads) == (["y"], ["m", "y"])
    own = run(go("y"))
    assert (own.abandoned, own.loads) == ([], ["y"])


def test_the_warm_start_loads_the_chat_model_before_it_is_ready_and_the_first_chat_swaps_nothing():
    async def go():
        dev = FakeDevice(load_s=0.1)
        s = SchedulerService(dev, RuntimeConfig(reap_period_s=0.05, chat_model="m"))
        warm = WarmStart(s)
        assert await warm.ready(wait=False) == "m on dev0"    # what /health names while it loads
        assert await warm.ready() is None and dev.loads == ["m"]
        await s.submit(spec("c", "chat", model="m"))
        chat = await lease_of(s, "c")
        assert chat.swap_s == 0.0 and dev.loads == ["m"]
        await s.release("c", chat.epoch, "done")
        # a device the policy gave work first is left alone
        busy = SchedulerService(FakeDevice(load_s=0.1), RuntimeConfig(reap_period_s=0.05, chat_model="m"))
        await busy.submit(spec("n", "nataraj", model="y"))
        assert await WarmStart(busy).ready() is None
        await lease_of(busy, "n")
        assert busy.drivers["dev0"].device.loads == ["y"]
    run(go())


def test_the_jobs_that_joined_an_abandoned_swap_go_back_to_their_queue_revoked_not_failed(tmp_path):
    """Two slots: a second Nataraj on y joins the device while y loads; a chat on m empties the
    device (R22), the load is given up, and both go back to their queue as revoked (no device
    fault), then run."""
    async def go():
        clock = ManualClock()
        dev = FakeDevice(load_s=0.3, clock=clock)
        s = SchedulerService(dev, RuntimeConfig(reap_period_s=0.05, slots=2, event_log=str(tmp_path / "ev.jsonl")),
                             clock=clock)
        await s.submit(spec("n1", "nataraj", model="y"))
        await s.submit(spec("n2", "nataraj", model="y"))
        await clock.advance(0.05)                  # loading y, both dispatched
        await s.submit(spec("c", "chat", model="m"))
        await clock.advance(0.35)                  # m's load
        chat = await lease_of(s, "c")
        await s.release("c", chat.epoch, "done")
        await clock.advance(0.35)                  # y's load again
        for job in ("n1", "n2"):
            lease = await lease_of(s, job)
            await s.release(job, lease.epoch, "done")
        return dev
    dev = run(go())
    assert dev.abandoned == ["y"] and dev.loads == ["m", "y"]
    finishes = [(e["job"], e["outcome"]) for e in read(tmp_path / "ev.jsonl") if e["ev"] == "finish"]
    assert sorted(finishes[:2]) == [("n1", "revoked"), ("n2", "revoked")]


class ScriptedDevice:
    """Answers each load with the next of `swaps`."""

    def __init__(self, swaps: list[Swap]) -> None:
        self.swaps = iter(swaps)

    async def load(self, model_id: str) -> Swap:
        swap = next(self.swaps)
        assert swap.model == model_id
        return swap


def priced(swaps: list[Swap]) -> list[dict[str, float]]:
    """What the driver prices the next swaps at after each of `swaps`."""
    async def go():
        driver, costs = DeviceDriver(ScriptedDevice(swaps)), []
        for swap in swaps:
            await driver.load(swap.model)
            costs.append(driver.swap_costs())
        return costs
    return run(go())


def test_a_first_swap_back_is_priced_for_its_kind_not_at_the_cold_cost():
    """Before a switch or a warm copy to a model was measured, the policy is given an estimate
    of that kind: a switch at FIRST_SWITCH_S, then at the dearest switch measured on the device;
    a warm copy at its bytes over the conservative rate, then over the rate a copy measured."""
    mb = 2**20
    switches = priced([Swap("a", COLD, 5.0), Swap("b", COLD, 8.0, "a", {"a": RESIDENT}),
                       Swap("a", SWITCH, 0.002, "b", {"b": RESIDENT}), Swap("b", SWITCH, 0.001, "a", {"a": RESIDENT})])
    assert switches == [{}, {"a": FIRST_SWITCH_S}, {"b": 0.002}, {"a": 0.002}]
    copies = priced([Swap("a", COLD, 5.0), Swap("b", COLD, 8.0, "a", {"a": HOST}, kept_bytes={"a": 100 * mb}),
                     Swap("a", WARM, 0.01, "b", {"b": HOST}, kept_bytes={"b": 300 * mb})])
    assert copies == [{}, {"a": 100 * mb / COPY_BYTES_PER_S}, {"b": pytest.approx(0.03)}]
    # never above the cold load it would otherwise be
    assert priced([Swap("a", COLD, 0.001), Swap("b", COLD, 8.0, "a", {"a": HOST}, kept_bytes={"a": 100 * mb})])[1] \
        == {"a": 0.001}


class GatedDevice(FakeDevice):
    """A load that ends only when the test opens its gate: no sleep races the probe."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def load(self, model_id: str) -> Swap:
        await self.gate.wait()
        return await super().load(model_id)


def test_health_answers_503_loading_until_the_warm_start_loaded_the_chat_model(monkeypatch):
    """/health (in-process app) asks the scheduler what its warm start still loads, as the
    SchedulerActor's `warming` answers it: a real WarmStart whose load the test holds open."""
    import threading

    from fastapi.testclient import TestClient

    from uniun_ray.http import app as app_module

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    async def build():
        device = GatedDevice()
        service = SchedulerService(device, RuntimeConfig(reap_period_s=0.05, chat_model="m"))
        return device, WarmStart(service)
    device, warm = on_loop(build())

    async def warming():   # the SchedulerActor's `warming`
        return warm.loading

    async def answers():
        return True
    monkeypatch.setattr(app_module, "scheduler_answers", answers)
    monkeypatch.setattr(app_module, "warm_start_loading",
                        lambda: asyncio.wrap_future(asyncio.run_coroutine_threadsafe(warming(), loop)))
    client = TestClient(app_module.create_app())
    try:
        assert on_loop(warm.ready(wait=False)) == "m on dev0"
        for _ in range(2):   # however often it is asked while the load runs
            loading = client.get("/health")
            assert loading.status_code == 503 and "loading m on dev0" in loading.json()["error"]["message"]
        loop.call_soon_threadsafe(device.gate.set)
        assert on_loop(warm.ready()) is None and device.loads == ["m"]
        ready = client.get("/health")
        assert ready.status_code == 200 and ready.json() == {"status": "ok"}
    finally:
        loop.call_soon_threadsafe(loop.stop)
