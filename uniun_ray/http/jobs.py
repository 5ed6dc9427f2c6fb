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
    """The pieces of one or more jobs' streams, produced by tasks outside the request's Ray
    task context (see the module's note on cancellation), consumed here as (index, piece), and
    (index, None) when that stream has ended. `aclose` (or the consumer's cancellation)
    cancels the producing tasks and waits until the client API has withdrawn the jobs."""

    def __init__(self, streams: list) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(index, stream), context=contextvars.Context())
                       for index, stream in enumerate(streams)]

    async def _pump(self, index: int, stream) -> None:
        try:
            async for piece in stream:
                self._queue.put_nowait((index, piece))
        except Exception as error:  # for the consumer to raise (a cancellation just ends the task)
            self._queue.put_nowait((index, error))
            return
        self._queue.put_nowait((index, None))

    def __aiter__(self) -> "Detached":
        return self

    async def __anext__(self) -> tuple[int, str | None]:
        if not self._open:
            raise StopAsyncIteration
        try:
            index, item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            raise item
        self._open -= item is None
        return index, item

    async def aclose(self) -> None:
        running = [task for task in self._tasks if not task.done()]
        for task in running:
            task.cancel()
        if running:  # each task's own CancelledError, or the error it ended with
            await asyncio.shield(asyncio.gather(*running, return_exceptions=True))


def pieces(jobs: list["Job"]) -> Detached:
    """The jobs' pieces as they come; iterating them runs the jobs."""
    return Detached([job.stream for job in jobs])


async def run_all(jobs: list["Job"]) -> None:
    """Run the jobs to their ends (each one's Completion is then its `completion`); the first
    error withdraws the others."""
    running = pieces(jobs)
    try:
        async for _ in running:
            pass
    finally:
        await running.aclose()


@dataclass
class Job:
    """One request's job: its stream of pieces and, once done, the facts of the answer."""

    body: JobFields
    stream: object                      # the client's GenerationStream
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    created: int = field(default_factory=lambda: int(time.time()))

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
                "total_tokens": (done.prompt_tokens or 0) + done.tokens,
                "cached_tokens": done.prefills[0]["cached_tokens"] if done.prefills else 0}

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
