"""Tool calls in a model's own words: which format a chat template teaches, reading the calls
back out of the text the model writes (as it streams), and the grammar that forces one.

A model that takes tools writes its calls in the format its chat template shows it, and the
template is the one place that says which: `call_format` reads it from the template's markers,
so no user has to name a parser (vLLM's `--tool-call-parser`). Three formats are known:

* ``hermes`` (Qwen2.5, Hermes, many fine-tunes): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block per call, after any content;
* ``llama3_json`` (Llama 3.1/3.2/3.3 Instruct): the answer *is* the call, a JSON object
  ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` may open it), calls joined by ``;``;
* ``mistral`` (Mistral-7B-Instruct-v0.3 and its kin): ``[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]`` after any content; at the answer's start the list alone is calls too (the
  marker is a special token there, which the detokenizer drops from the text).

`CallReader` reads a text as it streams in (pieces of any size) into content and call deltas,
as OpenAI streams them: a call's first delta names it (index, id, name), the next ones carry
fragments of its arguments (a JSON text). Its decisions depend only on the text read so far,
so the same text read in any pieces gives the same answer. Only what is a call of an offered
tool in the format becomes one: a marker followed by anything else, an unknown tool's name or
JSON that is not a call stays content, from the marker on (and so does all that follows it).

`call_grammar` writes llguidance's grammar (Lark, the arguments as JSON Schemas) for a call the
request forces (``tool_choice`` "required" or a tool's name): the model then writes, token by
token, a call of an offered tool whose arguments are valid against its schema, in its format,
so that `CallReader` reads it back from the text like any other.

Pure Python (the grammar is text; llguidance compiles it where the tokens are).
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import regex

from .request import GenerateRequest, InvalidRequest

#: A forced call's tool_choice: any offered tool.
REQUIRED = "required"


@dataclass(frozen=True)
class CallFormat:
    """How one family of templates writes calls. ``marker``: what opens the calls anywhere in
    the answer (None: calls only open the answer); ``opening``: what may follow the marker (or
    start the answer) before the first call's JSON; ``after``: what follows a call's JSON, a
    pattern whose group ``next`` means another call follows at once and ``done`` that the calls
    end there (neither: the calls end and what follows is content). ``bare``: the calls may also
    open the answer without the marker, a special token that a detokenizer drops (Mistral's)."""

    name: str
    marker: str | None
    opening: str
    after: str
    arguments_key: str
    bare: bool
    #: in `call_grammar`: text before the first call, between two, after the last
    grammar_open: str
    grammar_between: str
    grammar_close: str


HERMES = CallFormat("hermes", marker="<tool_call>", opening=r"\s*(?=\{)", after=r"\s*(?P<done></tool_call>)",
                    arguments_key="arguments", bare=False, grammar_open="<tool_call>\n",
                    grammar_between="\n</tool_call>\n<tool_call>\n", grammar_close="\n</tool_call>")
LLAMA3_JSON = CallFormat("llama3_json", marker=None, opening=r"\s*(?:<\|python_tag\|>\s*)?(?=\{)",
                         after=r"\s*(?P<next>;)\s*", arguments_key="parameters", bare=False, grammar_open="",
                         grammar_between="; ", grammar_close="")
MISTRAL = CallFormat("mistral", marker="[TOOL_CALLS]", opening=r"\s*\[\s*(?=\{)",
                     after=r"\s*(?:(?P<next>,)\s*|(?P<done>\]))",
                     arguments_key="arguments", bare=True, grammar_open="[TOOL_CALLS][", grammar_between=", ",
                     grammar_close="]")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}

#: What in a chat template shows its format (the first that matches names it).
_TEMPLATE_MARKERS = ((HERMES, ("<tool_call>",)),
                     (MISTRAL, ("[TOOL_CALLS]",)),
                     (LLAMA3_JSON, ("<|python_tag|>", "respond with a JSON for a function call")))


def call_format(template: str | None) -> CallFormat | None:
    """The tool-call format a chat template teaches its model; None for one this module does not
    know (its answers are then content only)."""
    for format_, markers in _TEMPLATE_MARKERS:
        if template and any(marker in template for marker in markers):
            return format_
    return None


# -- reading calls --------------------------------------------------------------------------
@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index``: the first names it (``id``, ``name``), the rest add
    ``arguments`` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """OpenAI's shape of a call id."""
    return "call_" + secrets.token_hex(12)


#: A call's JSON up to its arguments' opening brace, in the order the templates write it.
_HEAD = regex.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')


class CallReader:
    """Reads a model's answer, in the pieces it streams, into content and tool calls of
    ``format_`` (see the module's note). ``tools``: the names offered; ``max_calls``: 1 when
    parallel calls are off (what follows the first call is dropped, as OpenAI never sends it)."""

    def __init__(self, format_: CallFormat, tools: Iterable[str], max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.format, self.tools, self.max_calls, self.new_id = format_, frozenset(tools), max_calls, new_id
        self.calls: list[ToolCall] = []
        self._held = ""                     # text read but not yet decided
        self._raw = ""                      # the calls' text since the marker, for content if they fail
        self._state = "bare" if format_.bare else "content" if format_.marker else "opening"
        self._space = ""                    # content's trailing whitespace, dropped before a call
        self._json: _JsonScanner | None = None
        self._object = ""                   # a call read whole (`_read_whole`)
        self._out: list[str | CallDelta] = []

    def feed(self, text: str) -> list[str | CallDelta]:
        """What ``text`` adds: content (str) and call deltas, in order."""
        self._held += text
        while self._held and self._step():
            pass
        return self._take()

    def finish(self) -> list[str | CallDelta]:
        """The end of the answer: what was held back is decided."""
        if self._state in ("content", "text"):
            self._content(self._held)
            if not self.calls and self._space:    # an answer's own last whitespace, kept
                self._out.append(self._space)
        elif self._state in ("bare", "opening", "head", "whole"):
            self._content(self._raw + self._held)        # a call that never got going is content
        self._held, self._space, self._state = "", "", "dropped"
        return self._take()

    # -- the states: each step decides what it can of `_held`; False: it needs more text -----
    def _step(self) -> bool:
        return getattr(self, f"_read_{self._state}")()

    def _read_content(self) -> bool:
        marker = self.format.marker
        at = self._held.find(marker)
        if at < 0:
            keep = _partial_suffix(self._held, marker)
            self._content(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return False
        self._content(self._held[:at])
        self._raw, self._held, self._state = marker, self._held[at + len(marker):], "opening"
        return True

    def _read_bare(self) -> bool:
        """The answer's start, where the calls may open without their marker (`CallFormat.bare`)."""
        found = regex.match(self.format.opening, self._held, partial=True)
        if found is not None and found.partial:
            return False
        self._state = "content" if found is None else "opening"
        return True

    def _read_text(self) -> bool:
        self._content(self._held)
        self._held = ""
        return False

    def _read_dropped(self) -> bool:
        self._held = ""
        return False

    def _read_opening(self) -> bool:
        found = regex.match(self.format.opening, self._held, partial=True)
        if found is None:
            return self._fail()
        if found.partial:
            return False
        self._consume(found.end())
        self._state = "head"
        return True

    def _read_head(self) -> bool:
        found = _HEAD.match(self._held, partial=True)
        if found is not None and found.partial:
            return False
        if found is None or found.group(1) not in self.tools:
            if found is None and self._held.startswith("{"):
                self._json, self._object, self._state = _JsonScanner(), "", "whole"
                return True
            return self._fail()
        self._open_call(found.group(1))
        self._consume(found.end() - 1)      # the arguments' brace is theirs
        self._json, self._state = _JsonScanner(), "arguments"
        return True

    def _read_whole(self) -> bool:
        """A call whose keys come in another order: read whole, then judged."""
        end = self._json.scan(self._held)
        taken = len(self._held) if end is None else end
        self._object += self._held[:taken]
        self._consume(taken)
        if end is None:
            return False
        try:
            call = json.loads(self._object)      # an object: it began with "{" and ended at its "}"
        except ValueError:
            return self._fail()
        arguments = call.get(self.format.arguments_key, call.get("arguments"))
        if set(call) - {"name", "arguments", "parameters"} or call.get("name") not in self.tools \
                or not isinstance(arguments, dict):
            return self._fail()
        self._open_call(call["name"])
        self._arguments(json.dumps(arguments, ensure_ascii=False))   # as the templates' tojson writes it
        self._state = "after"
        return True

    def _read_arguments(self) -> bool:
        end = self._json.scan(self._held)
        taken = len(self._held) if end is None else end
        self._arguments(self._held[:taken])
        self._consume(taken)
        if end is None:
            return False
        self._state = "close"
        return True

    def _read_close(self) -> bool:
        found = regex.match(r"\s*\}", self._held, partial=True)
        if found is not None and found.partial:
            return False
        if found is None:                   # the call ended without its brace: what follows is content
            self._state = "text"
            return True
        self._consume(found.end())
        self._state = "after"
        return True

    def _read_after(self) -> bool:
        found = regex.match(self.format.after, self._held, partial=True)
        if found is not None and (found.partial or found.end() == len(self._held) and found.groupdict().get("next")):
            return False
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self._state = "dropped"
            return True
        if found is None:
            self._state = "text" if self.format.marker is None else "content"
            self._raw = ""
            return True
        self._consume(found.end())
        self._raw = ""
        self._state = "head" if found.groupdict().get("next") else "content"
        return True

    # -- what the states do -----------------------------------------------------------------
    def _fail(self) -> bool:
        """Not a call after all: everything since the marker is content, and so is the rest."""
        self._content(self._raw + self._held)
        self._raw = self._held = ""
        self._state = "text"
        return False

    def _consume(self, count: int) -> None:
        self._raw += self._held[:count]
        self._held = self._held[count:]

    def _content(self, text: str) -> None:
        text, self._space = self._space + text, ""
        body = text.rstrip()
        if body:
            self._out.append(body)
        self._space = text[len(body):]

    def _open_call(self, name: str) -> None:
        self._space = ""                    # whitespace before a call is no content
        call = ToolCall(self.new_id(), name, "")
        self.calls.append(call)
        self._out.append(CallDelta(len(self.calls) - 1, id=call.id, name=name))

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            self._out.append(CallDelta(len(self.calls) - 1, arguments=text))

    def _take(self) -> list[str | CallDelta]:
        out, self._out = self._out, []
        return out


class _JsonScanner:
    """Finds where a JSON object ends, text read in pieces: its brackets outside strings."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> int | None:
        """Where in ``text``, the object's next piece, the object ends; None: it goes on."""
        for at, char in enumerate(text):
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = char == "\\"
                self.in_string = char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def read_calls(format_: CallFormat, tools: Iterable[str], text: str, max_calls: int | None = None,
               new_id: Callable[[], str] = new_call_id) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls."""
    reader = CallReader(format_, tools, max_calls, new_id)
    content = "".join(item for item in reader.feed(text) + reader.finish() if isinstance(item, str))
    return content, reader.calls


# -- forcing a call ---------------------------------------------------------------------------
def tool_names(tools: Iterable[Mapping]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


#: How a forced call lays out its arguments: as `json.dumps` and the templates' `tojson` do, so
#: that the conversation rendered again holds the call as the model wrote it (the prefix cache
#: then reuses the turn through the call).
ARGUMENTS_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_grammar(format_: CallFormat, tools: Iterable[Mapping], choice: str, parallel: bool) -> str:
    """llguidance's grammar (Lark) of a forced answer: one call (several when ``parallel``) of
    the tool named ``choice``, or of any offered tool for "required", in ``format_``; each call's
    arguments follow its tool's JSON Schema (any object where it gives none)."""
    offered = [tool["function"] for tool in tools if choice in (REQUIRED, tool["function"]["name"])]
    more = f"({_literal(format_.grammar_between)} call)*" if parallel else ""
    start = [_literal(format_.grammar_open), "call", more, _literal(format_.grammar_close)]
    rules = ["start: " + " ".join(part for part in start if part not in ("", '""')),
             "call: " + " | ".join(f"call_{i}" for i in range(len(offered)))]
    for i, function in enumerate(offered):
        head = f'{{"name": {json.dumps(function["name"])}, "{format_.arguments_key}": '
        schema = dict(function.get("parameters") or {"type": "object"})
        schema.setdefault("x-guidance", ARGUMENTS_LAYOUT)
        rules += [f"call_{i}: {_literal(head)} arguments_{i} {_literal('}')}",
                  f"arguments_{i}: %json {json.dumps(schema)}"]
    return "\n".join(rules) + "\n"


def _literal(text: str) -> str:
    return json.dumps(text)


def request_grammar(request: GenerateRequest, template: str | None) -> str | None:
    """The llguidance grammar a request's output follows (its JSON Schema, or the forced call in
    the format ``template`` teaches), None for free text: what both engines' masks compile."""
    from llguidance import LLMatcher

    if request.json_schema is not None:
        return LLMatcher.grammar_from_json_schema(dict(request.json_schema))
    if not request.forces_call:
        return None
    format_ = call_format(template)
    if format_ is None:
        raise InvalidRequest(UNKNOWN_FORMAT, "tool_choice")
    return LLMatcher.grammar_from_lark(call_grammar(format_, request.tools, request.tool_choice,
                                                    request.parallel_tool_calls))


#: What `status` and an answer's `uniun.tool_call_format` say of a template whose format is unknown.
UNKNOWN = "unknown: the model's tool calls are answered as content"
#: Why a call cannot be forced on a model whose template shows no format this module reads.
UNKNOWN_FORMAT = ("the model's chat template writes tool calls in no format this server reads (hermes, "
                  "llama3_json, mistral): a call cannot be forced; with tool_choice 'auto' its answer is content")
