"""A request's prompt as the model reads it: token ids, through the chat template where there is one.

OpenAI's chat messages reach the template as Hugging Face templates expect them: an assistant
turn that only called tools has content "" (OpenAI sends null), a tool call's ``arguments`` are
a dict (OpenAI sends a JSON string), and ``tools`` go to a template that takes them. A template
that cannot render a conversation (a role it refuses, turns out of order) is the client's
error, named as such.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from .request import GenerateRequest, InvalidRequest
from .tools import UNKNOWN_FORMAT, call_format


def encode(tokenizer: Any, chat: bool, model_id: str, request: GenerateRequest) -> list[int]:
    """Token ids of the prompt (templated for a chat model) followed by the resumed output. A
    prompt of token ids is read as it is."""
    if request.messages is not None and not chat:
        raise InvalidRequest(f"model {model_id!r} has no chat template; send a prompt, not messages", "messages")
    if isinstance(request.prompt, tuple):
        resumed = tokenizer(request.resume_text, add_special_tokens=False)["input_ids"] if request.resume_text else []
        return list(request.prompt) + list(resumed) + list(request.resume_tokens)
    if chat:
        text = render(tokenizer, model_id, request)
        add_special_tokens = False  # the template writes its own BOS where the model wants one
    else:
        text = request.prompt
        add_special_tokens = True
    ids = tokenizer(text + request.resume_text, add_special_tokens=add_special_tokens)["input_ids"]
    return list(ids) + list(request.resume_tokens)


def render(tokenizer: Any, model_id: str, request: GenerateRequest) -> str:
    """The conversation through the model's chat template, ready for the assistant's turn."""
    from jinja2 import TemplateError

    if request.tools and not takes_tools(tokenizer.chat_template):
        raise InvalidRequest(f"model {model_id!r}'s chat template does not render tools: send the request "
                             f"without tools, or use a model whose template takes them", "tools")
    if request.forces_call and call_format(tokenizer.chat_template) is None:
        raise InvalidRequest(f"model {model_id!r}: {UNKNOWN_FORMAT}", "tool_choice")
    messages = [_for_template(m) for m in request.messages or [{"role": "user", "content": request.prompt}]]
    try:
        return tokenizer.apply_chat_template(messages, tools=list(request.tools) or None,
                                             add_generation_prompt=True, tokenize=False)
    except (TemplateError, TypeError) as error:
        raise InvalidRequest(f"model {model_id!r}'s chat template cannot render these messages: {error}",
                             "messages") from None


@functools.lru_cache(maxsize=16)
def takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (Hugging Face's convention for
    templates with tool support)."""
    if not template:
        return False
    from jinja2 import Environment, meta

    return "tools" in meta.find_undeclared_variables(Environment().parse(template))


def _for_template(message: dict) -> dict:
    message = dict(message)
    if message.get("content") is None:
        message["content"] = ""
    if message.get("tool_calls"):
        message["tool_calls"] = [_call(call) for call in message["tool_calls"]]
    return message


def _call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return call | {"function": function | {"arguments": arguments}}
