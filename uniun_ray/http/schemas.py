"""Request bodies of the OpenAI-compatible API (SPEC §4), as pydantic models.

FastAPI validates every body against these before a route runs; a body that does not fit
is answered 400 in OpenAI's error shape (see `errors`), never 500. No field is silently
ignored: each OpenAI field is honoured, or accepted only with the values this server
honours (`n` 1, `logprobs` false...: code `unsupported_value` otherwise), or refused
whenever it is set (`REFUSED`: code `unsupported_parameter`); a field OpenAI does not define
either is refused as `unknown_parameter`. Fields that only label a request (`user`,
`metadata`, `prompt_cache_key`, `safety_identifier`) are accepted: they change no output
(`user` names the job's flow).

uniun's own fields (`kind`, `producer`, `deadline`, `subject`, `foreground_hint`) ride in
the same body; the `openai` SDK sends them with `extra_body={...}`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr,
                      Tag, ValidationInfo, WithJsonSchema, field_validator)
from pydantic_core import PydanticCustomError

from ..models.requests.request import JSON_OBJECT, LOGIT_BIAS_RANGE, PENALTY_RANGE
from ..policy.types import Kind

KindName = Literal[tuple(kind.value for kind in Kind)]
#: OpenAI's limit on stop sequences.
MAX_STOP = 4
#: The most tokens one request may ask for (the models here have 2k-8k contexts; the
#: engine refuses a prompt + max_tokens over the model's context with context_length_exceeded).
MAX_TOKENS = 1_000_000
#: The most prompts (or embedding inputs) in one request, as OpenAI's embeddings allow.
MAX_INPUTS = 2048
#: The last ordinary token of OpenAI's cl100k_base (its special tokens and the gaps between
#: them, 100256 and up, are no text an embedding client sends).
CL100K_LAST = 100_255

#: OpenAI fields this server cannot honour: any value but null is refused, with these words.
REFUSED = {
    "top_logprobs": "log probabilities are not returned by this server",
    "functions": "`functions` is OpenAI's deprecated form of `tools`: send `tools`",
    "function_call": "`function_call` is OpenAI's deprecated form of `tool_choice`: send `tool_choice`",
    "audio": "this server reads and writes text only",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the models here do not reason before answering",
    "verbosity": "the models here have no verbosity setting",
    "web_search_options": "this server does not search the web",
    "suffix": "completions with a suffix (insertion) are not supported",
    "dimensions": "the embedding model's vectors have one size (384)",
}
#: OpenAI fields honoured with some values only: what another value gets, in these words.
ONLY = {
    "n": "n must be 1: this server makes one choice per prompt",
    "best_of": "best_of must be 1: this server makes one choice per prompt",
    "logprobs": "logprobs must be false or null: log probabilities are not returned by this server",
    "echo": "echo must be false: the prompt is not repeated in the answer",
    "store": "store must be false: answers are not stored",
    "service_tier": "service_tier must be 'auto' or 'default': there is one tier here (uniun's `kind` is the "
                    "scheduling class)",
    "modalities": "modalities must be [\"text\"]: this server reads and writes text only",
    "tool_choice": "tool_choice may force a call ('required' or a named function) only with tools",
    "parallel_tool_calls": "parallel_tool_calls may be given only with tools",
    "stream_options": "stream_options may be given only with stream: true",
}

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
PositiveTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]
Penalty = Annotated[float, Field(strict=True, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]


def _unicode(text: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800"), which is no text a tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"holds {text[error.start:error.end]!a}, a lone surrogate: not Unicode text") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("is empty: give the text the model should answer or continue")
    return text


#: A prompt: text with something in it (the client API refuses a blank one: the model would
#: babble from nothing). The schema's pattern is Python's `\S`, the same whitespace as strip's.
PromptText = Annotated[Text, AfterValidator(_not_blank), Field(json_schema_extra={"pattern": r"\S"})]


def _only(value: bool | int):
    """An OpenAI field honoured with one value only: that value, of its JSON type exactly
    (pydantic's Literal would also take 0 for false, 1.0 or true for 1, which the schema refuses)."""
    def check(given):
        if given != value:
            raise PydanticCustomError("unsupported_value", "unsupported value")
        return given
    kind, name = (StrictBool, "boolean") if isinstance(value, bool) else (StrictInt, "integer")
    return Annotated[kind, AfterValidator(check), WithJsonSchema({"const": value, "type": name})]
Nothing = Annotated[None, Field(description="not supported: omit it, or send null")]


class Strict(BaseModel):
    """Every body: unknown fields are refused (`unknown_parameter`), none is ignored."""

    model_config = ConfigDict(extra="forbid")


# -- messages ---------------------------------------------------------------------------------
class TextPart(Strict):
    type: Literal["text"]
    text: Text


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: Text


Content = Union[Text, Annotated[list[TextPart], Field(min_length=1)]]


def _joined(content: str | list | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(getattr(part, "text", None) or getattr(part, "refusal", "") for part in content)


class FunctionCall(Strict):
    name: Text
    arguments: Text


class ToolCall(Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Strict):
    role: Literal["system", "developer"]
    content: Content
    name: Text | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: Content
    name: Text | None = None


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Text | Annotated[list[TextPart | RefusalPart], Field(min_length=1)] | None = None
    name: Text | None = None
    refusal: Text | None = None
    tool_calls: list[ToolCall] | None = None
    audio: Nothing = None
    function_call: Nothing = None


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: Text


def _role(message: Any) -> str | None:
    """The message's union member (tags unlike any field name, so that an error's location
    reads as the fields it names: see `errors`)."""
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return f"{role}-message" if isinstance(role, str) else None


Message = Annotated[Union[Annotated[SystemMessage, Tag("system-message")],
                          Annotated[SystemMessage, Tag("developer-message")],
                          Annotated[UserMessage, Tag("user-message")],
                          Annotated[AssistantMessage, Tag("assistant-message")],
                          Annotated[ToolMessage, Tag("tool-message")]],
                    Discriminator(_role, custom_error_type="invalid_role",
                                  custom_error_message="role must be one of 'system', 'developer', 'user', "
                                                       "'assistant', 'tool'")]


def as_template_message(message: SystemMessage | UserMessage | AssistantMessage | ToolMessage) -> dict:
    """The message as chat templates read it: text content, the roles they know ("developer"
    is OpenAI's newer name for "system")."""
    out = {"role": "system" if message.role == "developer" else message.role, "content": _joined(message.content)}
    if getattr(message, "name", None):
        out["name"] = message.name
    if isinstance(message, AssistantMessage) and message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    return out


# -- structured output and tools ----------------------------------------------------------------
class JsonSchema(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[Text, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


def _format(value: Any) -> str | None:
    """The response format's union member (tags unlike any field name, as `_role`'s)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind}-format" if isinstance(kind, str) else None


ResponseFormat = Annotated[Union[Annotated[TextFormat, Tag("text-format")],
                                 Annotated[JsonObjectFormat, Tag("json_object-format")],
                                 Annotated[JsonSchemaFormat, Tag("json_schema-format")]],
                           Discriminator(_format, custom_error_type="invalid_format",
                                         custom_error_message="type must be 'text', 'json_object' or 'json_schema'")]


class Function(Strict):
    name: Annotated[Text, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


# -- the generation routes ----------------------------------------------------------------------
def _given_only_with(field: str, other: str):
    """A validator: `field` may be set only where `other` (declared before it) is set and true."""
    def check(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get(other):
            raise PydanticCustomError("unsupported_value", ONLY[field])
        return value
    return field_validator(field)(classmethod(check))


class JobFields(Strict):
    """What makes a request a job of the policy (SPEC §1), and OpenAI's generation fields
    common to both generation routes."""

    model: Text | None = None
    kind: KindName = "chat"
    producer: Annotated[Text, Field(min_length=1)] | None = None
    deadline: Number | None = Field(default=None, description="epoch seconds")
    subject: Text | None = None
    foreground_hint: StrictBool = False
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    service_tier: Literal["auto", "default"] | None = None
    store: _only(False) | None = None

    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveTokens | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    stop: Annotated[Text, Field(min_length=1)] | Annotated[
        list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    n: _only(1) | None = None
    seed: Annotated[StrictInt, Field(ge=0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[Annotated[str, Field(pattern=r"^\d+$")],
                     Annotated[float, Field(strict=True, ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None                 # vLLM's extras
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        return [value] if isinstance(value, str) else value or None

    _options_need_a_stream = _given_only_with("stream_options", "stream")

    def model_id(self) -> str | None:
        """None means the active chat model (SPEC §4: omitted or "default")."""
        return None if self.model in (None, "", "default") else self.model

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def request_fields(self) -> dict:
        """The GenerateRequest fields the body gives, as the client API takes them."""
        fields = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "repetition_penalty",
                                                         "seed", "stop", "presence_penalty", "frequency_penalty")}
        fields["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None
        return {name: value for name, value in fields.items() if value is not None}


class ChatCompletionRequest(JobFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveTokens | None = None
    logprobs: _only(False) | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    modalities: list[Literal["text"]] | None = None
    top_logprobs: Nothing = None
    functions: Nothing = None
    function_call: Nothing = None
    audio: Nothing = None
    prediction: Nothing = None
    reasoning_effort: Nothing = None
    verbosity: Nothing = None
    web_search_options: Nothing = None
    _parallel_calls_need_tools = _given_only_with("parallel_tool_calls", "tools")

    @field_validator("tool_choice")
    @classmethod
    def _forcing_needs_tools(cls, value, info: ValidationInfo):
        if value not in (None, "auto", "none") and not info.data.get("tools"):
            raise PydanticCustomError("unsupported_value", ONLY["tool_choice"])
        return value

    def offers_tools(self) -> bool:
        """Whether the model is shown tools (and its answer read for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        return [as_template_message(m) for m in self.messages]

    def request_fields(self) -> dict:
        fields = super().request_fields()
        if isinstance(self.response_format, JsonObjectFormat):
            fields["json_schema"] = JSON_OBJECT
        elif isinstance(self.response_format, JsonSchemaFormat):
            fields["json_schema"] = self.response_format.json_schema.schema_
        if self.offers_tools():   # "none": the model is not shown the tools
            fields["tools"] = tuple(tool.model_dump(exclude_none=True) for tool in self.tools)
            choice = self.tool_choice
            fields["tool_choice"] = choice.function.name if isinstance(choice, NamedToolChoice) else choice or "auto"
            fields["parallel_tool_calls"] = self.parallel_tool_calls is not False
        return fields


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Cl100kIds = Annotated[list[Annotated[StrictInt, Field(ge=0, le=CL100K_LAST)]], Field(min_length=1)]


class CompletionRequest(JobFields):
    prompt: Union[PromptText, Annotated[list[PromptText], Field(min_length=1, max_length=MAX_INPUTS)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]] = Field(
        description="a text, a list of texts, token ids (the model's own), or a list of token-id lists; "
                    "a list of several gets one choice per prompt")
    echo: _only(False) | None = None
    logprobs: Nothing = None
    best_of: _only(1) | None = None
    suffix: Nothing = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one choice each: a text or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class EmbeddingRequest(Strict):
    input: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)], Cl100kIds,
                 Annotated[list[Cl100kIds], Field(min_length=1, max_length=MAX_INPUTS)]] = Field(
        description="a text, a list of texts, or token ids of OpenAI's cl100k_base (what langchain's "
                    "OpenAIEmbeddings sends): one id list or a list of them")
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Nothing = None
    user: Text | None = None

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class ForegroundRequest(Strict):
    """A subject needs a kind (kind null clears both): the route refuses one without, and the
    schema says so."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "if": {"properties": {"subject": {"type": "string"}}, "required": ["subject"]},
        "then": {"properties": {"kind": {"type": "string"}}, "required": ["kind"]}})
    kind: KindName | None = None
    subject: Text | None = None


def _field_names() -> frozenset[str]:
    """Every field name (and alias) of these bodies: what an error's location may name."""
    names, todo = set(), [Strict]
    while todo:
        model = todo.pop()
        todo.extend(model.__subclasses__())
        for name, info in model.model_fields.items():
            names.update(filter(None, (name, info.alias)))
    return frozenset(names)


FIELD_NAMES = _field_names()
