"""The OpenAI-compatible API of SPEC §4 as a FastAPI app: one more client of the scheduler.

Every generation request becomes one job through the client API (`uniun_ray.astream`),
so the policy schedules it like a script's; embeddings go straight to the EmbeddingActor.
`create_app` builds the app; `uniun_ray.http.deployment` runs it on Ray Serve.

A client that goes away costs nothing: Serve cancels the request's task when its HTTP
client disconnects, and the cancellation reaches the client API's generation, which
withdraws the job from the scheduler (queued: dropped; running: revoked, so the device
stops at the next token). A streaming answer also closes its generation when the response
ends for any reason.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import json
import secrets
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event

import uniun_ray

from . import errors
from .errors import APIError, bad_request, from_client, unauthorized, unavailable
from .jobs import Job, open_job
from .schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ForegroundRequest

#: The embedding model's id, as /v1/models and /v1/embeddings name it.
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
OWNER = "uniun-ray"


# -- auth ---------------------------------------------------------------------------------
def bearer_auth(api_key: str | None):
    """A dependency that checks `Authorization: Bearer <api_key>` (constant-time); a no-op
    when no key is set (the server is then bound to 127.0.0.1 by default)."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("missing bearer token: send `Authorization: Bearer $UNIUN_API_KEY`")
        if not secrets.compare_digest(token.strip().encode(), expected):
            raise unauthorized("incorrect API key (the server's UNIUN_API_KEY)")
    return check


# -- the runtime's presence -------------------------------------------------------------------
def _require(name: str, what: str) -> None:
    """503 unless the named actor exists. The client API would create a missing runtime
    on first use; an HTTP server must not start one behind its operator's back."""
    import ray

    from ..runtime.protocol import NAMESPACE

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise unavailable(f"the {what} is not running: start the runtime with `uniun-ray up` "
                          f"(or uniun_ray.start()), then retry") from None


def require_scheduler() -> None:
    from ..runtime.protocol import SCHEDULER_NAME
    _require(SCHEDULER_NAME, "scheduler")


def require_embedder() -> None:
    from ..runtime.protocol import EMBEDDER_NAME
    _require(EMBEDDER_NAME, "embedder")


# -- generation -----------------------------------------------------------------------------
def _open(body, **prompt) -> Job:
    require_scheduler()
    try:
        return open_job(body, **prompt)
    except Exception as error:
        raise from_client(error) from error


async def _run_to_end(job: Job) -> None:
    try:
        await job.run()
    except Exception as error:
        raise from_client(error) from error


async def _first_piece(pieces: AsyncIterator[str]) -> str | None:
    """Wait for the first piece, so that an error found before the job ran (full queue,
    unknown model, prompt too long, no scheduler) is answered with its status code rather
    than inside a 200 stream."""
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None
    except Exception as error:
        raise from_client(error) from error


def _sse(data: dict | str) -> bytes:
    return format_sse_event(data_str=data if isinstance(data, str) else json.dumps(data, separators=(",", ":")))


class JobEventStream(EventSourceResponse):
    """Server-sent events of one job; whatever ends the response (the last event, an error,
    a client that went away) closes the events, and with them the job's generation."""

    def __init__(self, events, **kwargs) -> None:
        super().__init__(events, **kwargs)
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def _stream(job: Job, first: str | None, pieces: AsyncIterator[str], chunk, include_usage: bool) -> JobEventStream:
    """The SSE answer: `chunk(text=..., role=..., finish_reason=...)` builds each event's
    object; the last ones carry the finish reason and uniun's facts (and usage when asked),
    then `[DONE]`."""
    async def events():
        try:
            yield _sse(chunk(role="assistant", text=""))
            if first is not None:
                yield _sse(chunk(text=first))
            async for piece in pieces:
                yield _sse(chunk(text=piece))
            final = chunk(finish_reason=job.finish_reason())
            final["uniun"] = await job.uniun()
            yield _sse(final)
            if include_usage:
                yield _sse({**chunk(), "choices": [], "usage": await job.usage()})
        except Exception as error:  # the status line is gone: report it in the stream, as OpenAI does
            yield _sse(from_client(error).body())
        finally:
            await pieces.aclose()
        yield _sse("[DONE]")
    return JobEventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chat_chunk(job: Job):
    def chunk(text: str | None = None, role: str | None = None, finish_reason: str | None = None) -> dict:
        delta = {}
        if role is not None:
            delta["role"] = role
        if text is not None:
            delta["content"] = text
        return {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    return chunk


def _text_chunk(job: Job):
    def chunk(text: str | None = None, role: str | None = None, finish_reason: str | None = None) -> dict:
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}
    return chunk


# -- the app --------------------------------------------------------------------------------
def create_app(api_key: str | None = None) -> FastAPI:
    """The FastAPI app of SPEC §4. `api_key`: require `Authorization: Bearer <api_key>` on
    every route (then the interactive docs are off too)."""
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="uniun-ray", summary="OpenAI-compatible endpoint of the uniun-ray scheduler",
                  dependencies=[Depends(bearer_auth(api_key))], **docs)
    errors.install(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        job = _open(body, messages=[m.as_dict() for m in body.messages])
        if body.stream:
            pieces = job.pieces()
            first = await _first_piece(pieces)
            return _stream(job, first, pieces, _chat_chunk(job), body.include_usage())
        await _run_to_end(job)
        done = job.completion
        return {"id": job.id, "object": "chat.completion", "created": job.created, "model": done.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                             "logprobs": None, "finish_reason": job.finish_reason()}],
                "usage": await job.usage(), "uniun": await job.uniun()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        job = _open(body, prompt=body.prompt)
        if body.stream:
            pieces = job.pieces()
            first = await _first_piece(pieces)
            return _stream(job, first, pieces, _text_chunk(job), body.include_usage())
        await _run_to_end(job)
        done = job.completion
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": done.model_id,
                "choices": [{"index": 0, "text": done.text, "logprobs": None, "finish_reason": job.finish_reason()}],
                "usage": await job.usage(), "uniun": await job.uniun()}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        if body.model not in (None, "", "default") and _embedding_id(body.model) != EMBEDDING_MODEL.lower():
            raise APIError(404, f"unknown embedding model {body.model!r}: this server embeds with "
                                f"{EMBEDDING_MODEL!r}", code="model_not_found", param="model")
        require_embedder()
        texts = body.texts()
        try:
            vectors = await uniun_ray.aembed(texts)
        except Exception as error:
            raise from_client(error) from error
        tokens = await _count_embedding_tokens(texts)
        return {"object": "list", "model": EMBEDDING_MODEL,
                "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.get("/v1/models")
    async def models():
        from ..models.registry import known_ids

        ids = list(known_ids())
        active = _active_chat_model()
        if active and active not in ids:
            ids.insert(0, active)
        data = [{"id": i, "object": "model", "created": 0, "owned_by": OWNER} for i in ids]
        data.append({"id": EMBEDDING_MODEL, "object": "model", "created": 0, "owned_by": OWNER})
        return {"object": "list", "data": data}

    @app.post("/v1/foreground")
    async def foreground(body: ForegroundRequest):
        if body.kind is None and body.subject is not None:
            raise bad_request("a subject needs a kind (kind null clears both)", param="subject")
        require_scheduler()
        try:
            await uniun_ray.aset_foreground(body.kind, body.subject)
        except Exception as error:
            raise from_client(error) from error
        return {"kind": body.kind, "subject": body.subject}

    @app.get("/v1/status")
    async def status():
        require_scheduler()
        try:
            snapshot = await uniun_ray.astatus()
        except Exception as error:
            raise from_client(error) from error
        return JSONResponse(jsonable_encoder(snapshot, custom_encoder={float: _finite}))

    from . import page
    page.install(app, require_scheduler)
    return app


# -- helpers ---------------------------------------------------------------------------------
def _finite(value: float):
    """JSON has no inf/nan; the snapshot may hold them (e.g. an unset deadline's wait)."""
    return value if value == value and abs(value) != float("inf") else None


def _embedding_id(model: str) -> str:
    return model.rsplit("/", 1)[-1].lower()


def _encode(vector: list[float], encoding_format: str):
    if encoding_format == "base64":
        import numpy as np
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def _active_chat_model() -> str | None:
    """The scheduler's active chat model; None when no scheduler runs (asking the client
    then would start a runtime from inside the HTTP server)."""
    from .. import client
    active = getattr(client, "active_chat_model", None)
    try:
        require_scheduler()
        return active() if callable(active) else None
    except Exception:
        return None


@functools.lru_cache(maxsize=1)
def _embedding_tokenizer():
    from transformers import AutoTokenizer

    from ..runtime.embedding_actor import default_model_path
    return AutoTokenizer.from_pretrained(default_model_path())


async def _count_embedding_tokens(texts: list[str]) -> int:
    def count() -> int:
        tokenizer = _embedding_tokenizer()
        return sum(len(ids) for ids in tokenizer(texts)["input_ids"])
    try:
        return await asyncio.to_thread(count)
    except Exception:
        return sum(len(t.split()) for t in texts)
