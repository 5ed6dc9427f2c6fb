"""The OpenAPI schema as the server answers: the error statuses it sends (400, never FastAPI's
422; 401, 404, 429, 503) in OpenAI's error shape, and a stream's `text/event-stream`.

Checked against the running server by schemathesis (tests/test_http.py).
"""
from __future__ import annotations

from fastapi import FastAPI

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def _error(description: str, retry_after: bool = False) -> dict:
    answer = {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    if retry_after:
        answer["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                             "schema": {"type": "string"}}}
    return answer


#: One server-sent event of a stream: a chunk object as JSON, an error object, or "[DONE]".
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
#: Every route's errors.
ERRORS = {
    400: _error("invalid_request_error: the body or a parameter is invalid (`param` names it)"),
    401: _error("invalid_api_key: UNIUN_API_KEY is set and the bearer token is missing or wrong"),
    404: _error("model_not_found (or not_found)"),
    503: _error("scheduler_unavailable; model_not_ready while a model's weights are converted; model_unavailable "
                "when the device cannot run it (the message says why)",
                retry_after=True),
}
#: The generation routes: those, a full queue, and a stream's events.
GENERATION = ERRORS | {
    200: {"description": "the answer; with `stream: true`, server-sent events of chunks ending in `data: [DONE]`",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": SSE_EVENT}}},
    429: _error("queue_full: the scheduler's queue for this kind is full", retry_after=True),
}
HEALTH = {
    200: {"description": "the scheduler answers", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}}}},
    503: _error("the scheduler does not answer"),
}


def install(app: FastAPI) -> None:
    """Drop FastAPI's 422 (the server answers 400 in OpenAI's shape: see `errors`)."""
    build = app.openapi

    def schema() -> dict:
        if app.openapi_schema is None:
            document = build()
            for path in document.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                document.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = schema
