"""The client API of SPEC §2: what scripts, producers and the CLI call.

Each call is implemented once, async (`agenerate`, `astream`, `arun`, `aembed`,
`aset_foreground`, `astatus`); the sync names run the same coroutine on a private event
loop thread, so behaviour cannot drift between the two.

A generation is a loop over leases: submit the job, wait for its lease (long-polling, which
proves to the scheduler that we are alive), stream from the ModelActor while a heartbeat
renews the lease, and release it. When the scheduler revokes the lease (a chat arrived),
the stream stops within a token; a background job is re-queued by the policy at its old
place and resumes from the tokens it already produced (R6). A chat job is never revoked by
other work. If the caller is interrupted, the job is cancelled so nothing is leaked.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from .models import DEFAULT_CHAT_MODEL, GenerateRequest
from .policy import Kind
from .runtime.launch import handles
from .runtime.protocol import JobDropped, JobSpec, Lease, LeaseRevoked, Preempted

GRANT_POLL_S = 5.0


def active_chat_model() -> str:
    """`model_id=None` means the active chat model (env UNIUN_CHAT_MODEL, else the default)."""
    return os.environ.get("UNIUN_CHAT_MODEL", DEFAULT_CHAT_MODEL)


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: int
    ttft_s: float | None   # submit to first piece, queueing and swaps included
    total_s: float
    revokes: int
    job_id: str
    model_id: str


def _spec(kind, model_id, producer, deadline, foreground_hint, subject) -> JobSpec:
    return JobSpec.build(kind, model_id or active_chat_model(), producer=producer, deadline=deadline,
                         foreground_hint=foreground_hint, subject=subject)


async def _await_lease(scheduler, job_id: str) -> Lease:
    while True:
        lease = await scheduler.grant.remote(job_id, GRANT_POLL_S)
        if lease is not None:
            return lease


@asynccontextmanager
async def _held(scheduler, lease: Lease):
    """Renew the lease in the background while the block runs."""
    async def beat():
        while True:
            await asyncio.sleep(lease.renew_every_s)
            await scheduler.renew.remote(lease.job_id, lease.epoch)
    task = asyncio.get_running_loop().create_task(beat())
    try:
        yield
    finally:
        task.cancel()


@asynccontextmanager
async def _submitted(scheduler, spec: JobSpec):
    """Submit the job; on any exit but a clean release, withdraw it (nothing leaks)."""
    await scheduler.submit.remote(spec)
    try:
        yield
    except BaseException:
        await asyncio.shield(scheduler.cancel.remote(spec.id))
        raise


class GenerationStream:
    """An async iterator of text pieces; `completion` is set once it is exhausted."""

    def __init__(self, spec: JobSpec, request: GenerateRequest) -> None:
        self.spec, self.request = spec, request
        self.completion: Completion | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        return self._run()

    async def _run(self) -> AsyncIterator[str]:
        h = handles()
        started = time.perf_counter()
        await h.model.check.remote(self.spec.model_id, self.request)  # clear errors, nothing queued
        produced: tuple[int, ...] = ()
        text, ttft, revokes = [], None, 0
        async with _submitted(h.scheduler, self.spec):
            while True:
                lease = await _await_lease(h.scheduler, self.spec.id)
                remaining = self.request.max_new_tokens - len(produced)
                result = None
                async with _held(h.scheduler, lease):
                    request = replace(self.request, resume_tokens=produced, max_new_tokens=remaining)
                    try:
                        stream = h.model.generate.options(num_returns="streaming").remote(lease.epoch, request)
                        async for ref in stream:
                            item = await ref
                            if "piece" in item:
                                text.append(item["piece"])
                                yield item["piece"]
                                if ttft is None:
                                    ttft = time.perf_counter() - started
                                    await h.scheduler.report_first_token.remote(self.spec.id, lease.epoch)
                            else:
                                result = item["result"]
                    except LeaseRevoked:
                        pass  # fenced before it started: same as a revoke at token 0
                if result is not None:
                    produced += tuple(result["token_ids"])
                stopped = result is None or result["finish_reason"] == "cancel"
                if stopped and len(produced) < self.request.max_new_tokens:
                    revokes += 1
                    if await h.scheduler.release.remote(self.spec.id, lease.epoch, "revoked"):
                        continue  # re-queued at its old place: resume from `produced`
                    raise (Preempted if self.spec.kind == Kind.CHAT.value else JobDropped)(
                        f"job {self.spec.id} was revoked and not re-queued")
                await h.scheduler.release.remote(self.spec.id, lease.epoch, "done")
                self.completion = Completion("".join(text), len(produced), ttft,
                                             time.perf_counter() - started, revokes, self.spec.id,
                                             self.spec.model_id)
                return


def astream(kind: Kind | str, prompt: str | None = None, *, messages: list[dict] | None = None,
            model_id: str | None = None, producer: str | None = None, deadline: float | None = None,
            foreground_hint: bool = False, subject: str | None = None, max_new_tokens: int = 128,
            temperature: float = 0.0) -> GenerationStream:
    """Validated here, before anything is queued; runs when iterated."""
    spec = _spec(kind, model_id, producer, deadline, foreground_hint, subject)
    request = GenerateRequest(prompt=prompt, messages=messages, max_new_tokens=max_new_tokens,
                              temperature=temperature)
    return GenerationStream(spec, request)


async def agenerate(kind, prompt=None, **kwargs) -> Completion:
    stream = astream(kind, prompt, **kwargs)
    async for _ in stream:
        pass
    return stream.completion


class LeaseHandle:
    """What `run(work)` gives `work`: the lease, and the model to call with it. A call
    after a revoke raises LeaseRevoked; `run` then re-queues and restarts `work`."""

    def __init__(self, lease: Lease, model) -> None:
        self.lease, self._model = lease, model

    @property
    def model_id(self) -> str:
        return self.lease.model_id

    async def agenerate(self, prompt: str | None = None, *, messages=None, max_new_tokens: int = 128,
                        temperature: float = 0.0) -> str:
        request = GenerateRequest(prompt=prompt, messages=messages, max_new_tokens=max_new_tokens,
                                  temperature=temperature)
        result = None
        async for ref in self._model.generate.options(num_returns="streaming").remote(self.lease.epoch, request):
            result = (await ref).get("result", result)
        if result["finish_reason"] == "cancel":
            raise LeaseRevoked(f"lease {self.lease.epoch} of job {self.lease.job_id} was revoked")
        return result["text"]

    def generate(self, prompt: str | None = None, **kwargs) -> str:
        return _LOOP.run(self.agenerate(prompt, **kwargs))


async def arun(kind, model_id: str | None, work: Callable[[LeaseHandle], Awaitable[Any]], *,
               producer=None, deadline=None, foreground_hint=False, subject=None) -> Any:
    """The notes' run<T>: hold the device for `work(lease)`, which may call the model
    several times. After a revoke, `work` restarts from scratch on the next lease."""
    spec = _spec(kind, model_id, producer, deadline, foreground_hint, subject)
    h = handles()
    async with _submitted(h.scheduler, spec):
        while True:
            lease = await _await_lease(h.scheduler, spec.id)
            async with _held(h.scheduler, lease):
                try:
                    value = await work(LeaseHandle(lease, h.model))
                except LeaseRevoked:
                    if await h.scheduler.release.remote(spec.id, lease.epoch, "revoked"):
                        continue
                    raise
                except Exception:
                    await h.scheduler.release.remote(spec.id, lease.epoch, "failed")
                    raise
            await h.scheduler.release.remote(spec.id, lease.epoch, "done")
            return value


async def aembed(texts: list[str]) -> list[list[float]]:
    return await handles().embedder.embed.remote(texts)


async def aset_foreground(kind: Kind | str | None, subject: str | None = None) -> None:
    if kind is not None:
        kind = Kind.parse(kind).value
    await handles().scheduler.set_foreground.remote(kind, subject)


async def astatus() -> dict:
    return await handles().scheduler.status.remote()


# -- the sync names ----------------------------------------------------------------------
class _LoopThread:
    """One private event loop in a daemon thread, started on first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="uniun-client", daemon=True).start()
            return self._loop

    def run(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self._get())
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. Ctrl-C: the coroutine's cleanup withdraws the job
            raise

    def iterate(self, aiterable) -> Iterator:
        iterator = aiterable.__aiter__()
        try:
            while True:
                try:
                    yield self.run(iterator.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(iterator.aclose())


_LOOP = _LoopThread()


def generate(kind, prompt=None, **kwargs) -> Completion:
    return _LOOP.run(agenerate(kind, prompt, **kwargs))


def stream(kind, prompt=None, **kwargs) -> Iterator[str]:
    return _LOOP.iterate(astream(kind, prompt, **kwargs))


def run(kind, model_id, work: Callable[[LeaseHandle], Any], **fields) -> Any:
    """Sync `work(lease)` runs in a worker thread; it may call `lease.generate(...)`."""
    async def awork(lease):
        return await asyncio.to_thread(work, lease)
    return _LOOP.run(arun(kind, model_id, awork, **fields))


def embed(texts: list[str]) -> list[list[float]]:
    return _LOOP.run(aembed(texts))


def set_foreground(kind, subject: str | None = None) -> None:
    _LOOP.run(aset_foreground(kind, subject))


def status() -> dict:
    return _LOOP.run(astatus())
