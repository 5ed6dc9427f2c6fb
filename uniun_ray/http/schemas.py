"""Request bodies of the OpenAI-compatible API (SPEC §4), as pydantic models.

FastAPI validates every body against these before a route runs; a body that does not fit
is answered 400 in OpenAI's error shape (see `errors`), never 500. Fields OpenAI defines
that this server does not use are accepted and ignored (OpenAI clients send them), unless
honouring them is impossible and silently ignoring them would give a wrong answer (`n` > 1,
`echo`, `logprobs`): those are refused with a 400 naming the field.

uniun's own fields (`kind`, `producer`, `deadline`, `subject`, `foreground_hint`) ride in
the same body; the `openai` SDK sends them with `extra_body={...}`.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

KindName = Literal["chat", "nataraj", "gana", "extract"]
Role = Literal["system", "developer", "user", "assistant"]
#: OpenAI's limit on stop sequences.
MAX_STOP = 4
#: The most tokens one request may ask for (the models here have 2k-8k contexts; the
#: engine refuses a prompt + max_tokens over the model's context with context_length_exceeded).
MAX_TOKENS = 1_000_000

Number = StrictInt | StrictFloat
PositiveTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]


class TextPart(BaseModel):
    """One part of a message's content list; only text parts are served here."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system"
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class JobFields(BaseModel):
    """What makes a request a job of the policy (SPEC §1), and OpenAI's generation fields
    common to both generation routes."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    kind: KindName = "chat"
    producer: StrictStr | None = Field(default=None, min_length=1)
    deadline: Number | None = None
    subject: StrictStr | None = None
    foreground_hint: StrictBool = False
    user: StrictStr | None = None

    stream: StrictBool = False
    stream_options: dict | None = None
    max_tokens: PositiveTokens | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    n: Literal[1] | None = None
    seed: StrictInt | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None                 # vLLM's extras
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None

    @field_validator("deadline")
    @classmethod
    def _finite(cls, value):
        if value is not None and not math.isfinite(value):
            raise ValueError("deadline must be finite epoch seconds")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value or None

    def model_id(self) -> str | None:
        """None means the active chat model (SPEC §4: omitted or "default")."""
        return None if self.model in (None, "", "default") else self.model

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(JobFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveTokens | None = None
    logprobs: Literal[False] | None = None

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(JobFields):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    echo: Literal[False] | None = None
    logprobs: None = None
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        return value[0] if isinstance(value, list) else value

    def new_tokens(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=2048)]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None
    user: StrictStr | None = None

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class ForegroundRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: KindName | None = None
    subject: StrictStr | None = None
