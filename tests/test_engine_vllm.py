"""The vLLM engine (issue 26). The mapping (sampling, the stream's events, how a run ends) is
tested everywhere without vLLM; the runtime scenarios on a real vLLM server are in
`test_runtime_vllm.py` (marker `vllm`: `make test-vllm`)."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from uniun_ray.engines import Engine, venvs
from uniun_ray.engines.vllm import (PLUGIN_DIR, Delta, EngineError, VllmEngine, VllmRun, grammar_fields,
                                    parse_event, sampling_fields)
from uniun_ray.models.requests.vocabulary import PromptTooLong
from uniun_ray.models.requests.request import GenerateRequest

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


# -- a JSON Schema: for the server's logits processor (vllm_plugin/uniun_grammar.py) --
SCHEMA = {"type": "array", "items": {"type": "string", "enum": ["red", "blue"]}}


def test_a_schema_travels_with_the_end_ids_and_what_was_resumed():
    from llguidance import LLMatcher

    assert grammar_fields(request(), {"eos_token_id": 2}) == {}
    fresh = grammar_fields(request(json_schema=SCHEMA), {"eos_token_id": [1, 106]})["vllm_xargs"]
    assert fresh.pop("uniun_grammar") == LLMatcher.grammar_from_json_schema(SCHEMA)
    assert fresh == {"uniun_eos": [1, 106], "uniun_resumed": 0}
    resumed = grammar_fields(request(json_schema=SCHEMA, resume_tokens=(5, 6, 7)), {"eos_token_id": 2})["vllm_xargs"]
    assert (resumed["uniun_eos"], resumed["uniun_resumed"]) == ([2], 3) and "uniun_resumed_text" not in resumed
    lossy = grammar_fields(request(json_schema=SCHEMA, resume_text='["red", '), {})["vllm_xargs"]
    assert (lossy["uniun_eos"], lossy["uniun_resumed"], lossy["uniun_resumed_text"]) == ([], 0, '["red", ')


def test_a_forced_tool_call_travels_as_its_grammar_in_the_templates_format():
    from llguidance import LLMatcher

    from uniun_ray.models.requests.tools import HERMES, call_grammar
    tool = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    forced = GenerateRequest(messages=[{"role": "user", "content": "time?"}], tools=[tool], tool_choice="clock")
    xargs = grammar_fields(forced, {"eos_token_id": 2}, template="... <tool_call> ...")["vllm_xargs"]
    assert xargs["uniun_grammar"] == LLMatcher.grammar_from_lark(call_grammar(HERMES, [tool], "clock", True))
    assert grammar_fields(GenerateRequest(messages=forced.messages, tools=[tool]), {}, template="<tool_call>") == {}
    with pytest.raises(ValueError, match="no format this server reads"):
        grammar_fields(forced, {}, template="{{ messages }}")


MASK_PROBE = """
import json, sys, torch
from transformers import AutoTokenizer
from llguidance import LLMatcher
from uniun_grammar import GrammarMask

class Config:
    class model_config:
        tokenizer = sys.argv[1]

class Params:
    def __init__(self, **xargs):
        self.extra_args = xargs

masks = GrammarMask(Config, torch.device("cpu"), False)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
schema = LLMatcher.grammar_from_json_schema({"type": "array", "items": {"type": "string", "enum": ["red", "blue"]}})
prompt = tokenizer("Colours:", add_special_tokens=False)["input_ids"]
output = tokenizer('["red", "blue"', add_special_tokens=False)["input_ids"]   # produced before a revoke
comma, opening = (tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (",", "["))
def allowed(params, prompt_ids):
    logits = masks.new_req_logits_processor(params)(prompt_ids, [], torch.zeros(len(tokenizer)))
    return [bool(logits[t] > float("-inf")) for t in (comma, opening)]
print(json.dumps({"fresh": allowed(Params(uniun_grammar=schema, uniun_eos=[2]), prompt),
                  "resumed": allowed(Params(uniun_grammar=schema, uniun_eos=[2], uniun_resumed=len(output)),
                                     prompt + output),
                  "none": masks.new_req_logits_processor(Params()) is None,
                  "call_opens_with": [int(t) for t in torch.nonzero(
                      masks.new_req_logits_processor(Params(uniun_grammar=sys.argv[2], uniun_eos=[2]))(
                          prompt, [], torch.zeros(len(tokenizer))) > float("-inf"))],
                  "call_marker": tokenizer("<tool_call>", add_special_tokens=False)["input_ids"][:1]}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not venvs.installed(venvs.vllm_recipe()), reason="no vLLM environment (make install-vllm)")
def test_the_servers_mask_continues_a_resumed_json_where_it_was_cut():
    """The logits processor on vLLM's own Python: a fresh request may open the list, not put a
    comma; a resumed one, whose prompt ends inside the list, may put a comma, not open another.
    A forced tool call opens with its marker, in the tokenizer's own first token of it."""
    from llguidance import LLMatcher

    from uniun_ray.models.registry import materialize, resolve
    from uniun_ray.models.requests.tools import HERMES, call_grammar

    tool = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    call = LLMatcher.grammar_from_lark(call_grammar(HERMES, [tool], "clock", False))
    probe = subprocess.run([str(venvs.vllm_python()), "-c", MASK_PROBE, str(materialize(resolve(CHAT))), call],
                           env={**os.environ, "PYTHONPATH": str(PLUGIN_DIR)}, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    answer = json.loads(probe.stdout.splitlines()[-1])
    assert answer.pop("call_opens_with") == answer.pop("call_marker")
    assert answer == {"fresh": [False, True], "resumed": [True, False], "none": True}


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


def run_of(stream) -> tuple[VllmRun, list]:
    ended = []
    return VllmRun(stream, prompt_tokens=3, wake=lambda: None, on_end=ended.append), ended


def test_ids_whose_text_is_held_back_join_the_next_piece_and_the_eos_id_is_no_output():
    stream = Scripted([Delta("A", (1,)), Delta("", (2,)), Delta("BC", (3,)), Delta("", (0,), "eos"),
                       Delta(usage={"prompt_tokens_details": {"cached_tokens": 2}})])
    run, ended = run_of(stream)
    run.read()
    assert run.done.is_set() and run.drain() == ("ABC", 3) and run.drain() == ("", 3)
    result = run.result
    assert (result.text, result.token_ids, result.finish_reason, result.cached_tokens) == ("ABC", (1, 2, 3), "eos", 2)
    assert ended == [run] and stream.shut_calls == 1 and run.failure is None


def test_a_run_ended_by_length_keeps_ids_still_held_back():
    run, _ = run_of(Scripted([Delta("A", (1,)), Delta("", (2,), "length")]))
    run.read()
    assert run.result.token_ids == (1, 2) and run.result.finish_reason == "length"


def test_cancel_from_another_thread_keeps_what_was_taken_in_and_drops_what_was_held_back():
    stream, woken = Fed(), []
    run = VllmRun(stream, prompt_tokens=3, wake=lambda: woken.append(1), on_end=lambda run: None)
    reader = threading.Thread(target=run.read)
    reader.start()
    stream.queue.put(Delta("A", (1,)))
    stream.queue.put(Delta("", (2,)))   # an id whose text is held back ...
    stream.queue.join()
    assert run.drain() == ("A", 1) and not run.done.is_set() and woken
    run.cancel()                         # ... when the job is revoked
    stream.queue.put(Delta("B", (3,)))
    reader.join(5)
    assert run.done.is_set() and run.drain() == ("", 1)
    assert (run.result.text, run.result.token_ids, run.result.finish_reason) == ("A", (1,), "cancel")
    assert run.failure is None


def test_a_stream_that_breaks_unasked_is_an_error_with_what_it_had():
    class Broken(Scripted):
        def __iter__(self):
            yield Delta("A", (1,))
            raise ConnectionResetError("server gone")

    run, _ = run_of(Broken([]))
    run.read()
    assert run.result.finish_reason == "error" and run.result.token_ids == (1,)
    assert isinstance(run.failure, EngineError) and "server gone" in str(run.failure)


def test_a_stream_that_ends_without_a_finish_reason_is_an_error():
    run, _ = run_of(Scripted([Delta("A", (1,))]))
    run.read()
    assert run.result.finish_reason == "error" and "without a finish reason" in str(run.failure)


def test_the_engine_is_an_engine_and_refuses_bad_input_without_a_server():
    engine = VllmEngine(slots=2)
    assert isinstance(engine, Engine) and engine.loaded is None and engine.capacity == 2
    with pytest.raises(PromptTooLong):
        engine.check(CHAT, GenerateRequest(prompt="hi", max_new_tokens=100_000))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.check(CHAT, GenerateRequest(prompt="hi", resume_tokens=(10**9,)))
    with pytest.raises(RuntimeError, match="no model is loaded"):
        engine.start("j", GenerateRequest(prompt="hi"))


def test_the_kv_usage_status_shows_is_read_from_the_server_at_most_once_a_second(monkeypatch):
    """`status` follows every job: each read of /metrics would cost the server's event loop."""
    from uniun_ray.engines import vllm

    reads = []
    monkeypatch.setattr(vllm, "_metric", lambda url, name: reads.append(url) or 0.25)
    engine = VllmEngine(slots=2)
    engine._servers, engine._loaded = {CHAT: type("Up", (), {"url": "http://x:1", "alive": lambda self: True})()}, CHAT
    assert [engine._kv_usage() for _ in range(3)] == [0.25] * 3 and reads == ["http://x:1"]
    engine._kv_read = (time.monotonic() - vllm.KV_READ_EVERY_S, 0.5)   # a second later
    assert engine._kv_usage() == 0.25 and len(reads) == 2


PARENT = """
import sys, time
from uniun_ray.engines.server import ChildServer, free_port
port = free_port()
server = ChildServer([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], port, health="/")
server.start(30)
print(server.process.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_ends_when_the_process_that_started_it_is_killed():
    """A ModelActor killed by Ray (or `uniun-ray down`) must not leave its model server behind."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.stdout.close()


def _alive(pid: int) -> bool:
    """Running: neither gone nor a zombie waiting for its new parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_venv_stamped_before_a_recipe_field_existed_is_still_installed(tmp_path, monkeypatch):
    """A field added to `Recipe` with its default must not rebuild the venvs already made."""
    import json

    monkeypatch.setenv("UNIUN_CACHE_DIR", str(tmp_path / "models"))
    recipe = venvs.vllm_recipe(gpu=False)
    root = venvs.envs_dir() / recipe.name
    root.mkdir(parents=True)
    old = {"name": recipe.name, "steps": [list(step) for step in recipe.steps], "remove": list(recipe.remove),
           "check": recipe.check}   # no `env`: written before it existed
    (root / ".uniun-installed").write_text(json.dumps(old))
    assert venvs.installed(recipe)
    (root / ".uniun-installed").write_text(json.dumps(old | {"check": "import other"}))
    assert not venvs.installed(recipe)
