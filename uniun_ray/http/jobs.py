"""The one place the HTTP app meets the client API (SPEC §2): it opens a generation as a
job with `uniun_ray.astream`, and gathers the facts an OpenAI answer reports about it.

The client API does not (yet) report everything §4's answer carries, so three facts are
found here, each with the client's own value preferred the day it has one:

* the job id before the first token (a streaming answer's chunks carry it):
  `GenerationStream.job_id`, else its `job.id`;
* `usage.prompt_tokens`: `Completion.prompt_tokens`, else the model's tokenizer here;
* `uniun.tier_at_dispatch`: `Completion.tier_at_dispatch`, else the scheduler's event
  log (its `dispatch` events carry the tier), read where the log is on this node;
* `finish_reason`: `Completion.finish_reason`, else "length" when the job produced all the
  tokens it asked for, "stop" otherwise.

Sampling fields (`temperature`, `top_p`, `stop`, `seed`, and vLLM's `top_k`,
`repetition_penalty`) go to the client through
`sampling_kwargs`, which passes exactly those the client's `astream` accepts and names the
rest in the answer's `uniun.ignored` (never silently).

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
import functools
import inspect
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import uniun_ray

from .schemas import JobFields

#: max_tokens when the request gives none (the client API's default).
DEFAULT_MAX_TOKENS = 128
#: OpenAI's sampling fields, in the order they are passed on.
SAMPLING_FIELDS = ("temperature", "top_p", "stop", "seed", "top_k", "repetition_penalty")
#: How far back in the event log a job's dispatch is looked for.
LOG_SCAN_BYTES = 4 * 1024 * 1024


@functools.lru_cache(maxsize=1)
def _client_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(uniun_ray.astream).parameters)


def sampling_kwargs(body: JobFields) -> tuple[dict, list[str]]:
    """The single place sampling fields cross into the client API: those its `astream`
    accepts are passed on; the rest are returned by name, to be reported as ignored."""
    accepted, ignored = {}, []
    for name in SAMPLING_FIELDS:
        value = getattr(body, name, None)
        if value is None:
            continue
        if name in _client_parameters():
            accepted[name] = value
        else:
            ignored.append(name)
    return accepted, ignored


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
    ignored: list[str]
    prompt: str | None = None
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
    def _record(self):
        """The client's record of the job (`job`; `spec` before issue 12)."""
        return getattr(self.stream, "job", None) or getattr(self.stream, "spec", None)

    @property
    def id(self) -> str:
        job_id = getattr(self.stream, "job_id", None)
        return job_id if job_id is not None else self._record.id

    @property
    def completion(self):
        return self.stream.completion

    @property
    def model(self) -> str:
        done = self.completion
        if done is not None:
            return done.model_id
        return getattr(self._record, "model_id", None) or self.body.model_id() or "default"

    def finish_reason(self) -> str:
        done = self.completion
        reason = getattr(done, "finish_reason", None)
        if reason is not None:
            return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason)
        return "length" if done.tokens >= self.max_tokens else "stop"

    async def usage(self) -> dict:
        done = self.completion
        prompt = getattr(done, "prompt_tokens", None)
        if prompt is None:
            prompt = await count_prompt_tokens(done.model_id, self.prompt, self.messages)
        return {"prompt_tokens": prompt, "completion_tokens": done.tokens,
                "total_tokens": (prompt or 0) + done.tokens}

    async def uniun(self) -> dict:
        done = self.completion
        tier = getattr(done, "tier_at_dispatch", None)
        if tier is None:
            tier = await tier_at_dispatch(self.id)
        facts = {"job_id": self.id, "kind": self.body.kind, "tier_at_dispatch": tier,
                 "ttft_s": done.ttft_s, "revokes": done.revokes}
        if self.ignored:
            facts["ignored"] = list(self.ignored)
        return facts


def open_job(body: JobFields, *, prompt: str | None = None, messages: list[dict] | None = None) -> Job:
    """Validate and open the job (nothing is queued until it is iterated). ValueError and
    the client's other errors propagate to the caller, which maps them to OpenAI errors."""
    sampling, ignored = sampling_kwargs(body)
    max_tokens = body.new_tokens() or DEFAULT_MAX_TOKENS
    stream = uniun_ray.astream(body.kind, prompt, messages=messages, model_id=body.model_id(),
                               producer=producer_of(body), deadline=body.deadline,
                               foreground_hint=body.foreground_hint, subject=body.subject,
                               max_new_tokens=max_tokens, **sampling)
    return Job(body, stream, max_tokens, ignored, prompt=prompt, messages=messages)


# -- facts the client API does not report (yet) ----------------------------------------------
async def count_prompt_tokens(model_id: str, prompt: str | None, messages: list[dict] | None) -> int | None:
    """The prompt's token count as the model sees it (chat template applied), from its
    tokenizer in this process; None if that cannot be done here."""
    def count() -> int:
        from ..models.engine import inspect_request
        from ..models.registry import resolve
        from ..models.request import GenerateRequest

        return inspect_request(resolve(model_id), GenerateRequest(prompt=prompt, messages=messages,
                                                                  max_new_tokens=1))
    try:
        return await asyncio.to_thread(count)
    except Exception:  # e.g. a prompt that fills the whole context: + 1 token is too long
        return None


_LOG_PATH: list[Path] = []


async def _event_log() -> Path | None:
    if not _LOG_PATH:
        try:
            from .app import runtime_call
            _LOG_PATH.append(Path((await runtime_call(uniun_ray.astatus))["event_log"]))
        except Exception:
            return None
    return _LOG_PATH[0]


def _lines_backwards(path: Path, limit: int, chunk: int = 64 * 1024):
    """The complete lines of a file, newest first, reading at most `limit` bytes from its end."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        position = f.seek(0, os.SEEK_END)
        tail = b""
        while position > 0 and limit > 0:
            step = min(chunk, position, limit)
            position -= step
            limit -= step
            f.seek(position)
            lines = (f.read(step) + tail).split(b"\n")
            tail = lines[0]   # may be cut: completed by the next chunk back
            yield from reversed(lines[1:])
        if position == 0:
            yield tail


def _first_dispatch_tier(path: Path, job_id: str) -> int | None:
    """The tier of the job's first dispatch, reading the log (and its newest backup) back
    from the end until the job's submit, at most LOG_SCAN_BYTES; bytes are matched before
    any line is parsed, so a busy log costs little."""
    import json

    needle, tier = f'"job":"{job_id}"'.encode(), None
    for file in (path, path.with_name(path.name + ".1")):
        for line in _lines_backwards(file, LOG_SCAN_BYTES):
            if needle not in line:
                continue
            if b'"ev":"dispatch"' in line:
                try:
                    tier = json.loads(line).get("tier", tier)
                except ValueError:
                    continue
            elif b'"ev":"submit"' in line:
                return tier
    return tier


async def tier_at_dispatch(job_id: str) -> int | None:
    path = await _event_log()
    if path is None:
        return None
    return await asyncio.to_thread(_first_dispatch_tier, path, job_id)
