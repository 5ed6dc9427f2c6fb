"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
status codes of SPEC §4:

    400 invalid_request_error   bad JSON, wrong types, unknown kind, empty messages, a bad
                                field value the client API refuses (code
                                `context_length_exceeded` for a prompt too long)
    401 invalid_api_key         UNIUN_API_KEY is set and the bearer token is missing or wrong
    404 model_not_found         a model id nothing on this machine resolves
    429 queue_full              QueueFull; `Retry-After` says when to try again
    503 scheduler_unavailable   the scheduler is not running, or died and did not come back
    503 model_unavailable       the device cannot run the model (its engine's environment is
                                missing, its weights do not load): the cause and what to do

Anything else is a fault of the server (500 `server_error`), never of the input.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("uniun.http")

#: Seconds a client told 429 should wait before retrying.
RETRY_AFTER_S = 1
#: A request's fields (GenerateRequest's names) as the OpenAI parameters that set them.
PARAMS = {"max_new_tokens": "max_tokens", "json_schema": "response_format"}


class APIError(Exception):
    """An answer other than 200, in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="scheduler_unavailable")


def _cause(error: BaseException) -> BaseException:
    """The error a Ray task raised, unwrapped from its RayTaskError (which subclasses the
    cause's class, so isinstance works on either, but whose text carries a traceback)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _text(error: BaseException) -> str:
    text = str(_cause(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


def from_client(error: BaseException) -> APIError:
    """The answer to an exception of the client API (SPEC §2) or of Ray under it."""
    from ray.exceptions import RayActorError

    from ..models import PromptTooLong, UnknownModel
    from ..models.requests.request import InvalidRequest
    from ..runtime.protocol import JobDropped, ModelUnavailable, Preempted, QueueFull, SchedulerUnavailable

    if isinstance(error, APIError):
        return error
    if isinstance(error, UnknownModel):
        return APIError(404, _text(error), code="model_not_found", param="model")
    if isinstance(error, PromptTooLong):
        return bad_request(_text(error), param="messages", code="context_length_exceeded")
    if isinstance(error, InvalidRequest):
        return bad_request(_text(error), param=PARAMS.get(error.field, error.field))
    if isinstance(error, QueueFull):
        return APIError(429, _text(error), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, SchedulerUnavailable):
        return unavailable(_text(error))
    if isinstance(error, ModelUnavailable):
        return APIError(503, _text(error), type="service_unavailable", code="model_unavailable", param="model")
    if isinstance(error, RayActorError):
        return unavailable(f"an actor of the runtime died under the request ({type(error).__name__}); retry it")
    if isinstance(error, (Preempted, JobDropped)):
        return unavailable(f"the scheduler ended the job before it completed: {_text(error)}; retry it")
    if isinstance(error, (ValueError, TypeError)):
        return bad_request(_text(error))
    log.exception("unexpected error", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}: {_text(error)}", type="server_error",
                    code="internal_error")


def _param(loc: tuple) -> str | None:
    """Pydantic's error location as OpenAI's `param`: ("body", "messages", 0, "user-message",
    "content") -> "messages[0].content". Parts that name no field (a union member's tag,
    "function-after[...]", "list[str]") are left out."""
    from .schemas import FIELD_NAMES

    text = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in FIELD_NAMES:
            text += f".{part}" if text else str(part)
    return text or None


#: Pydantic's type errors, as the JSON type that was expected.
EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
            "int_from_float": "an integer", "bool_type": "a boolean (true or false)", "list_type": "an array",
            "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
            "none_required": "null", "literal_error": None, "union_tag_invalid": None}


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return {int: "an integer", float: "a number", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def validation_error(errors: list[dict], content_type: str) -> APIError:
    """The 400 for a body FastAPI could not validate: the first problem, naming its parameter
    and saying what was expected (OpenAI's codes where OpenAI has one)."""
    from .schemas import ONLY, REFUSED

    first = errors[0] if errors else {"type": "missing", "loc": ("body",)}
    kind, loc = first.get("type"), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}")
    if loc in ((), ("body",)):
        if kind == "missing":
            return bad_request("the request has no body: send a JSON object of the route's fields")
        if "json" not in content_type:
            return bad_request(f"the body must be JSON, sent with `Content-Type: application/json` "
                               f"(got {content_type or 'no Content-Type'})")
        return bad_request(f"the body must be a JSON object of the route's fields, got {_json_type(first.get('input'))}")
    if kind == "extra_forbidden":
        name = ".".join(filter(None, (_param(loc[:-1]), str(loc[-1]))))
        return bad_request(f"unknown parameter {name!r}: not an OpenAI field this route takes, nor one of "
                           f"uniun's (kind, producer, deadline, subject, foreground_hint)", param=name,
                           code="unknown_parameter")
    param = _param(loc)
    field = (param or "").split("[")[0].split(".")[0]
    if param == field and kind == "none_required" and field in REFUSED:
        return bad_request(f"unsupported parameter {field!r}: {REFUSED[field]}", param=param,
                           code="unsupported_parameter")
    if param == field and kind in ("literal_error", "unsupported_value") and field in ONLY:
        return bad_request(f"unsupported value of {field!r}: {ONLY[field]}", param=param, code="unsupported_value")
    return bad_request(*_described(errors))


def _described(errors: list[dict]) -> tuple[str, str | None]:
    """The message and param of the most specific problem: the deepest location (a union's
    member that matched furthest), a broken constraint before a wrong type; when only types
    were wrong, every type that would have done."""
    params = [_param(tuple(e.get("loc", ()))) for e in errors]
    param = max(params, key=lambda p: len(p or ""))
    same = [e for e, p in zip(errors, params) if p == param]
    specific = next((e for e in same if e.get("type") not in EXPECTED or not EXPECTED[e["type"]]), None)
    if specific is None:
        expected = " or ".join(dict.fromkeys(EXPECTED[e["type"]] for e in same if e["type"] != "none_required"))
        return f"{param}: expected {expected or 'null'}, got {_json_type(same[0].get('input'))}", param
    if specific.get("type") == "missing":
        return f"{param} is required", param
    if specific.get("type") == "invalid_role":
        return f"{param}.role: {specific['msg']}", f"{param}.role"
    message = specific.get("msg", "invalid value")
    if specific.get("type") == "value_error":   # pydantic's "Value error, " prefix says nothing
        message = str(specific.get("ctx", {}).get("error", message))
    return f"{param}: {message}", param


def install(app: FastAPI) -> None:
    """Answer every error of the app in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return validation_error(list(error.errors()), request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return APIError(error.status_code, str(error.detail), code=code, headers=dict(error.headers or {})).response()
