"""How a job's text reads as OpenAI's answer: a completion's `text`, or a chat `message` whose
tool calls are read out of what the model wrote (`models.requests.tools`), whole or streamed.

One `Reading` per job. A chat that offers tools reads its answer with the tool-call reader of
the format the model's chat template teaches (hermes, llama3_json, mistral); the answer's
`uniun.tool_call_format` names it, and says so where the template's format is unknown (the
answer is then content, as it was written). Streamed, a call comes as OpenAI streams it: a
delta naming it (index, id, type, function.name, empty arguments), then fragments of its
arguments; content deltas as they are decided (the reader holds back what may open a call).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..models.requests.tools import UNKNOWN, CallDelta, CallReader, call_format, tool_names
from .schemas import ChatCompletionRequest, JobFields


class Reading:
    """A completion's text as it comes: one choice field, `text` or `message.content`."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat

    def whole(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}

    def delta(self, text: str | None = None, role: str | None = None) -> dict:
        if not self.chat:
            return {"text": text or ""}
        return {"delta": {k: v for k, v in (("role", role), ("content", text)) if v is not None}}

    def pieces(self, piece: str) -> list[dict]:
        """The deltas a piece of the stream makes (none while held back)."""
        return [self.delta(piece)]

    def end(self) -> list[dict]:
        """The deltas of what was held back when the stream ended."""
        return []

    def finish_reason(self, reason: str) -> str:
        return reason

    def facts(self) -> dict:
        return {}


class CallReading(Reading):
    """A chat answer that may hold tool calls, read by `CallReader`."""

    def __init__(self, reader: CallReader | None, format_name: str) -> None:
        super().__init__(chat=True)
        self.reader, self.format_name = reader, format_name

    def whole(self, text: str) -> dict:
        if self.reader is None:
            return super().whole(text)
        items = self.reader.feed(text) + self.reader.finish()
        content = "".join(item for item in items if isinstance(item, str))
        message = {"role": "assistant", "content": content or (None if self.reader.calls else "")}
        if self.reader.calls:
            message["tool_calls"] = [call.as_openai() for call in self.reader.calls]
        return {"message": message}

    def pieces(self, piece: str) -> list[dict]:
        return super().pieces(piece) if self.reader is None else self._deltas(self.reader.feed(piece))

    def end(self) -> list[dict]:
        return [] if self.reader is None else self._deltas(self.reader.finish())

    def _deltas(self, items: list[str | CallDelta]) -> list[dict]:
        return [self.delta(item) if isinstance(item, str) else {"delta": {"tool_calls": [_call_delta(item)]}}
                for item in items]

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.reader is not None and self.reader.calls and reason == "stop" else reason

    def facts(self) -> dict:
        return {"tool_call_format": self.format_name}


def _call_delta(delta: CallDelta) -> dict:
    if delta.id is not None:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": ""}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


async def reading(body: JobFields, model: Callable[[], str]) -> Reading:
    """How the answer of ``body``'s job reads; ``model`` names the model it runs on (asked only
    where the answer may hold calls)."""
    if not isinstance(body, ChatCompletionRequest):
        return Reading(chat=False)
    if not body.offers_tools():
        return Reading(chat=True)
    format_ = call_format(await asyncio.to_thread(_template, model()))
    if format_ is None:
        return CallReading(None, UNKNOWN)
    names = tool_names(tool.model_dump() for tool in body.tools)
    return CallReading(CallReader(format_, names, None if body.parallel_tool_calls is not False else 1), format_.name)


def _template(model_id: str) -> str | None:
    from ..models.registry import resolve
    from ..models.requests.vocabulary import chat_template

    return chat_template(resolve(model_id))
