"""Forced tool calls on the Ray-free Engine (issue 38): `tiny` with a tools template of each
family; `tool_choice` "required" or a tool's name makes even an untrained model write a call of
an offered tool, valid against its schema, which the reader reads back from the text; a revoked
forced call resumes inside the call; the next turn after a call reuses the prefix cache
through the call."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import replace

import jsonschema
import pytest

from tool_models import CLOCK, SCHEMAS, TOOLS, WEATHER, tool_model
from uniun_ray.models import Engine, GenerateRequest, generate, inspect_request, materialize, resolve
from uniun_ray.settings import EngineSettings
from uniun_ray.models.requests.tools import FORMATS, read_calls, tool_names

DEVICE = os.environ.get("UNIUN_TEST_DEVICE", "cpu")
ASK = [{"role": "user", "content": "What is the weather in Oslo this week?"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tiny = materialize(resolve("tiny"))
    root = tmp_path_factory.mktemp("tool-models")
    return {family: str(tool_model(tiny, root / family, family)) for family in FORMATS}


@pytest.fixture(scope="module")
def engine():
    return Engine(DEVICE, EngineSettings(dtype="float32"))


def run(engine, request, cancel=None):
    generation = generate(engine, request, cancel or threading.Event())
    for _ in generation:
        pass
    return generation.result


def calls_of(family: str, text: str, parallel: bool = True):
    content, calls = read_calls(FORMATS[family], tool_names(TOOLS), text, None if parallel else 1)
    assert content == "", text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("family", ["mistral", "llama3_json", "hermes"])   # hermes last: the next tests run on it
def test_a_forced_call_is_a_valid_call_in_the_templates_format_read_back_from_the_text(engine, folders, family):
    engine.load(folders[family])
    forced = GenerateRequest(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                             max_new_tokens=60)
    done = run(engine, forced)
    assert done.finish_reason == "eos" and len(calls_of(family, done.text, parallel=False)) == 1
    named = run(engine, replace(forced, tool_choice="clock", temperature=1.5, seed=4))
    assert [call.name for call in calls_of(family, named.text)] == ["clock"]
    free = run(engine, replace(forced, tool_choice="auto", max_new_tokens=12))
    assert read_calls(FORMATS[family], tool_names(TOOLS), free.text)[1] == []   # untrained: no call of its own


def test_a_forced_call_revoked_midway_resumes_inside_its_call(engine, folders):
    engine.load(folders["hermes"])
    request = GenerateRequest(messages=ASK, tools=TOOLS, tool_choice="weather", parallel_tool_calls=False,
                              max_new_tokens=60)
    whole = run(engine, request)
    cancel, produced = threading.Event(), []
    generation = generate(engine, request, cancel)
    for piece in generation:
        produced.append(piece)
        if "arguments" in "".join(produced):   # inside the call: its name written, its arguments to come
            cancel.set()
    first = generation.result
    assert first.stopped_by_cancel and "<tool_call>" in first.text and not first.text.endswith("</tool_call>")
    rest = run(engine, replace(request, max_new_tokens=60 - first.tokens, resume_tokens=first.token_ids))
    assert first.text + rest.text == whole.text and calls_of("hermes", whole.text)
    by_text = run(engine, replace(request, max_new_tokens=60 - first.tokens, resume_text=first.text))
    assert [call.name for call in calls_of("hermes", first.text + by_text.text)] == ["weather"]


def test_the_turn_after_a_call_renders_its_result_and_reuses_the_cache_through_the_call(engine, folders):
    """The call as the client sends it back (arguments a JSON string) renders as the model
    wrote it, and the text the grammar forced was written in the tokenizer's own tokens: the
    next turn's prefill starts after the call, in the cached conversation. (The call's every
    character is forced here: where an untrained model chooses, it picks any split of the text
    into tokens, which re-tokenizing the conversation does not give back.)"""
    engine.load(folders["hermes"])
    engine._loaded.prefix.clear()
    utc = json.loads(json.dumps(CLOCK))
    utc["function"]["parameters"]["properties"]["zone"]["enum"] = ["UTC"]
    asked = GenerateRequest(messages=ASK, tools=[WEATHER, utc], tool_choice="clock", parallel_tool_calls=False,
                            max_new_tokens=60)
    turn = run(engine, asked)
    call = calls_of("hermes", turn.text)[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.as_openai()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    after = run(engine, GenerateRequest(messages=history, tools=[WEATHER, utc], max_new_tokens=4))
    # all but the call's last token, ">", which tiny's tokenizer merges with the "<|im_end|>" after it
    # (plain text to tiny; a special token to Qwen, where nothing merges)
    assert after.cached_tokens >= turn.prompt_tokens + turn.tokens - 1, (after.cached_tokens, turn.prompt_tokens,
                                                                         turn.tokens)


def test_a_forced_call_needs_a_template_whose_format_is_known_and_an_offered_name(folders, tmp_path):
    tiny = materialize(resolve("tiny"))
    unknown = tool_model(tiny, tmp_path / "unknown", "hermes")
    (unknown / "chat_template.jinja").write_text("{% for t in tools %}{{ t.function.name }}{% endfor %}"
                                                 "{% for m in messages %}{{ m.content }}{% endfor %}")
    request = GenerateRequest(messages=ASK, tools=[WEATHER], tool_choice="required")
    with pytest.raises(ValueError, match="no format this server reads") as refused:
        inspect_request(resolve(str(unknown)), request)      # before it is queued, with no model loaded
    assert refused.value.field == "tool_choice"
    from uniun_ray.models.requests.vocabulary import tool_call_format
    assert [tool_call_format(resolve(model)) for model in (folders["mistral"], str(unknown), "tiny")] == [
        "mistral", "unknown: the model's tool calls are answered as content", None]   # what status says
    with pytest.raises(ValueError, match="tool_choice must be 'auto', 'required' or the name of an offered tool"):
        GenerateRequest(messages=ASK, tools=[WEATHER], tool_choice="clock")
    with pytest.raises(ValueError, match="'required' needs tools"):
        GenerateRequest(messages=ASK, tool_choice="required")
    with pytest.raises(ValueError, match="not both"):
        GenerateRequest(messages=ASK, tools=[WEATHER], tool_choice="weather", json_schema={"type": "object"})
