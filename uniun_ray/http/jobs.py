"""The one place the HTTP app meets the client API (SPEC §2): it opens a generation as a
job with `uniun_ray.astream`, and gathers the facts an OpenAI answer reports about it.

Every fact an OpenAI answer reports comes from the client's `Completion`: the job id, the
prompt's token count as the model read it, the tier of the job's first dispatch (the policy's
`Dispatch.tier`, carried by the lease), the finish reason. The generation fields (sampling,
penalties, logit bias, structured output, tools) are the client's own: GenerateRequest's.

Cancellation. When an HTTP client goes away, Serve cancels the request's Ray task, and Ray
cancels every Ray call made in that task's context with it (recursive cancellation, ray
#52476): the ModelActor's `generate` would be cancelled under the job instead of being
revoked, and a cancelled actor generator is left suspended, never finishing (the actor then
counts it as generating for ever, and a later model swap waits for it). So a job runs in a
task with a context of its own (`Detached`), the same remedy Serve applies to its own
long-poll; the request's cancellation is forwarded to that task as an asyncio cancellation,
which the client API answers by withdrawing the job: the scheduler revokes the lease and the
device stops at the next token, the ModelActor's generator ending as after any revoke.
"""
from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field

import uniun_ray

from .schemas import JobFields

#: max_tokens when the request gives none (the client API's default).
DEFAULT_MAX_TOKENS = 128


def producer_of(body: JobFields) -> str | None:
    """`producer`, else one flow per OpenAI `user` within the kind (so two users' requests
    of a background kind share the fair pool fairly, R8), else the kind's default."""
    if body.producer:
        return body.producer
    return f"{body.kind}:{body.user}" if body.user else None


class Detached:
    """The job's pieces, produced by a task outside the request's Ray task context (see the
    module's note on cancellation), consumed here. `aclose` (or the consumer's cancellation)
    cancels the producing task and waits until the client API has withdrawn the job."""

    _END = object()

    def __init__(self, stream) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump(stream), context=contextvars.Context())

    async def _pump(self, stream) -> None:
        try:
            async for piece in stream:
                self._queue.put_nowait(piece)
        except Exception as error:  # for the consumer to raise (a cancellation just ends the task)
            self._queue.put_nowait(error)
            return
        self._queue.put_nowait(self._END)

    def __aiter__(self) -> "Detached":
        return self

    async def __anext__(self) -> str:
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        if self._task.done():
            return
        self._task.cancel()
        try:
            await asyncio.shield(self._task)
        except BaseException:  # its own CancelledError, or the error it ended with
            pass


@dataclass
class Job:
    """One request's job: its stream of pieces and, once done, the facts of the answer."""

    body: JobFields
    stream: object                      # the client's GenerationStream
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _pieces: Detached | None = None

    def pieces(self) -> Detached:
        """The job's text pieces; iterating them runs the job (once)."""
        if self._pieces is None:
            self._pieces = Detached(self.stream)
        return self._pieces

    async def run(self) -> None:
        """Run the job to its end (its Completion is then `completion`)."""
        async for _ in self.pieces():
            pass

    @property
    def id(self) -> str:
        return self.stream.job.id

    @property
    def completion(self):
        return self.stream.completion

    @property
    def model(self) -> str:
        done = self.completion
        if done is not None:
            return done.model_id
        return self.stream.job.model_id

    def finish_reason(self) -> str:
        """OpenAI's words: "stop" for the end of the answer or a stop string, "length"."""
        reason = self.completion.finish_reason
        return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason or "stop")

    async def usage(self) -> dict:
        done = self.completion
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.tokens,
                "total_tokens": (done.prompt_tokens or 0) + done.tokens}

    async def uniun(self) -> dict:
        done = self.completion
        return {"job_id": self.id, "kind": self.body.kind, "tier_at_dispatch": done.tier_at_dispatch,
                "ttft_s": done.ttft_s, "revokes": done.revokes}


def open_job(body: JobFields, *, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> Job:
    """Validate and open the job (nothing is queued until it is iterated). ValueError and
    the client's other errors propagate to the caller, which maps them to OpenAI errors."""
    max_tokens = body.new_tokens() or DEFAULT_MAX_TOKENS
    stream = uniun_ray.astream(body.kind, prompt, messages=messages, model_id=body.model_id(),
                               producer=producer_of(body), deadline=body.deadline,
                               foreground_hint=body.foreground_hint, subject=body.subject,
                               max_new_tokens=max_tokens, **body.request_fields())
    return Job(body, stream, max_tokens, prompt=prompt, messages=messages)
