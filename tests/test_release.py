"""The one-way release (issue 25, control plane; `runtime.releases`): a client ends a lease
without waiting for the scheduler's answer, and the next `acquire` carries the releases not
sent yet or names those on their way. What the answer used to give must still hold:

- order: a caller's release is applied before its next submit is decided (Ray runs an async
  actor's calls out of order, in principle), on the protocol and through the client;
- nothing lost: a release on its way when the client process exits reaches the scheduler (no
  reclaim after the lease timeout);
- errors: a result produced under a lease that was reclaimed meanwhile is the caller's, the
  refused release is logged, and the reclaim is in the event log.
"""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FakeDevice, ManualClock, lease_of, spec
from uniun_ray import client
from uniun_ray.events.log import read as read_events
from uniun_ray.runtime import service as service_module
from uniun_ray.runtime.releases import RELEASES
from uniun_ray.runtime.service import RuntimeConfig, SchedulerService

ROOT = Path(__file__).parent.parent


def one_slot(tmp_path, clock=None) -> SchedulerService:
    return SchedulerService(FakeDevice(), RuntimeConfig(lease_timeout_s=0.3, waiter_timeout_s=0.3, reap_period_s=0.05,
                                                        event_log=str(tmp_path / "events.jsonl")), clock=clock)


def order(events: list[dict]) -> list[tuple[str, str]]:
    return [(e["ev"], e["job"]) for e in events if e["ev"] in ("submit", "finish")]


# -- on the protocol, with a fake device ---------------------------------------------------------
def test_an_acquire_applies_the_releases_it_carries_before_its_submit(tmp_path):
    async def go():
        clock = ManualClock()
        s = one_slot(tmp_path, clock)
        await s.submit(spec("a", "gana"))
        a = await lease_of(s, "a")
        b = await s.acquire(spec("b", "gana"), 1.0, released=(("a", a.epoch, "done"),))
        assert b is not None                     # the one slot was free for it at once
        # a release that arrived one-way already, or for a lease reclaimed meanwhile: nothing
        await s.submit(spec("c", "gana"))
        await s.release("b", b.epoch, "done")
        c = await lease_of(s, "c")
        await clock.advance(0.6)                 # c's holder stalls past the lease timeout: reclaimed
        d = await s.acquire(spec("d", "gana"), 1.0, released=(("b", b.epoch, "done"), ("c", c.epoch, "done")))
        assert d is not None
        await s.release("d", d.epoch, "done")
        return read_events(s.events.path)
    events = asyncio.run(asyncio.wait_for(go(), 10))
    assert order(events)[:3] == [("submit", "a"), ("finish", "a"), ("submit", "b")]
    assert [e["outcome"] for e in events if e["ev"] == "finish" and e["job"] in ("b", "c")] == ["done", "revoked"]
    assert [e["ev"] for e in events if e.get("job") == "c"][-2:] == ["reclaim", "finish"]


def test_an_acquire_waits_for_the_releases_it_names_before_its_submit(tmp_path, monkeypatch):
    async def go():
        s = one_slot(tmp_path)
        await s.submit(spec("a", "gana"))
        a = await lease_of(s, "a")
        # Ray delivers b's acquire before a's release, which its caller sent first
        b = asyncio.ensure_future(s.acquire(spec("b", "gana"), 1.0, after=(("a", a.epoch),)))
        await asyncio.sleep(0.05)
        assert "b" not in s.leases.jobs          # not submitted while a's release is on its way
        await s.release("a", a.epoch, "done")
        b = await b
        assert b is not None
        # a release that never comes (lost with its sender) holds a submit back RELEASE_WAIT_S only
        monkeypatch.setattr(service_module, "RELEASE_WAIT_S", 0.05)
        assert await s.acquire(spec("c", "gana"), 0.05, after=(("b", b.epoch),)) is None   # queued behind b
        await s.release("b", b.epoch, "done")
        await s.release("c", (await lease_of(s, "c")).epoch, "done")
        return read_events(s.events.path)
    events = asyncio.run(asyncio.wait_for(go(), 10))
    assert order(events) == [("submit", "a"), ("finish", "a"), ("submit", "b"), ("submit", "c"),
                             ("finish", "b"), ("finish", "c")]


# -- through the client, on the session's Ray -------------------------------------------------------
async def _empty(lease):
    return "ok"


@pytest.mark.ray
def test_jobs_back_to_back_each_start_after_the_release_before(runtime):
    """A tight loop on a one-slot device: each job's release (taken along by the next acquire,
    or sent alone when the next job starts a loop turn later) is applied before the next
    job's submit, so each submit finds the slot free."""
    async def go():
        for i in range(12):
            await client.arun("gana", "tiny", _empty)
            if i % 2:
                await asyncio.sleep(0)           # this release leaves alone, before the next acquire
        return await client.astatus()
    began = time.time()
    status = asyncio.run(go())
    assert status["leases"] == {} and status["queued"] == 0
    events = [e for e in read_events(status["event_log"]) if e.get("kind") == "gana" and e["t"] >= began]
    steps = order(events)
    assert len(steps) == 24
    assert all(ev == ("submit" if i % 2 == 0 else "finish") for i, (ev, _) in enumerate(steps)), steps
    assert all(steps[i][1] == steps[i + 1][1] for i in range(0, 24, 2))
    assert [e["outcome"] for e in events if e["ev"] == "finish"] == ["done"] * 12


@pytest.mark.ray
def test_a_result_produced_under_a_reclaimed_lease_is_kept_and_the_reclaim_logged(make_runtime, caplog):
    """The work outlives its lease (its heartbeat stalls past the lease timeout, so the lease is
    reclaimed): the caller still gets its result, the refused release is logged, and the
    event log says the lease was reclaimed."""
    make_runtime(lease_timeout_s=0.6, reap_period_s=0.1)

    async def stall(lease):
        time.sleep(2.0)                          # blocks the loop: no renewal (reclaimed after ~0.7 s)
        return "kept"

    async def go():
        job = await client.arun("gana", "tiny", stall)
        await RELEASES.settled()
        return job, await client.astatus()
    with caplog.at_level(logging.WARNING, logger="uniun_ray.runtime.releases"):
        result, status = asyncio.run(go())
    assert result == "kept"
    refused = [r.getMessage() for r in caplog.records if "was refused" in r.getMessage()]
    assert len(refused) == 1 and "lease reclaimed" in refused[0], refused
    job = refused[0].split()[1].rstrip(":")
    assert [e["ev"] for e in read_events(status["event_log"]) if e.get("job") == job][-3:] == \
        ["revoke", "reclaim", "finish"]


_EXITS_AT_ONCE = """
import sys
import uniun_ray
from uniun_ray.runtime.launch import connect
connect(sys.argv[1])
print(uniun_ray.run("gana", "tiny", lambda lease: lease.lease.job_id), flush=True)
"""


@pytest.mark.ray
def test_a_release_on_its_way_when_the_client_exits_reaches_the_scheduler(runtime, ray_cluster):
    """A script that exits right after its job: its release (sent one-way) is flushed at exit,
    so the job finishes "done" at once instead of its lease being reclaimed."""
    address = ray_cluster.get_runtime_context().gcs_address
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", _EXITS_AT_ONCE, address], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    job = done.stdout.strip().splitlines()[-1]
    status = asyncio.run(client.astatus())
    assert status["leases"] == {}, status["leases"]          # lease timeout 5 s: a lost release would show
    assert [(e["ev"], e.get("outcome")) for e in read_events(status["event_log"]) if e.get("job") == job][-1] == \
        ("finish", "done")
