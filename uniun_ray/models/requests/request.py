"""What a generation asks for, validated where it is built, and how it ended.

Kept apart from the engine (and from torch) so that clients, producers, the CLI and the
runtime can build requests and read results without importing the model stack.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: OpenAI's ranges: presence and frequency penalties, and a logit bias.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
#: The JSON Schema of OpenAI's ``response_format: json_object``: any JSON object.
JSON_OBJECT = {"type": "object"}


class InvalidRequest(ValueError):
    """A field of a request that cannot be served; ``field`` names it (a ``GenerateRequest``
    field), so that an API can point its client at the parameter it sent."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # crosses Ray with its field
        return type(self), (self.args[0], self.field)


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation: a prompt or chat messages, and how to continue a revoked job.

    Exactly one of ``prompt`` and ``messages`` is given. ``messages`` needs a model with a chat
    template. A plain ``prompt`` sent to a chat model is wrapped as a single user turn, because
    chat models answer raw text poorly; on a completion model it is continued as is. A prompt of
    token ids (the model's own) is read exactly as given: no template, no BOS added. A message's
    ``content`` may be None for an assistant turn that only called tools; other keys
    (``tool_calls``, ``tool_call_id``, ``name``) go to the template as they are. ``tools``
    (OpenAI's function tools) are rendered by a chat template that takes them.

    Resuming a revoked job, the engine prefills prompt + what the job already produced and
    returns only the new text. Give that output as one of:

    * ``resume_tokens``: the token ids from the revoked run's ``GenerationResult.token_ids``.
      Exact: greedy decoding then yields the same text as an uninterrupted run (in float32; in
      lower precision a recomputed prefill can round differently and flip a near-tie).
    * ``resume_text``: the text produced so far. It is re-tokenized together with the prompt,
      which may split it into different tokens than the model produced, so the continuation can
      differ from an uninterrupted run. Use it when the token ids are not at hand.

    Sampling, as transformers' ``generate`` reads it: ``temperature`` 0 is greedy (deterministic);
    above 0 samples, shaped by ``top_k`` (0: off), ``top_p`` (1: off) and ``repetition_penalty``
    (1: off). A field left None takes the model's ``generation_config`` value (so a model whose
    config says ``do_sample`` samples by default; the embedded ones are greedy). ``seed`` makes a
    sampled run repeatable. ``stop``: strings that end the run; the text returned stops before
    the first of them (OpenAI's ``stop``).

    OpenAI's logit shaping, applied to the logits before sampling: ``presence_penalty`` and
    ``frequency_penalty`` (-2..2) lower a token's logit once if it already appears in the output,
    and once per appearance; ``logit_bias`` ({token id: -100..100}) is added to the logits.
    ``json_schema``: the output is JSON valid against this JSON Schema by construction (a
    grammar masks every token that would break it); ``JSON_OBJECT`` is OpenAI's json_object.
    ``tool_choice``: "auto" (the model may call ``tools``), "required" (it calls one) or a tool's
    name (it calls that one); a forced call is written through a grammar too, in the format the
    model's template teaches (`tools.call_grammar`), one call unless ``parallel_tool_calls``.
    """

    prompt: str | tuple[int, ...] | None = None
    messages: list[dict] | None = None
    max_new_tokens: int = 128
    resume_text: str = ""
    resume_tokens: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    json_schema: Mapping | None = None
    tools: tuple[dict, ...] = ()
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and not isinstance(self.prompt, str):
            if isinstance(self.prompt, bytes) or not isinstance(self.prompt, Sequence):
                raise InvalidRequest(f"prompt must be a str or a sequence of token ids, got "
                                     f"{type(self.prompt).__name__}", "prompt")
            object.__setattr__(self, "prompt", _token_tuple(self.prompt, "prompt"))
            if not self.prompt:
                raise InvalidRequest("prompt holds no token ids", "prompt")
        if self.messages is not None:
            _check_messages(self.messages)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}", "max_new_tokens")
        if not isinstance(self.resume_text, str):
            raise ValueError(f"resume_text must be a str, got {type(self.resume_text).__name__}")
        object.__setattr__(self, "resume_tokens", _token_tuple(self.resume_tokens, "resume_tokens"))
        if self.resume_text and self.resume_tokens:
            raise ValueError("give resume_tokens or resume_text, not both")
        _check_optional(self.temperature, "temperature", "a finite number >= 0", lambda v: _is_real(v) and 0 <= v)
        _check_optional(self.top_p, "top_p", "a number in (0, 1]", lambda v: _is_real(v) and 0 < v <= 1)
        _check_optional(self.top_k, "top_k", "an int >= 0", lambda v: _is_int(v) and v >= 0)
        _check_optional(self.repetition_penalty, "repetition_penalty", "a finite number > 0",
                        lambda v: _is_real(v) and v > 0)
        _check_optional(self.seed, "seed", "an int >= 0", lambda v: _is_int(v) and v >= 0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_optional(getattr(self, name), name, "a number in [-2, 2]", _within(PENALTY_RANGE))
        object.__setattr__(self, "stop", _stop_tuple(self.stop))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.json_schema is not None:
            _check_json_schema(self.json_schema)
        object.__setattr__(self, "tools", _tools(self.tools))
        if self.tools and self.messages is None:
            raise InvalidRequest("tools need messages (a chat), not a prompt", "tools")
        _check_tool_choice(self)

    def check_vocabulary(self, size: int, model_id: str) -> None:
        """Raise InvalidRequest for a token id the model's vocabulary of ``size`` lacks."""
        for name in ("prompt", "resume_tokens", "logit_bias"):
            ids = getattr(self, name)
            if isinstance(ids, (tuple, Mapping)) and any(token >= size for token in ids):
                raise InvalidRequest(f"{name} holds token ids outside {model_id!r}'s vocabulary of {size}", name)

    @property
    def forces_call(self) -> bool:
        return self.tool_choice != "auto"

    @property
    def sampling(self) -> dict:
        """The sampling fields that were given, as ``GenerationConfig`` names them."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "repetition_penalty": self.repetition_penalty}
        return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True)
class GenerationResult:
    """How a run ended. Set on ``Generation.result`` once its iterator is exhausted or closed.

    ``text`` is the concatenation of the pieces yielded. ``token_ids`` are the tokens behind that
    text (the end-of-sequence token excluded); pass them as ``resume_tokens`` to continue after a
    revoke. On cancel, a token or two whose text was still incomplete (a multi-byte character
    split across tokens) is left out of both, so the resumed run recomputes it instead of the
    text losing a character. ``finish_reason`` is "eos", "length" (max_new_tokens reached),
    "stop" (a stop string; the text ends before it), "cancel" (the flag was set, or the
    consumer closed the iterator) or "error" (the model raised; the exception reached the
    consumer). ``ttft_s`` is the time from
    the start of the run (its first ``next``) to the first sampled token, None if none was.
    ``cached_tokens`` of the ``prompt_tokens`` came from the prefix cache; the rest were
    prefilled, in ``prefill_s`` (the cache lookup included; None: cancelled before the end).
    ``mean_batch``: the jobs that decoded together in its decode steps, on average (1.0: it ran
    alone; None: it decoded no step), what a device with slots shared with it (SPEC §6).
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float | None
    total_s: float
    cached_tokens: int = 0
    prefill_s: float | None = None
    mean_batch: float | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stopped_by_cancel(self) -> bool:
        return self.finish_reason == "cancel"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _within(bounds: tuple[float, float]):
    return lambda v: _is_real(v) and bounds[0] <= v <= bounds[1]


def _check_optional(value: Any, name: str, what: str, valid) -> None:
    if value is not None and not (valid(value) and math.isfinite(value)):
        raise InvalidRequest(f"{name} must be {what}, got {value!r}", name)


def _logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias}; ids may come as JSON's string keys ("50256")."""
    if not isinstance(bias, Mapping):
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {type(bias).__name__}", "logit_bias")
    out = {}
    for token, value in bias.items():
        token = int(token) if isinstance(token, str) and token.isdigit() else token
        if not (_is_int(token) and token >= 0):
            raise InvalidRequest(f"logit_bias keys must be token ids (ints >= 0), got {token!r}", "logit_bias")
        _check_optional(value, "logit_bias", "a map of token ids to numbers in [-100, 100]",
                        _within(LOGIT_BIAS_RANGE))
        out[token] = float(value)
    return out


def _check_json_schema(schema: Any) -> None:
    """A JSON Schema the grammar compiler takes (llguidance's own check, no tokenizer needed)."""
    from llguidance import LLMatcher

    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"json_schema must be a JSON Schema object, got {type(schema).__name__}", "json_schema")
    try:
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(dict(schema)))
    except (ValueError, TypeError) as invalid:
        error = str(invalid)
    if error:
        raise InvalidRequest(f"json_schema is not a JSON Schema this server can follow: {error}", "json_schema")


def _tools(tools: Any) -> tuple[dict, ...]:
    """OpenAI's function tools: {"type": "function", "function": {"name": ..., ...}}."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequest(f"tools must be a list of function tools, got {type(tools).__name__}", "tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type") != "function" \
                or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}",
                                 "tools")
    return tuple(tools)


def _check_tool_choice(request: GenerateRequest) -> None:
    choice = request.tool_choice
    names = [tool["function"]["name"] for tool in request.tools]
    if not isinstance(choice, str) or not (choice in ("auto", "required") or choice in names):
        raise InvalidRequest(f"tool_choice must be 'auto', 'required' or the name of an offered tool "
                             f"({', '.join(names) or 'none offered'}), got {choice!r}", "tool_choice")
    if not isinstance(request.parallel_tool_calls, bool):
        raise InvalidRequest(f"parallel_tool_calls must be a bool, got {request.parallel_tool_calls!r}",
                             "parallel_tool_calls")
    if choice == "required" and not names:
        raise InvalidRequest("tool_choice 'required' needs tools to call", "tool_choice")
    if choice != "auto" and request.json_schema is not None:
        raise InvalidRequest("a forced tool call is its own grammar: give json_schema or a tool_choice that "
                             "forces a call, not both", "tool_choice")


def _stop_tuple(stop: Any) -> tuple[str, ...]:
    """One string or a sequence of non-empty strings (OpenAI accepts both)."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest(f"stop must be a string or a list of non-empty strings, got {stop!r}", "stop")
    return tuple(stop)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role': str, 'content': str} dicts", "messages")
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not (isinstance(content, str) or content is None and message["role"] == "assistant")
        ):
            raise InvalidRequest(
                f"messages[{index}] must be a dict with str 'role' and str 'content' (None only for an "
                f"assistant), got {message!r}", "messages")


def _token_tuple(tokens: Any, name: str) -> tuple[int, ...]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidRequest(f"{name} must be a sequence of token ids, got {type(tokens).__name__}", name)
    if not all(_is_int(token) and token >= 0 for token in tokens):
        raise InvalidRequest(f"{name} must hold non-negative int token ids", name)
    return tuple(tokens)


