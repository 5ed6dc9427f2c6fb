"""The engine seam (SPEC §7) as the ModelActor drives it, Ray-free, on the transformers engine
and the `tiny` model: non-blocking handles filled by the engine's thread, a wake after every
step, cancel by job id, an exact resume from a result's token ids."""
from __future__ import annotations

import threading

import pytest

from uniun_ray.engines import Engine, JobRun, create
from uniun_ray.models.requests.request import GenerateRequest
from uniun_ray.settings import EngineSettings

from test_models import tiny_cache  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def seam(tiny_cache):  # noqa: F811
    woken = threading.Semaphore(0)
    engine = create(EngineSettings(dtype="float32", threads=1), "cpu", woken.release)
    engine.load("tiny")
    return engine, woken


def drain(run: JobRun, woken: threading.Semaphore) -> tuple[str, int]:
    """What the ModelActor does: take what is new after each wake until the job is done."""
    text, tokens = "", 0
    while True:
        ended = run.done.is_set()
        piece, tokens = run.drain()
        text += piece
        if ended:
            return text, tokens
        woken.acquire(timeout=10)


def test_the_transformers_engine_is_an_engine_and_says_so(seam):
    engine, _ = seam
    assert isinstance(engine, Engine) and engine.name == "transformers" and engine.loaded == "tiny"
    status = engine.status()
    assert (status["engine"], status["model"], status["running"]) == ("transformers", "tiny", 0)
    assert engine.capacity > 1 and set(engine.step_profile()) >= {1, 2}
    assert engine.check("tiny", GenerateRequest(prompt="hello")) > 0


def test_jobs_stream_through_their_handles_and_a_cancel_stops_one_while_the_other_goes_on(seam):
    engine, woken = seam
    keep = engine.start("keep", GenerateRequest(prompt="hello", max_new_tokens=40))
    doomed = engine.start("doomed", GenerateRequest(prompt="world", max_new_tokens=2000))
    engine.cancel("doomed")
    engine.cancel("nobody")             # an unknown id is ignored (a revoke racing a job's end)
    text, tokens = drain(keep, woken)
    assert doomed.done.wait(10) and doomed.result.finish_reason == "cancel" and doomed.result.tokens < 2000
    assert keep.result.finish_reason == "length" and text == keep.result.text and tokens == 40
    assert keep.failure is None and doomed.failure is None
    status = engine.status()   # the decode loop's counters: steps and their seconds per batch size
    assert sum(status["steps_by_batch"].values()) >= 39
    assert all(status["step_s_by_batch"][rows] > 0 for rows in status["steps_by_batch"])


def test_a_cancelled_job_resumes_from_its_token_ids_exactly(seam):
    engine, woken = seam
    request = GenerateRequest(prompt="resume me", max_new_tokens=60)
    whole = engine.start("whole", request)
    drain(whole, woken)
    cut = engine.start("cut", request)
    while cut.drain()[1] < 10 and not cut.done.is_set():
        woken.acquire(timeout=10)
    engine.cancel("cut")
    drain(cut, woken)
    done = cut.result.token_ids
    rest = engine.start("rest", GenerateRequest(prompt="resume me", max_new_tokens=60 - len(done), resume_tokens=done))
    drain(rest, woken)
    assert 0 < len(done) < 60 and done + rest.result.token_ids == whole.result.token_ids
    assert rest.result.prompt_tokens - rest.result.cached_tokens <= 2   # its KV was kept
