"""The vLLM engine (issue 26). The mapping (sampling, the stream's events, how a run ends) is
tested everywhere without vLLM; the tests marked `vllm` run a real vLLM server and only where
its venv exists (`make install-vllm`; `make test-vllm` runs them, `make test` leaves them out:
a server takes minutes to start on a small CPU)."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from uniun_ray.engines import Engine, Piece, venvs
from uniun_ray.engines.vllm import Delta, EngineError, VllmEngine, VllmRun, parse_event, sampling_fields
from uniun_ray.models.vocabulary import PromptTooLong
from uniun_ray.models.request import GenerateRequest

CHAT = "smollm2-135m-instruct"


def request(**fields) -> GenerateRequest:
    return GenerateRequest(prompt="hello", **fields)


# -- sampling: the request's fields, else the model's generation config as transformers reads it --
def test_a_config_that_does_not_sample_is_greedy_and_everything_else_off():
    fields = sampling_fields(request(max_new_tokens=7), {"eos_token_id": 2})
    assert fields == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                      "max_tokens": 7, "stop": []}


def test_a_sampling_config_gives_its_values_and_the_request_overrides_them():
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}
    assert sampling_fields(request(), config) | {"max_tokens": 0} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_tokens": 0, "stop": []}
    mine = sampling_fields(request(temperature=0.2, top_p=0.5, top_k=3, repetition_penalty=1.3, seed=9,
                                   stop=("\n", "END")), config)
    assert mine | {"max_tokens": 0} == {"temperature": 0.2, "top_p": 0.5, "top_k": 3, "repetition_penalty": 1.3,
                                        "seed": 9, "stop": ["\n", "END"], "max_tokens": 0}


def test_top_k_and_top_p_of_a_greedy_config_stay_off_but_its_repetition_penalty_applies():
    fields = sampling_fields(request(), {"top_k": 50, "top_p": 0.8, "repetition_penalty": 1.2})
    assert (fields["temperature"], fields["top_k"], fields["top_p"], fields["repetition_penalty"]) == (0.0, 0, 1.0, 1.2)


# -- the stream's events --
@pytest.mark.parametrize("line, delta", [
    (b'data: {"choices":[{"text":"Hi","token_ids":[5,6],"finish_reason":null}]}', Delta("Hi", (5, 6))),
    (b'data: {"choices":[{"text":"","token_ids":[2],"finish_reason":"stop","stop_reason":null}]}',
     Delta("", (2,), "eos")),
    (b'data: {"choices":[{"text":"a","token_ids":[9],"finish_reason":"stop","stop_reason":"END"}]}',
     Delta("a", (9,), "stop")),
    (b'data: {"choices":[{"text":"","token_ids":[],"finish_reason":"length"}]}', Delta("", (), "length")),
    (b'data: {"choices":[{"text":"","finish_reason":"abort"}]}', Delta(finish_reason="cancel")),
    (b'data: {"choices":[],"usage":{"prompt_tokens":4}}', Delta(usage={"prompt_tokens": 4})),
    (b"data: [DONE]", None), (b"", None), (b": keep-alive", None),
])
def test_events_parse_into_deltas_in_generation_result_words(line, delta):
    assert parse_event(line) == delta


def test_an_error_event_raises():
    with pytest.raises(EngineError, match="boom"):
        parse_event(b'data: {"error": {"message": "boom"}}')


# -- a run over a scripted stream --
class Scripted:
    """Stands in for the HTTP stream: yields its deltas."""

    def __init__(self, deltas) -> None:
        self.deltas, self.shut_calls = deltas, 0

    def __iter__(self):
        yield from self.deltas

    def shut(self) -> None:
        self.shut_calls += 1


class Fed(Scripted):
    """A stream the test feeds one delta at a time; `queue.join()` returns once the run has
    taken in every delta fed (it asks for the next); `shut` ends it, as a shut socket does."""

    def __init__(self) -> None:
        super().__init__([])
        self.queue = queue.Queue()

    def __iter__(self):
        while (delta := self.queue.get(timeout=5)) is not None:
            yield delta
            self.queue.task_done()

    def shut(self) -> None:
        super().shut()
        self.queue.put(None)


def run_of(deltas) -> tuple[VllmRun, list]:
    ended = []
    return VllmRun(Scripted(deltas), prompt_tokens=3, on_end=ended.append), ended


def test_ids_whose_text_is_held_back_join_the_next_piece_and_the_eos_id_is_no_output():
    run, ended = run_of([Delta("A", (1,)), Delta("", (2,)), Delta("BC", (3,)), Delta("", (0,), "eos"),
                         Delta(usage={"prompt_tokens_details": {"cached_tokens": 2}})])
    assert list(run) == [Piece("A", (1,)), Piece("BC", (2, 3))]
    result = run.result
    assert (result.text, result.token_ids, result.finish_reason, result.cached_tokens) == ("ABC", (1, 2, 3), "eos", 2)
    assert ended == [run] and run._stream.shut_calls == 1


def test_a_run_ended_by_length_keeps_ids_still_held_back():
    run, _ = run_of([Delta("A", (1,)), Delta("", (2,), "length")])
    list(run)
    assert run.result.token_ids == (1, 2) and run.result.finish_reason == "length"


def test_close_from_another_thread_keeps_what_was_yielded_and_drops_what_was_held_back():
    stream, ended = Fed(), []
    run = VllmRun(stream, prompt_tokens=3, on_end=ended.append)
    pieces = []
    consumer = threading.Thread(target=lambda: pieces.extend(run))
    consumer.start()
    stream.queue.put(Delta("A", (1,)))
    stream.queue.put(Delta("", (2,)))   # an id whose text is held back ...
    stream.queue.join()
    run.close()                          # ... when the job is revoked
    stream.queue.put(Delta("B", (3,)))
    consumer.join(5)
    assert pieces == [Piece("A", (1,))]
    assert (run.result.text, run.result.token_ids, run.result.finish_reason) == ("A", (1,), "cancel")
    assert ended == [run]


def test_a_stream_that_breaks_unasked_is_an_error_with_what_it_had():
    class Broken(Scripted):
        def __iter__(self):
            yield Delta("A", (1,))
            raise ConnectionResetError("server gone")

    run = VllmRun(Broken([]), prompt_tokens=1, on_end=lambda run: None)
    with pytest.raises(EngineError, match="server gone"):
        list(run)
    assert run.result.finish_reason == "error" and run.result.token_ids == (1,)


def test_a_stream_that_ends_without_a_finish_reason_is_an_error():
    run, _ = run_of([Delta("A", (1,))])
    with pytest.raises(EngineError, match="without a finish reason"):
        list(run)


def test_the_engine_is_an_engine_and_refuses_bad_input_without_a_server():
    engine = VllmEngine(slots=2)
    assert isinstance(engine, Engine) and engine.loaded is None
    with pytest.raises(PromptTooLong):
        engine.check(CHAT, GenerateRequest(prompt="hi", max_new_tokens=100_000))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.check(CHAT, GenerateRequest(prompt="hi", resume_tokens=(10**9,)))
    with pytest.raises(RuntimeError, match="no model is loaded"):
        engine.start("j", GenerateRequest(prompt="hi"))


# -- against a real vLLM server ----------------------------------------------------------------
needs_vllm = pytest.mark.skipif(not (venvs.installed(venvs.vllm_recipe()) or venvs.os.environ.get(
    venvs.VLLM_PYTHON_ENV)), reason="no vLLM environment (make install-vllm)")


@pytest.fixture(scope="module")
def engine():
    engine = VllmEngine(slots=2)
    engine.load(CHAT)
    yield engine
    engine.unload()


def collect(run, stop_after: int | None = None) -> list[Piece]:
    pieces = []
    for piece in run:
        pieces.append(piece)
        if stop_after is not None and sum(len(p.token_ids) for p in pieces) >= stop_after:
            run.close()
            break
    return pieces


STORY = "Once upon a time " + " ".join(f"there was a village number {i} by the river." for i in range(30))


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_a_revoked_job_resumes_from_its_tokens_exactly_and_from_the_prefix_cache(engine):
    whole = engine.start("whole", GenerateRequest(prompt=STORY, max_new_tokens=40))
    collect(whole)
    cut = engine.start("cut", GenerateRequest(prompt=STORY, max_new_tokens=40))
    collect(cut, stop_after=15)
    assert cut.result.finish_reason == "cancel" and 0 < len(cut.result.token_ids) < 40
    rest = engine.start("rest", GenerateRequest(prompt=STORY, max_new_tokens=40 - len(cut.result.token_ids),
                                                 resume_tokens=cut.result.token_ids))
    collect(rest)
    assert cut.result.token_ids + rest.result.token_ids == whole.result.token_ids
    assert cut.result.text + rest.result.text == whole.result.text
    prefilled = rest.result.prompt_tokens - rest.result.cached_tokens
    assert rest.result.cached_tokens > 0 and prefilled <= 128   # at most one KV block (CPU's: 128)


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_a_chat_takes_a_revoked_slot_at_the_next_step_and_the_other_job_goes_on(engine):
    long = GenerateRequest(prompt=STORY, max_new_tokens=400)
    first, second = engine.start("bg1", long), engine.start("bg2", long)
    pieces = {"bg2": []}

    def keep(run, into):
        for piece in run:
            into.append((time.perf_counter(), piece))

    other = threading.Thread(target=keep, args=(second, pieces["bg2"]))
    other.start()
    collect(first, stop_after=5)   # both slots busy: revoke one ...
    chat = engine.start("chat", GenerateRequest(messages=[{"role": "user", "content": "Say hi."}], max_new_tokens=8))
    collect(chat)                  # ... and the chat runs beside the other
    during = len(pieces["bg2"])
    engine.cancel("bg2")
    other.join(30)
    assert first.result.finish_reason == "cancel" and chat.result.finish_reason in ("eos", "length")
    assert chat.result.tokens > 0 and second.result.finish_reason == "cancel"
    assert during > 5   # the other job was not stopped by the revoke or the chat
    assert engine.status()["running"] == 0


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_step_profile_and_status(engine):
    profile = engine.step_profile(tokens=8)
    assert sorted(profile) == [1, 2] and all(0 < seconds < 10 for seconds in profile.values())
    status = engine.status()
    assert status["engine"] == "vllm" and status["model"] == CHAT and status["slots"] == 2
    assert status["dtype"] in ("float32", "auto") and status["kv_usage"] is not None


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_a_killed_server_ends_its_jobs_with_an_error(engine):
    """Last in the module: the server is gone afterwards (the ModelActor re-queues the jobs)."""
    run = engine.start("doomed", GenerateRequest(prompt=STORY, max_new_tokens=400))
    pieces = iter(run)
    next(pieces)
    engine.server._signal(9)
    with pytest.raises(EngineError):
        for _ in pieces:
            pass
    assert run.result.finish_reason == "error" and not engine.server.alive()
