"""Request checks: what a request is checked against (a model's tokenizer and context window,
not its weights), and the token ids it prefills.

Torch-free (transformers is imported only to read a tokenizer and config), so the runtime can
refuse a request (`PromptTooLong`, a ValueError) before it is queued, with no model loaded.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

from .prompt import encode, takes_tools
from ..registry import ModelSpec, materialize
from .request import GenerateRequest, _is_int
from .tools import UNKNOWN, call_format


class PromptTooLong(ValueError):
    """The prompt plus the tokens asked for do not fit the model's context window."""


@dataclass(frozen=True)
class Vocabulary:
    """What a request is checked against: a model's tokenizer and limits, not its weights."""

    model_id: str
    tokenizer: Any
    context_length: int
    chat: bool


def inspect_request(spec: ModelSpec, request: GenerateRequest) -> int:
    """Check ``request`` against a model that need not be loaded; return its prefill token count.

    Reads only the model's tokenizer and config (cached per model), so a client's request can be
    refused before it is queued, rather than after the scheduler has swapped the model in for it.
    ValueError: the request does not suit the model (messages without a chat template, token ids
    outside the vocabulary, an empty prompt). PromptTooLong: prompt + resumed output +
    max_new_tokens exceed the context window.
    """
    return len(prompt_ids(spec, request))


def prompt_ids(spec: ModelSpec, request: GenerateRequest) -> list[int]:
    """The token ids a run of ``request`` prefills (template, prompt and resumed output), for an
    engine that tokenizes outside this process's model (vLLM's server takes token ids)."""
    return context_of(_vocabulary_of(spec), request)


def chat_template(spec: ModelSpec) -> str | None:
    """The model's chat template (None for a completion model), read from its tokenizer: what
    a server reads the model's tool-call format from (`tools.call_format`)."""
    return getattr(_vocabulary_of(spec).tokenizer, "chat_template", None)


def tool_call_format(spec: ModelSpec) -> str | None:
    """What `status` says of the model's tool calls: the format its template teaches (`tools`),
    `tools.UNKNOWN` for a template that takes tools in a format not known here, None for one
    that takes none."""
    template = chat_template(spec)
    if not takes_tools(template):
        return None
    format_ = call_format(template)
    return UNKNOWN if format_ is None else format_.name


_VOCABULARY_LOCK = threading.Lock()


def _vocabulary_of(spec: ModelSpec) -> Vocabulary:
    """Serialised: transformers' lazy imports are not thread-safe on first use (two concurrent
    checks once failed with "cannot import name 'AutoConfig'"), and one conversion is enough."""
    with _VOCABULARY_LOCK:
        return _cached_vocabulary(spec)


@functools.lru_cache(maxsize=8)
def _cached_vocabulary(spec: ModelSpec) -> Vocabulary:
    from transformers import AutoConfig, AutoTokenizer

    folder = materialize(spec)
    return read_vocabulary(spec.id, AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder))


def read_vocabulary(model_id: str, tokenizer: Any, config: Any) -> Vocabulary:
    length = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not _is_int(length) or length < 1:
        raise ValueError(
            f"model {model_id!r} declares no max_position_embeddings; its context length is unknown"
        )
    return Vocabulary(
        model_id=model_id,
        tokenizer=tokenizer,
        context_length=length,
        chat=bool(getattr(tokenizer, "chat_template", None)),
    )


def context_of(vocabulary: Vocabulary, request: GenerateRequest) -> list[int]:
    """The token ids to prefill for ``request``; raises if the model cannot run it."""
    if not isinstance(request, GenerateRequest):
        raise ValueError(f"request must be a GenerateRequest, got {type(request).__name__}")
    context = encode(vocabulary.tokenizer, vocabulary.chat, vocabulary.model_id, request)
    if not context:
        raise ValueError("the prompt encodes to zero tokens; there is nothing to continue")
    request.check_vocabulary(len(vocabulary.tokenizer), vocabulary.model_id)
    needed = len(context) + request.max_new_tokens
    if needed > vocabulary.context_length:
        resumed = len(request.resume_tokens)
        raise PromptTooLong(
            f"prompt is {len(context) - resumed} tokens"
            + (f" + {resumed} resumed" if resumed else "")
            + f" + max_new_tokens {request.max_new_tokens} = {needed} tokens, more than the "
            f"context length {vocabulary.context_length} of model {vocabulary.model_id!r}"
        )
    return context
