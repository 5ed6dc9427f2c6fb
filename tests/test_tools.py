"""Tool calls in the model's words (issue 38): the format a template teaches, the reader of
calls (whole and streamed in pieces of any size) and the grammar that forces one. Ray-free,
model-free except the last test (tiny's tokenizer)."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from uniun_ray.models.requests.tools import (HERMES, LLAMA3_JSON, MISTRAL, CallDelta, CallReader, call_format,
                                             call_grammar, read_calls)

TOOLS = ["weather", "time"]


def ids():
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def read(format_, text, max_calls=None):
    content, calls = read_calls(format_, TOOLS, text, max_calls, new_id=ids())
    return content, [(c.id, c.name, json.loads(c.arguments)) for c in calls]


def streamed(format_, pieces, max_calls=None):
    """The answer as a client rebuilds it from the deltas, and the deltas."""
    reader = CallReader(format_, TOOLS, max_calls, new_id=ids())
    items = [item for piece in pieces for item in reader.feed(piece)] + reader.finish()
    calls: dict[int, list] = {}
    for item in items:
        if isinstance(item, CallDelta):
            if item.id is not None:
                assert item.index == len(calls) and item.name and not item.arguments   # the first names it
                calls[item.index] = [item.id, item.name, ""]
            else:
                assert item.index in calls and item.arguments
                calls[item.index][2] += item.arguments
    content = "".join(item for item in items if isinstance(item, str))
    return (content, [(i, n, json.loads(a)) for i, n, a in calls.values()]), items


WEATHER = '{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}'
TIME = '{"name": "time", "arguments": {"zone": "a}\\"]b"}}'
LLAMA_WEATHER = '{"name": "weather", "parameters": {"city": "Oslo", "days": [1, 2]}}'
OSLO = ("call_0", "weather", {"city": "Oslo", "days": [1, 2]})
ZONE = ("call_1", "time", {"zone": 'a}"]b'})

CASES = [
    # well-formed, one call (content before it, for the formats that allow it)
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>", ("", [OSLO])),
    (HERMES, f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>", ("Let me look.", [OSLO])),
    (LLAMA3_JSON, LLAMA_WEATHER, ("", [OSLO])),
    (LLAMA3_JSON, f"<|python_tag|>{LLAMA_WEATHER}", ("", [OSLO])),
    (MISTRAL, f"[TOOL_CALLS][{WEATHER}]", ("", [OSLO])),
    (MISTRAL, f"Sure. [TOOL_CALLS] [ {WEATHER} ]", ("Sure.", [OSLO])),
    # several calls (a string holding brackets and quotes; keys in another order)
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", ("", [OSLO, ZONE])),
    (HERMES, f'<tool_call>{WEATHER}</tool_call><tool_call>{{"arguments": {{"zone": "a}}\\"]b"}}, "name": "time"}}'
             f"</tool_call>", ("", [OSLO, ZONE])),
    (LLAMA3_JSON, f'{LLAMA_WEATHER}; {TIME.replace("arguments", "parameters")}', ("", [OSLO, ZONE])),
    (MISTRAL, f"[TOOL_CALLS][{WEATHER}, {TIME}]", ("", [OSLO, ZONE])),
    # text that merely looks like a call stays content, from the marker on
    (HERMES, "Wrap a call in <tool_call> tags.", ("Wrap a call in <tool_call> tags.", [])),
    (HERMES, '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
     ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', [])),                       # not offered
    (HERMES, "<tool_call>\n{not json}\n</tool_call>", ("<tool_call>\n{not json}\n</tool_call>", [])),
    (HERMES, '<tool_call>{"name": "weather"}</tool_call>', ('<tool_call>{"name": "weather"}</tool_call>', [])),
    (HERMES, "<tool_call>\n{\"name\": \"weath", ("<tool_call>\n{\"name\": \"weath", [])),           # cut short
    (LLAMA3_JSON, 'The call would be {"name": "weather", "parameters": {}}.',
     ('The call would be {"name": "weather", "parameters": {}}.', [])),
    (LLAMA3_JSON, '{"city": "Oslo"}', ('{"city": "Oslo"}', [])),                                   # JSON, no call
    (MISTRAL, "[TOOL_CALLS] no list", ("[TOOL_CALLS] no list", [])),
    (MISTRAL, f" [{WEATHER}]", ("", [OSLO])),            # [TOOL_CALLS], a special token, dropped from the text
    (MISTRAL, f"Look: [{WEATHER}]", (f"Look: [{WEATHER}]", [])),                                  # not at the start
    (MISTRAL, "[1, 2]", ("[1, 2]", [])),
    # content after the calls of a format that allows it
    (HERMES, f"<tool_call>{WEATHER}</tool_call>\nDone.", ("\nDone.", [OSLO])),
    # plain answers keep every character
    (HERMES, "  Hello, <b>world</b> \n", ("  Hello, <b>world</b> \n", [])),
    (LLAMA3_JSON, "\nHello { there\n", ("\nHello { there\n", [])),
]


@pytest.mark.parametrize("format_, text, expected", CASES)
def test_a_whole_answer_reads_into_content_and_calls(format_, text, expected):
    assert read(format_, text) == expected


@pytest.mark.parametrize("format_, text, expected", CASES)
def test_an_answer_in_pieces_of_any_size_streams_what_the_whole_one_reads(format_, text, expected):
    """Every split into two pieces, one character at a time, and random pieces: the deltas
    rebuild the same answer (a call's first delta names it, the rest are argument fragments)."""
    splits = [[text[:at], text[at:]] for at in range(len(text) + 1)] + [list(text)]
    draw = random.Random(38)
    for _ in range(20):
        cuts = sorted(draw.sample(range(len(text) + 1), min(len(text), draw.randint(1, 6))))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for pieces in splits:
        assert streamed(format_, pieces)[0] == expected, pieces


def test_arguments_stream_in_fragments_as_they_are_written():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    _, items = streamed(HERMES, [text[i:i + 4] for i in range(0, len(text), 4)])
    fragments = [item.arguments for item in items if isinstance(item, CallDelta) and item.arguments]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Oslo", "days": [1, 2]}'


def test_without_parallel_calls_only_the_first_is_kept():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    assert read(HERMES, text, max_calls=1) == ("", [OSLO])
    assert read(MISTRAL, f"[TOOL_CALLS][{WEATHER}, {TIME}]", max_calls=1) == ("", [OSLO])


def test_a_call_cut_by_the_token_limit_keeps_what_was_written():
    reader = CallReader(HERMES, TOOLS, new_id=ids())
    reader.feed('<tool_call>\n{"name": "weather", "arguments": {"city": "Os')
    reader.finish()
    assert [(c.name, c.arguments) for c in reader.calls] == [("weather", '{"city": "Os')]


QWEN = ("{%- if tools %}# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
        "For each function call, return a json object within <tool_call></tool_call> XML tags{% endif %}")
LLAMA = "{%- if tools %}Given the following functions, please respond with a JSON for a function call{% endif %}"
LLAMA_33 = "{{- '<|python_tag|>' + tool_call.name }}"
MISTRAL_V3 = "{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS][{%- endif %}{%- endfor %}"


@pytest.mark.parametrize("template, expected", [(QWEN, HERMES), (LLAMA, LLAMA3_JSON), (LLAMA_33, LLAMA3_JSON),
                                               (MISTRAL_V3, MISTRAL), ("{{ messages }}", None), (None, None)])
def test_the_format_is_read_from_the_chat_template(template, expected):
    assert call_format(template) is expected


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tokenizers():
    """tiny's tokenizer, and llguidance's view of it."""
    import llguidance.hf
    from transformers import AutoTokenizer

    from uniun_ray.models import materialize, resolve

    tokenizer = AutoTokenizer.from_pretrained(materialize(resolve("tiny")))
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


@pytest.mark.parametrize("format_", [HERMES, LLAMA3_JSON, MISTRAL])
@pytest.mark.parametrize("choice", ["required", "weather"])
def test_any_text_the_grammar_allows_is_a_call_the_reader_reads_back(tokenizers, format_, choice):
    """Random walks through the grammar (any allowed token, as an untrained model picks them):
    each ends as calls of the offered (or named) tool, valid against its schema."""
    import jsonschema
    import numpy as np
    from llguidance import LLMatcher

    tokenizer, view = tokenizers
    grammar = LLMatcher.grammar_from_lark(call_grammar(format_, [WEATHER_TOOL, TIME_TOOL], choice, parallel=True))
    schemas = {"weather": WEATHER_TOOL["function"]["parameters"], "time": TIME_TOOL["function"]["parameters"]}
    draw = random.Random(7)
    for _ in range(3):
        matcher, tokens = LLMatcher(view, grammar), []
        while not matcher.is_stopped() and len(tokens) < 400:
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = [t for t in np.flatnonzero(bits[:len(tokenizer)]) if t != tokenizer.eos_token_id] \
                or [tokenizer.eos_token_id]
            token = int(draw.choice(allowed)) if draw.random() < 0.5 or not matcher.is_accepting() \
                else tokenizer.eos_token_id
            if token == tokenizer.eos_token_id:
                break
            assert matcher.consume_token(token)
            tokens.append(token)
        assert matcher.is_accepting()
        content, calls = read_calls(format_, ["weather", "time"], tokenizer.decode(tokens))
        assert content == "" and calls
        for call in calls:
            assert choice in ("required", call.name)
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            assert json.dumps(json.loads(call.arguments), ensure_ascii=False) == call.arguments  # as tojson renders it
