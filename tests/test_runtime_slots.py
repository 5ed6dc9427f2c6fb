"""Slots on a real device (SPEC §6, issue 25): several jobs in the ModelActor's one decode loop,
on real Ray with the `tiny` model. Each job keeps its own lease, revoke, stream and output."""
from __future__ import annotations

import asyncio

import pytest
import ray

import uniun_ray
from uniun_ray.client import agenerate, astatus
from uniun_ray.events.log import read as read_events
from uniun_ray.policy import PolicyConfig

from waits import started, until

pytestmark = pytest.mark.ray

PROMPTS = ["def parse(text):", "class Queue:\n    def", "import json\nimport os\n\ndef load(path):"]


def decoded_together(completion) -> float:
    return max(run["mean_batch"] or 0.0 for run in completion.prefills)


def test_background_jobs_share_the_device_and_each_decodes_as_it_would_alone(make_runtime, tmp_path):
    handles = make_runtime(slots=3, event_log=str(tmp_path / "events.jsonl"))

    async def go():
        alone = [await agenerate("gana", p, model_id="tiny", producer=f"gana:{i}", max_new_tokens=48)
                 for i, p in enumerate(PROMPTS)]
        together = await asyncio.gather(*(agenerate("gana", p, model_id="tiny", producer=f"gana:{i}",
                                                    max_new_tokens=48) for i, p in enumerate(PROMPTS)))
        return alone, together
    alone, together = asyncio.run(go())
    assert [c.text for c in together] == [c.text for c in alone]          # greedy: token-identical
    assert max(decoded_together(c) for c in alone) == 1.0
    assert max(decoded_together(c) for c in together) > 1.0               # they shared steps
    status = uniun_ray.status()
    device = status["devices"][0]
    assert device["slots"] == 3 and device["step_profile"] and device["slots_auto"] is False
    events = read_events(status["event_log"])
    assert [e["slots"] for e in events if e["ev"] == "slots"] == [3]
    assert max(e["batch"] for e in events if e["ev"] == "dispatch") == 3
    steps = ray.get(handles.model.state.remote())["slots"]["steps_by_batch"]
    assert max(steps) > 1
    served = ray.get(handles.model.steps.remote())     # what the scheduler asks a busy device (R23)
    assert served["model"] == "tiny" and set(served["step_profile"]) >= set(device["step_profile"])
    assert all(served["step_profile"][rows] > 0 for rows in steps)   # the sizes it served are in it


def test_a_chat_on_a_full_device_revokes_one_job_and_the_others_decode_on(make_runtime, long_tokens, tmp_path):
    """R22 on the device: no free slot, so the chat revokes exactly the lowest-ranked job (all
    are T4: the one dispatched last, the gana) and takes its slot at once; the gana resumes
    from its tokens afterwards; the others are never stopped. R23 is kept out of the way (a
    host whose steps grow fast would keep nothing beside the chat: tested in the policy and
    the service)."""
    make_runtime(PolicyConfig(chat_step_slack=100.0), slots=3, event_log=str(tmp_path / "events.jsonl"))

    async def go():
        pages = [asyncio.ensure_future(agenerate("nataraj", f"page {i}", model_id="tiny", producer=f"nataraj:{i}",
                                                 max_new_tokens=long_tokens)) for i in range(2)]
        await until(lambda: _running(2), "both pages on the device")  # the gana is dispatched last
        gana = asyncio.ensure_future(agenerate("gana", "agent", model_id="tiny", producer="gana:A",
                                               max_new_tokens=long_tokens))
        await started("gana")
        await until(lambda: _running(3), "three jobs on the device")
        chat = await agenerate("chat", "hello", model_id="tiny", max_new_tokens=16)
        return chat, await gana, await asyncio.gather(*pages)
    chat, gana, pages = asyncio.run(go())
    assert chat.revokes == 0 and chat.tokens == 16
    assert gana.revokes == 1 and gana.tokens == long_tokens
    resumed = gana.prefills[-1]
    assert resumed["prompt_tokens"] - resumed["cached_tokens"] <= 2      # its KV was kept
    assert [p.revokes for p in pages] == [0, 0]
    events = read_events(uniun_ray.status()["event_log"])
    revokes = [e for e in events if e["ev"] == "revoke"]
    assert [(e["kind"], e["cause"]) for e in revokes] == [("gana", "arrival")]
    # the chat took the gana's slot at once (R22's handover), before the gana's run ended
    chat_dispatch = next(e for e in events if e["ev"] == "dispatch" and e["kind"] == "chat")
    gana_dispatch, gana_end = (next(e for e in events if e["ev"] == ev and e["kind"] == "gana")
                               for ev in ("dispatch", "finish"))
    assert chat_dispatch["slot"] == gana_dispatch["slot"] and chat_dispatch["t"] < gana_end["t"]


def test_a_cancelled_job_frees_its_slot_for_the_next(make_runtime, long_tokens):
    make_runtime(slots=2)

    async def go():
        first = asyncio.ensure_future(agenerate("gana", "one", model_id="tiny", producer="gana:A",
                                                max_new_tokens=long_tokens))
        second = asyncio.ensure_future(agenerate("gana", "two", model_id="tiny", producer="gana:B",
                                                 max_new_tokens=long_tokens))
        await until(lambda: _running(2), "both slots taken")
        third = asyncio.ensure_future(agenerate("gana", "three", model_id="tiny", producer="gana:C",
                                                max_new_tokens=8))
        await asyncio.sleep(0.5)
        assert not third.done()                       # no slot for it yet
        first.cancel()                                # the caller goes away: its slot frees
        done = await third
        second.cancel()
        return done
    third = asyncio.run(go())
    assert third.tokens == 8


async def _running(count: int) -> bool:
    status = await astatus()
    leases = status["leases"]
    return sum(1 for j in status["devices"][0]["jobs"] if leases.get(j["id"], {}).get("state") == "granted") >= count
