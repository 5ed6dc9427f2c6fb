"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
status codes of SPEC §4:

    400 invalid_request_error   bad JSON, wrong types, unknown kind, empty messages, a bad
                                field value the client API refuses (code
                                `context_length_exceeded` for a prompt too long)
    401 invalid_api_key         UNIUN_API_KEY is set and the bearer token is missing or wrong
    404 model_not_found         a model id nothing on this machine resolves
    429 queue_full              QueueFull; `Retry-After` says when to try again
    503 scheduler_unavailable   the scheduler is not running, or died and did not come back

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
    from ..runtime.protocol import JobDropped, Preempted, QueueFull, SchedulerUnavailable

    if isinstance(error, APIError):
        return error
    if isinstance(error, UnknownModel):
        return APIError(404, _text(error), code="model_not_found", param="model")
    if isinstance(error, PromptTooLong):
        return bad_request(_text(error), param="messages", code="context_length_exceeded")
    if isinstance(error, QueueFull):
        return APIError(429, _text(error), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, SchedulerUnavailable):
        return unavailable(_text(error))
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
    """Pydantic's error location as OpenAI's `param`: ("body", "messages", 0, "role") ->
    "messages[0].role"."""
    parts = [p for p in loc if p != "body"]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not str(part).startswith(("function-", "list[", "str", "int", "float", "bool", "literal[")):
            text += f".{part}" if text else str(part)
    return text or None


def install(app: FastAPI) -> None:
    """Answer every error of the app in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}").response()
        param = _param(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request")
        if first.get("type") == "missing":
            message = f"a required field is missing: {param}"
        elif param:
            message = f"{param}: {message}"
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return APIError(error.status_code, str(error.detail), code=code, headers=dict(error.headers or {})).response()
