"""The notes' eight scenarios end to end on a real local Ray with real models (`tiny`, a
1M-parameter GGUF at ~800 tok/s), plus the lease protocol's failure paths."""
from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import ray

import uniun_ray
from uniun_ray.client import agenerate, astatus
from uniun_ray.models import PromptTooLong, UnknownModel
from uniun_ray.policy import PolicyConfig
from uniun_ray.events.log import read as read_events

from waits import started

pytestmark = pytest.mark.ray

#: A second real model, for swaps: the chat model (converted for the chat tests anyway; Gemma's
#: first conversion alone would cost ~50 s of a cold run).
OTHER_MODEL = "smollm2-135m-instruct"


async def finish_order(*coros) -> list:
    """Run generations concurrently; return their Completions in the order they ended."""
    done = []

    async def one(coro):
        done.append(await coro)
    await asyncio.gather(*(one(c) for c in coros))
    return done


def test_scenario_1_chat_preempts_nataraj_within_one_token(runtime, long_tokens):
    async def go():
        nataraj = asyncio.ensure_future(agenerate("nataraj", "a card", model_id="tiny", max_new_tokens=long_tokens))
        await started("nataraj")
        chat = await agenerate("chat", "hello", model_id="tiny", max_new_tokens=16)
        card = await nataraj
        return chat, card
    chat, card = asyncio.run(go())
    stops = ray.get(runtime.model.state.remote())["stop_latency_s"]
    assert card.revokes == 1 and card.tokens == long_tokens  # resumed, not restarted
    resumed = card.prefills[-1]                            # from its KV, kept through the chat's run
    assert len(card.prefills) == 2 and resumed["prompt_tokens"] - resumed["cached_tokens"] <= 2
    assert chat.revokes == 0 and chat.tokens == 16
    assert len(stops) == 1 and stops[0] < 0.5              # stopped within a token boundary


def test_scenario_2_two_ganas_alternate(make_runtime, tmp_path):
    make_runtime(PolicyConfig(), event_log=str(tmp_path / "events.jsonl"))   # this test's runs only

    async def go():
        gate = asyncio.ensure_future(agenerate("chat", "hold", model_id="tiny", max_new_tokens=400))
        await started("chat")
        jobs = [agenerate("gana", f"{p}{i}", model_id="tiny", producer=f"gana:{p}", max_new_tokens=200)
                for i in range(3) for p in "AB"]
        order = await finish_order(gate, *jobs)
        return [c for c in order if c.job_id.startswith("gana")]
    ganas = asyncio.run(go())
    status = uniun_ray.status()
    producers = status["vruntime"]["producers"]["gana"]
    assert set(producers) == {"gana:A", "gana:B"}
    # neither monopolises: their charged times stay within one job of each other (the longest
    # run of a gana here: how long one takes depends on the host)
    longest = max(run_lengths(read_events(status["event_log"]), kind="gana"))
    assert abs(producers["gana:A"] - producers["gana:B"]) <= longest + 0.05, (producers, longest)
    assert len(ganas) == 6


def test_scenario_3_cron_gana_preempts_t4_nataraj_when_due(runtime, long_tokens):
    async def go():
        nataraj = asyncio.ensure_future(agenerate("nataraj", "card", model_id="tiny", max_new_tokens=long_tokens))
        await started("nataraj")
        cron = agenerate("gana", "tick", model_id="tiny", producer="gana:cron", deadline=time.time() + 0.5,
                         max_new_tokens=32)
        return await finish_order(nataraj, cron)
    order = asyncio.run(go())
    assert [c.job_id.split("-")[0] for c in order] == ["gana", "nataraj"]
    assert order[1].revokes == 1


def test_scenario_4_nataraj_page_preempts_gana_which_resumes_after(runtime, long_tokens):
    async def go():
        gana = asyncio.ensure_future(agenerate("gana", "plan", model_id="tiny", max_new_tokens=long_tokens))
        await started("gana")
        nataraj = asyncio.ensure_future(agenerate("nataraj", "card", model_id="tiny", max_new_tokens=300))
        await asyncio.sleep(0.3)
        assert (await astatus())["running"]["kind"] == "gana"   # T4 vs T4: no preemption yet
        await uniun_ray.aset_foreground("nataraj")
        card = await nataraj
        await uniun_ray.aset_foreground(None)
        return card, await gana
    card, gana = asyncio.run(go())
    assert gana.revokes == 1 and gana.tokens == long_tokens and card.revokes == 0


def test_scenario_5_extract_backfill_is_held_to_its_share(make_runtime, tmp_path):
    window = 6.0
    make_runtime(PolicyConfig(window_s=window), event_log=str(tmp_path / "events.jsonl"))   # this test's runs only

    async def go():
        await agenerate("chat", "warm up", model_id="tiny", max_new_tokens=4)  # load outside the window

        async def backfill(notes):
            for i in notes:
                await agenerate("extract", f"note {i}", model_id="tiny", max_new_tokens=120)

        async def cards():  # two loops, so a card is always queued: T4 stays backlogged
            done = 0
            while not stop.is_set():
                await agenerate("nataraj", "card", model_id="tiny", max_new_tokens=120)
                done += 1
            return done

        stop = asyncio.Event()
        fill = asyncio.ensure_future(asyncio.gather(*(backfill(range(k, 400, 3)) for k in range(3))))
        deck = asyncio.ensure_future(asyncio.gather(cards(), cards()))
        shares = []
        for _ in range(int(2.5 * window / 0.5)):
            await asyncio.sleep(0.5)
            shares.append((await astatus())["t2"]["share"])
        stop.set()
        fill.cancel()
        return shares, sum(await deck)
    shares, cards_done = asyncio.run(go())
    steady = shares[int(window / 0.5):]          # once a whole window has passed
    # The budget is a pick-time rule: the share may exceed the cap by one extract run in flight.
    # How long a run takes depends on the host, so the bound uses the longest one this run saw.
    longest = max(run_lengths(read_events(uniun_ray.status()["event_log"]), kind="extract"))
    assert cards_done >= 3                        # T4 got the device despite a flood of T2
    assert max(steady) <= 0.6 + longest / window + 0.02, (steady, longest)
    assert max(steady) >= 0.4, steady             # and T2 does use its share


def run_lengths(events: list[dict], kind: str) -> list[float]:
    """Held time of every run of `kind` in the event log: dispatch to its finish."""
    started, lengths = {}, []
    for event in events:
        if event.get("kind") != kind:
            continue
        if event["ev"] == "dispatch":
            started[event["job"]] = event["t"]
        elif event["ev"] == "finish" and event["job"] in started:
            lengths.append(event["t"] - started.pop(event["job"]))
    return lengths


def test_scenario_6_affinity_prefers_the_loaded_model(runtime):
    async def go():
        chat = asyncio.ensure_future(agenerate("chat", "hi", model_id="tiny", max_new_tokens=600))
        await started("chat")
        other = agenerate("gana", "g", model_id=OTHER_MODEL, producer="gana:y", max_new_tokens=4)
        same = agenerate("gana", "g", model_id="tiny", producer="gana:x", max_new_tokens=200)
        return await finish_order(chat, other, same)
    order = asyncio.run(go())
    assert [c.model_id for c in order] == ["tiny", "tiny", OTHER_MODEL]
    assert uniun_ray.status()["swap_s"][OTHER_MODEL] > 0


def test_scenario_7_opened_note_extract_preempts_nataraj(runtime, long_tokens):
    async def go():
        nataraj = asyncio.ensure_future(agenerate("nataraj", "card", model_id="tiny", max_new_tokens=long_tokens))
        await started("nataraj")
        await uniun_ray.aset_foreground("extract", "note-42")
        note = agenerate("extract", "note 42", model_id="tiny", foreground_hint=True, subject="note-42",
                         max_new_tokens=64)
        return await finish_order(nataraj, note)
    order = asyncio.run(go())
    assert [c.job_id.split("-")[0] for c in order] == ["extract", "nataraj"]


def test_scenario_8_an_idle_scheduler_is_dormant(runtime):
    uniun_ray.generate("chat", "hi", model_id="tiny", max_new_tokens=4)
    before = uniun_ray.status()
    time.sleep(1.0)                                  # several timer periods
    after = uniun_ray.status()
    assert after["next_wakeup"] is None and after["running"] is None and after["queued"] == 0
    assert after["vruntime"] == before["vruntime"]


def test_a_model_added_to_a_running_runtime_reaches_the_devices_that_exist(runtime, tmp_path):
    """Issue 44: a ModelActor learns the operator's ids from the scheduler, not only when it is
    made: `start(models=...)` on a running runtime serves them on the devices it has."""
    from uniun_ray.models import materialize, resolve
    from uniun_ray.runtime.launch import start

    folder = str(materialize(resolve("tiny")))
    with pytest.raises(UnknownModel):
        uniun_ray.generate("gana", "hi", model_id="added-tiny", max_new_tokens=2)
    start(models={"added-tiny": folder})
    assert uniun_ray.generate("gana", "hi", model_id="added-tiny", max_new_tokens=2).tokens == 2
    assert "added-tiny" in ray.get(runtime.scheduler.served_models.remote())["ids"]
    other = shutil.copytree(folder, tmp_path / "other")
    with pytest.raises(ValueError, match="served from"):   # an id keeps its folder
        start(models={"added-tiny": str(other)})


def test_bad_input_fails_before_anything_is_queued(runtime):
    with pytest.raises(UnknownModel, match="tiny"):
        uniun_ray.generate("chat", "hi", model_id="no-such-model")
    with pytest.raises(PromptTooLong, match="context length 2048"):
        uniun_ray.generate("chat", "word " * 3000, model_id="tiny")
    with pytest.raises(ValueError, match="unknown kind 'video'"):
        uniun_ray.generate("video", "hi", model_id="tiny")
    with pytest.raises(ValueError, match="max_new_tokens"):
        uniun_ray.generate("chat", "hi", model_id="tiny", max_new_tokens=0)
    with pytest.raises(ValueError, match="deadline"):
        uniun_ray.generate("gana", "hi", model_id="tiny", deadline=float("nan"))
    assert uniun_ray.status()["queued"] == 0


def test_run_work_restarts_after_a_revoke(runtime, long_tokens):
    calls = []

    def work(lease):
        calls.append(lease.lease.epoch)
        return lease.generate("plan", max_new_tokens=long_tokens)

    async def go():
        loop = asyncio.get_running_loop()
        gana = loop.run_in_executor(None, lambda: uniun_ray.run("gana", "tiny", work))
        await started("gana")
        await agenerate("chat", "hi", model_id="tiny", max_new_tokens=8)
        return await gana
    text = asyncio.run(go())
    assert len(calls) == 2 and calls[1] > calls[0] and text


def test_embed_runs_beside_the_scheduler(runtime):
    vectors = uniun_ray.embed(["a note", "another note"])
    assert len(vectors) == 2 and len(vectors[0]) == 384


@pytest.mark.slow
def test_smollm2_chat_arrives_while_nataraj_generates(runtime):
    """The issue-118 moment on the real default chat model."""
    async def go():
        pieces = []

        async def card():
            stream = uniun_ray.astream("nataraj", "Write a short story about a lighthouse.",
                                       max_new_tokens=96)
            async for piece in stream:
                pieces.append(time.time())
            return stream.completion
        nataraj = asyncio.ensure_future(card())
        await started("nataraj")
        while not pieces:
            await asyncio.sleep(0.05)
        before = len(pieces)
        chat = uniun_ray.astream("chat", "What is 2 + 2?", max_new_tokens=16)
        first_chat_piece = None
        async for _ in chat:
            first_chat_piece = first_chat_piece or time.time()
        return await nataraj, chat.completion, before, pieces, first_chat_piece
    card, chat, before, pieces, first_chat_piece = asyncio.run(go())
    stops = ray.get(runtime.model.state.remote())["stop_latency_s"]
    assert card.revokes == 1 and stops       # the ModelActor stopped it on the revoke
    # Counted from the scheduler's revoke (the chat's own check and submit before it are the
    # control path, not the stop): the token in flight, and a piece already on its way.
    revoked = next(e["t"] for e in read_events(uniun_ray.status()["event_log"])
                   if e["ev"] == "revoke" and e["job"] == card.job_id)
    after = [t for t in pieces if revoked <= t < first_chat_piece]
    assert len(after) <= 2, (after, revoked)
    assert chat.text.strip() and chat.revokes == 0
    assert card.tokens > before and card.text  # resumed and completed, earlier text kept
