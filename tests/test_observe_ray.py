"""Observability on a real local Ray (issue 5): the uniun_ metrics reach the node's metrics
endpoint, the status view puts queued jobs in their tiers, the event log replays into the
timeline the holders saw, and `explain` names who a waiting chat waited behind."""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import pytest
import ray
from rich.console import Console

import uniun_ray
from long_run import MAX_LONG_TOKENS
from waits import started, until, withdraw
from uniun_ray.client import agenerate, arun, astatus
from uniun_ray.observe.explain import explain
from uniun_ray.observe.statusview import render
from uniun_ray.events.log import read
from uniun_ray.events.trace import Trace

pytestmark = pytest.mark.ray


def metrics_text() -> str:
    """The Prometheus text of this node's metrics endpoint (Ray serves the custom metrics of
    every worker there, prefixed `ray_`)."""
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


def sample(text: str, name: str, **tags) -> float | None:
    """The value of the first sample of `name` whose labels include `tags`. A session cluster
    also serves the series of earlier tests' (killed) actors: pin `WorkerId` to tell them apart."""
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in tags.items()):
            return float(match.group(2))
    return None


async def chats_during_nataraj(long_tokens: int) -> dict:
    """A nataraj generates; chat A arrives (revokes it), then chat B arrives behind A."""
    nataraj = asyncio.ensure_future(agenerate("nataraj", "a card", model_id="tiny", max_new_tokens=long_tokens))
    await started("nataraj")
    chat_a = asyncio.ensure_future(agenerate("chat", "hold on", model_id="tiny", max_new_tokens=long_tokens))
    await started("chat")
    chat_b = await agenerate("chat", "hello", model_id="tiny", max_new_tokens=8)
    return {"nataraj": await nataraj, "a": await chat_a, "b": chat_b}


def test_metrics_reach_the_node_metrics_endpoint_after_a_job(runtime, long_tokens):
    asyncio.run(chats_during_nataraj(long_tokens))
    uniun_ray.embed(["a note"])
    wanted = {  # Ray exports every 2 s here (the session cluster's metrics_report_interval_ms)
        "ray_uniun_dispatches_total": {"kind": "chat", "tier": "T0", "model": "tiny"},
        "ray_uniun_revokes_total": {"kind": "nataraj", "cause": "arrival"},
        "ray_uniun_wait_seconds_count": {"kind": "chat", "tier": "T0"},
        "ray_uniun_ttft_seconds_count": {"kind": "chat", "model": "tiny"},
        "ray_uniun_swap_seconds_count": {"model": "tiny"},
        "ray_uniun_revoke_stop_seconds_count": {"model": "tiny"},
        "ray_uniun_queue_depth": {"tier": "T4"},
        "ray_uniun_loaded_model": {"model": "tiny"},
        "ray_uniun_vruntime": {"level": "kind", "flow": "nataraj"},
        "ray_uniun_t2_share_limit": {},
        "ray_uniun_embed_seconds_count": {},
        "ray_uniun_embed_in_flight": {},
    }
    scheduler = uniun_ray.status()["worker_id"]  # this test's scheduler, not an earlier test's
    deadline = time.monotonic() + 150  # generous: a loaded 2-core machine exports late
    while True:  # until an export taken after the whole run (both chats dispatched) is served
        uniun_ray.embed(["a note"])  # the in-flight gauge is set per call: keep it fresh for the export
        text = metrics_text()
        missing = [name for name, tags in wanted.items() if sample(text, name, **tags) is None]
        if not missing and sample(text, "ray_uniun_dispatches_total", kind="chat", WorkerId=scheduler) == 2:
            break
        assert time.monotonic() < deadline, f"not on the metrics endpoint: {missing}"
        time.sleep(1)
    assert sample(text, "ray_uniun_loaded_model", model="tiny", WorkerId=scheduler) == 1
    assert sample(text, "ray_uniun_t2_share_limit") == pytest.approx(0.6)  # the same in every series


def test_status_shows_queued_jobs_in_their_tiers(runtime):
    async def go():
        # a holder that outlasts the poll whatever the host's speed, withdrawn once it is seen
        holder = asyncio.ensure_future(agenerate("chat", "hold", model_id="tiny", max_new_tokens=MAX_LONG_TOKENS))
        await started("chat")
        await uniun_ray.aset_foreground("extract")
        queued = [agenerate("extract", "opened", model_id="tiny", foreground_hint=True, max_new_tokens=4),
                  agenerate("extract", "backfill", model_id="tiny", max_new_tokens=4),
                  agenerate("gana", "due", model_id="tiny", deadline=time.time() - 1, max_new_tokens=4),
                  agenerate("nataraj", "card", model_id="tiny", max_new_tokens=4)]
        tasks = [asyncio.ensure_future(q) for q in queued]

        async def all_queued():
            snap = await astatus()
            return snap if snap["queued"] == 4 else None
        snap = await until(all_queued, "the four jobs queued behind the chat")
        await uniun_ray.aset_foreground(None)
        await withdraw(holder)
        await asyncio.gather(*tasks)
        return snap
    snap = asyncio.run(go())
    tiers = {tier: [(j["kind"], j["foreground_hint"]) for j in jobs] for tier, jobs in snap["tiers"].items()}
    assert tiers == {"T0": [], "T1": [("extract", True)], "T2": [("extract", False)], "T3": [("gana", False)],
                     "T4": [("nataraj", False)]}
    console = Console(record=True, width=200)
    console.print(render(snap))
    text = console.export_text()
    assert re.search(r"▶ T0 chat .*held", text)
    for tier, jobs in snap["tiers"].items():
        for job in jobs:
            assert re.search(rf"│ {tier} .*{job['id']}", text), (tier, job["id"])


def test_replaying_the_event_log_reproduces_the_holders_timeline(make_runtime, long_tokens, tmp_path):
    log = tmp_path / "events.jsonl"
    make_runtime(event_log=str(log))
    held: list[tuple[str, float, float]] = []  # what each holder saw: (job, from, to)

    def work(tokens: int):
        async def hold(lease):
            began = time.time()
            try:
                return await lease.agenerate("go", max_new_tokens=tokens)
            finally:
                held.append((lease.lease.job_id, began, time.time()))
        return hold

    async def go():
        nataraj = asyncio.ensure_future(arun("nataraj", "tiny", work(long_tokens)))
        await started("nataraj")
        gana = asyncio.ensure_future(arun("gana", "tiny", work(16), deadline=time.time() - 1))
        await asyncio.sleep(0.1)
        await arun("chat", "tiny", work(16))
        await asyncio.gather(nataraj, gana)
        await astatus()     # a release is one-way: once it answers, the last finishes are logged
    asyncio.run(go())

    trace = Trace(read(log))
    runs = [run for run in trace.runs if run.job in {job for job, _, _ in held}]
    held.sort(key=lambda h: h[1])
    # every interval a holder saw lies inside a run of its job, in the same order; a run may
    # have had no holder (revoked while its lease was being granted: it ended unserved)
    remaining = iter(runs)
    for job, began, ended in held:
        run = next((r for r in remaining if r.job == job), None)
        assert run is not None, f"no run of {job} in the log after the previous holder's"
        assert run.start <= began and ended <= run.end, (run, began, ended)
    kinds = [trace.jobs[run.job].kind for run in runs]
    assert kinds[0] == "nataraj" and "chat" in kinds and kinds[-1] == "nataraj"
    assert {trace.jobs[r.job].kind: r.tier for r in runs if r.outcome == "done"} == {"nataraj": 4, "gana": 3, "chat": 0}


def test_explain_names_the_job_a_waiting_chat_waited_behind(make_runtime, long_tokens, tmp_path):
    make_runtime(event_log=str(tmp_path / "events.jsonl"))   # this test's runs only
    done = asyncio.run(chats_during_nataraj(long_tokens))
    events = read(uniun_ray.status()["event_log"])
    a, b, nataraj = done["a"].job_id, done["b"].job_id, done["nataraj"].job_id
    story_b = "\n".join(explain(events, b))
    assert re.search(rf"behind {a} \(chat from chat, T0, model tiny(, device cpu0)?\) for \d+\.\d+s", story_b), story_b
    story_a = "\n".join(explain(events, a))
    assert f"behind {nataraj} (nataraj" in story_a and f"arrival of chat job {a}" in story_a, story_a
    story_n = "\n".join(explain(events, nataraj))
    assert f"revoked: arrival of chat job {a}" in story_n and "re-queued" in story_n, story_n
