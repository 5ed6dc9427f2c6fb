"""The client API of SPEC §2: what scripts, producers, the CLI and (next) HTTP call.

Each call is implemented once, async (`agenerate`, `astream`, `arun`, `aembed`,
`aset_foreground`, `astatus`); the sync names run the same coroutine on a private event
loop thread, so behaviour cannot drift between the two.

One lease loop (`LeaseLoop`) speaks the lease protocol for every kind of work: submit the
job, wait for its lease (long-polling, which proves to the scheduler that we are alive),
run one *turn* of the work while a heartbeat renews the lease, and settle the turn: release
it, resume after a revoke (a background job is re-queued by the policy at its old place,
R6), recover after a scheduler restart, report a lost device. `generate`, `stream` and
`run` are only work handed to it: a generation resumes from the tokens it produced, a
`run(work)` restarts its work. If the caller is interrupted, the job is cancelled so
nothing is leaked.

Faults. The scheduler keeps its queue in memory; when it restarts (a detached actor with
max_restarts=-1) a client's next call dies with it or finds its job unknown, and the loop
submits the job again under the same id (a generation keeps the tokens it produced). If the
scheduler does not come back within RECONNECT_S, the call fails with SchedulerUnavailable,
which says to retry: never a silent loss. When the ModelActor dies under a turn, the loop
reports it (`device_lost`): the scheduler re-queues the job and reloads the model.

Validation. A request is checked before anything is queued: the job by the policy's own
`Job`, here; the prompt against the model's tokenizer and context window by the ModelActor
(`check`, one round trip: see `_check` for why not here).
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from .models.registry import DEFAULT_CHAT_MODEL
from .models.requests.request import GenerateRequest
from .policy import Job, Kind, Tier
from .runtime.launch import forget_handles, handles
from .runtime.protocol import (DeviceLost, JobDropped, Lease, LeaseRevoked, Preempted, SchedulerUnavailable,
                               UnknownJob, new_job)
from .runtime.releases import RELEASES

GRANT_POLL_S = 60.0     # a grant long-poll's wait; the scheduler caps it (SESSION_POLL_S)
RECONNECT_S = 30.0      # how long a job waits for a restarted scheduler before SchedulerUnavailable
MAX_RESUBMITS = 5       # scheduler restarts one job survives
FIRST_HEARTBEAT_S = 0.5  # a session's first heartbeat, after its first grant poll (well inside waiter_timeout_s / 3)
#: The longest prompt (or messages' total content) accepted, in characters: far beyond any
#: context window here (128k tokens ~ 512k characters), so only a mistake is refused.
MAX_PROMPT_CHARS = 1_000_000


def active_chat_model() -> str:
    """What `model_id=None` means: the scheduler's setting (`uniun-ray up --chat-model`, or
    UNIUN_CHAT_MODEL where the scheduler was created), so every process agrees."""
    return handles().chat_model


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: int
    ttft_s: float | None   # submit to first piece, queueing and swaps included
    total_s: float
    revokes: int
    job_id: str
    model_id: str
    prompt_tokens: int | None = None      # the prompt (templated), as the model read it
    tier_at_dispatch: int | None = None   # the tier of the job's first dispatch (the policy's)
    finish_reason: str | None = None      # the last run's: "eos", "length", "stop", or "cancel"
    #: per run (one more per resume after a revoke): {"prompt_tokens", "cached_tokens" (of those,
    #: taken from the prefix cache), "prefill_s" (reading the rest; None: revoked before the end),
    #: "mean_batch" (the jobs its decode steps ran together, on average: 1.0 alone, SPEC §6)}
    prefills: tuple[dict, ...] = ()


def _job(kind, model_id, producer, deadline, foreground_hint, subject) -> Job:
    """The job, validated now, before anything is queued and without a cluster. `model_id=None`
    is validated as the default model and becomes the active chat model when the job starts
    (`_bound`), when this process is connected."""
    return new_job(kind, DEFAULT_CHAT_MODEL if model_id is None else model_id, producer=producer,
                   deadline=deadline, foreground_hint=foreground_hint, subject=subject)


def _bound(job: Job, model_id: str | None) -> Job:
    return job if model_id is not None else replace(job, model_id=active_chat_model())


def _check_prompt(prompt, messages) -> None:
    """What GenerateRequest leaves open: an empty prompt (the model would babble from
    nothing) and one too large for any model (refused before it crosses the cluster)."""
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("prompt is empty: give the text the model should answer or continue")
    size = len(prompt) if isinstance(prompt, str) else sum(
        len(m.get("content", "")) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
    ) if isinstance(messages, list) else 0
    if size > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt is {size:,} characters; the limit is {MAX_PROMPT_CHARS:,} "
                         f"(no model here reads that much)")


async def _check(model_id: str, request: GenerateRequest) -> int:
    """The ModelActor's request check (tokenizer and config only, cached there per model):
    a prompt too long, messages to a model without a chat template... Returns the prompt's
    token count. It waits out a restart of the actor (its calls fail with
    ActorUnavailableError meanwhile), and looks the actor up again when it died for good
    (the scheduler makes a new one under its name while its seat is declared).

    Why a round trip and not the tokenizer here: a local check imports torch and
    transformers into every client process (seconds for a one-shot `uniun-ray chat`,
    hundreds of MB per producer actor) and, for an embedded GGUF model, converts it on the
    client's node; the round trip costs about a bare actor call (BENCHMARKS.md, "Runtime"), also while the actor generates, since the check runs beside the decode thread."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    deadline = time.monotonic() + RECONNECT_S
    while True:
        try:
            return await handles().model.check.remote(model_id, request)
        except RayActorError as error:
            if time.monotonic() > deadline:
                raise
            if not isinstance(error, ActorUnavailableError):
                forget_handles()
            await asyncio.sleep(0.2)


def _scheduler_lost(error: BaseException) -> bool:
    """The scheduler died under the call, or restarted and no longer knows the job."""
    from ray.exceptions import RayActorError
    return isinstance(error, (RayActorError, UnknownJob))


def error_cause(error: BaseException) -> BaseException:
    """The error a Ray task raised, unwrapped from its RayTaskError (which subclasses the
    cause's class, so isinstance works on either, but whose text carries a traceback)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def error_text(error: BaseException) -> str:
    """One line for an error (a job's failure in a producer's state, a CLI message): its class
    and the first line of its text, without the remote traceback a RayTaskError carries."""
    error = error_cause(error)
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


class _Session:
    """An event loop's session with the scheduler: one heartbeat proves every job this loop
    waits for alive, so their grant polls can be long (60 s) instead of each job polling
    every few seconds: 10,000 waiting jobs would otherwise flood the scheduler with calls."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.users = 0
        self._task: asyncio.Task | None = None

    @asynccontextmanager
    async def using(self, scheduler):
        self.users += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._beat(scheduler))
        try:
            yield self.id
        finally:
            self.users -= 1
            if self.users == 0 and self._task is not None:
                self._task.cancel()
                self._task = None

    async def _beat(self, scheduler) -> None:
        # a grant poll proves the session alive too: the first heartbeat can wait a little,
        # and a job that is served at once costs none
        await asyncio.sleep(FIRST_HEARTBEAT_S)
        while True:
            try:
                interval = await scheduler.heartbeat.remote(self.id)
            except Exception:  # restarting, or gone: the jobs find out through their own calls
                interval = 1.0
                scheduler = _lookup_scheduler() or scheduler
            await asyncio.sleep(interval)


_SESSIONS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Session]" = weakref.WeakKeyDictionary()


def _session() -> _Session:
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None:
        session = _SESSIONS[loop] = _Session()
    return session


def _lookup_scheduler():
    """The scheduler by name, again (killed for good and created anew: a new actor), or None
    while there is none; the cached handles are looked up afresh at the next call."""
    import ray

    from .runtime.protocol import NAMESPACE, SCHEDULER_NAME
    try:
        scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
    forget_handles()
    return scheduler


async def _generation(model, lease: Lease, request: GenerateRequest) -> AsyncIterator[dict]:
    """The ModelActor's stream for one lease: {"piece": text, "tokens": n} items, then
    {"result": ...}. A lease dispatched at the chat tier is revoked by nothing but its own
    cancel (R4), so its prompt is read without revoke-sized chunks."""
    revocable = lease.tier != Tier.CHAT
    async for ref in model.generate.options(num_returns="streaming").remote(lease.epoch, request, revocable):
        yield await ref


class Turn:
    """One lease's worth of work, inside `async with turn:`. The work says how it ended —
    `done(value)`, or `stopped()` when it stopped early at a revoke — or raises; the turn
    files what it raised: LeaseRevoked (the device refused the lease) is a revoke unless the
    scheduler still holds it for us (then the device restarted), a RayActorError (or DeviceLost: its engine lost the model) is a lost
    device, anything else fails the job. The loop then settles the turn."""

    def __init__(self, loop: "LeaseLoop", lease: Lease, model) -> None:
        self.loop, self.lease, self.model = loop, lease, model   # the ModelActor of the lease's device
        self.outcome: str | None = None     # done | revoked | lost
        self.value: Any = None
        self.lost_reason: str | None = None

    def done(self, value: Any = None) -> None:
        self.outcome, self.value = "done", value

    def stopped(self) -> None:
        self.outcome = "revoked"

    def lost(self, reason: str) -> None:
        self.outcome, self.lost_reason = "lost", reason

    async def __aenter__(self) -> "Turn":
        return self

    async def __aexit__(self, kind, error, tb) -> bool:
        from ray.exceptions import RayActorError

        if error is None:
            if self.outcome is None:
                self.done()
            return False
        if isinstance(error, LeaseRevoked):  # fenced: a revoke (at token 0, or one we missed) ...
            if await self.loop.still_held(self.lease):  # ... unless the device forgot the epoch
                self.lost("the model actor restarted (it no longer knows the lease)")
            else:
                self.stopped()
            return True
        if isinstance(error, (RayActorError, DeviceLost)):  # the model actor (or its engine) died under the work
            self.lost(error_text(error))
            return True
        if isinstance(error, Exception):
            self.loop.release(self.lease, "failed")
        return False


class LeaseLoop:
    """One job's whole conversation with the scheduler: submit, grant, renew, release,
    re-queue, recovery after a scheduler restart, device loss. Iterate `turns()`; each turn
    holds a lease (renewed in the background) for `async with turn:`; the loop settles it
    and either ends (done) or waits for the next lease.

        loop = LeaseLoop(job)
        async for turn in loop.turns():
            async with turn:
                ...  # call turn.model (the lease's device) with turn.lease.epoch; turn.done(value) / turn.stopped()
        loop.value, loop.revokes

    A turn that was revoked resumes (the job was re-queued) or, when the policy did not
    re-queue it (a chat revoked by its own cancel, a reclaimed lease), raises `dropped`
    (default: Preempted for a chat, JobDropped otherwise).
    """

    def __init__(self, job: Job, dropped: Callable[[str], BaseException] | None = None) -> None:
        self.job, self.scheduler = job, handles().scheduler
        self.dropped = dropped or (Preempted if job.kind is Kind.CHAT else JobDropped)
        self.session = _session()
        self.resubmits = 0
        self.revokes = 0      # turns that ended before the work did: revoked, or the device lost
        self.value: Any = None

    async def turns(self) -> AsyncIterator[Turn]:
        async with self.session.using(self.scheduler):
            lease = None
            try:
                try:  # one round trip submits and waits for the first lease, after our releases
                    released, after = RELEASES.take()
                    lease = await self.scheduler.acquire.remote(self.job, GRANT_POLL_S, self.session.id,
                                                                after, released)
                except Exception as error:
                    await self.recover(error)
                while True:
                    lease = lease or await self._grant()
                    turn = Turn(self, lease, handles().model_of(lease.device))
                    async with self._renewing(lease):
                        yield turn
                    if turn.outcome is None:
                        raise RuntimeError("a turn ended without an outcome: use `async with turn:`")
                    lease = None
                    if await self._settle(turn):
                        return
            except BaseException:  # interrupted, or failed: withdraw the job (idempotent)
                try:
                    await asyncio.shield(self.scheduler.cancel.remote(self.job.id))
                except Exception:  # the scheduler is gone: nothing of the job is left there either
                    pass
                raise

    async def _settle(self, turn: Turn) -> bool:
        """True when the job is over (its value in `self.value`); False: take the next turn."""
        if turn.outcome == "done":
            self.release(turn.lease, "done")
            self.value = turn.value
            return True
        self.revokes += 1
        if turn.outcome == "lost":
            await self.device_lost(turn.lease, turn.lost_reason)
            forget_handles()  # a model actor may be a new one under its name by the next grant
            return False
        try:
            requeued = await self.scheduler.release.remote(self.job.id, turn.lease.epoch, "revoked")
        except Exception as error:
            await self.recover(error)  # the scheduler restarted: submitted again
            return False
        if not requeued:
            raise self.dropped(f"job {self.job.id} was revoked and not re-queued")
        return False  # re-queued at its old place (R6)

    async def _grant(self) -> Lease:
        while True:
            try:
                lease = await self.scheduler.grant.remote(self.job.id, GRANT_POLL_S, self.session.id)
            except Exception as error:
                await self.recover(error)
                continue
            if lease is not None:
                return lease

    @asynccontextmanager
    async def _renewing(self, lease: Lease):
        """Renew the lease in the background while the turn runs. A renewal that fails (the
        scheduler restarted) ends the heartbeat; the loop finds out at its next call."""
        async def beat():
            while True:
                await asyncio.sleep(lease.renew_every_s)
                try:
                    await self.scheduler.renew.remote(lease.job_id, lease.epoch)
                except Exception:
                    return
        task = asyncio.get_running_loop().create_task(beat())
        try:
            yield
        finally:
            task.cancel()

    def release(self, lease: Lease, outcome: str) -> None:
        """End the lease ("done" or "failed"), one-way: the work is over whatever the
        scheduler answers (`runtime.releases` keeps the order, flushes at exit and logs a
        refusal)."""
        RELEASES.send(self.scheduler, self.job.id, lease.epoch, outcome)

    async def recover(self, error: BaseException) -> None:
        """Re-raise `error` unless the scheduler was lost; else wait for it (restarted, or
        re-created under its name) and submit the job again. SchedulerUnavailable when it
        does not come back within RECONNECT_S."""
        if not _scheduler_lost(error):
            raise error
        from ray.exceptions import RayActorError

        self.resubmits += 1
        what = f"{self.job.kind.value} job {self.job.id}"
        if self.resubmits > MAX_RESUBMITS:
            raise SchedulerUnavailable(f"{what} was lost by the scheduler {self.resubmits - 1} times "
                                       f"(restarts); it is not queued: retry it") from error
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                await asyncio.wait_for(self.scheduler.submit.remote(self.job), max(0.1, deadline - time.monotonic()))
                return
            except ValueError as refused:  # a RayTaskError of the scheduler's ValueError
                if "duplicate job id" in str(refused):
                    return  # it never lost the job after all (a transient error)
                raise
            except (RayActorError, asyncio.TimeoutError) as lost:
                last = lost
            if time.monotonic() >= deadline:
                raise SchedulerUnavailable(
                    f"the scheduler did not come back within {RECONNECT_S:.0f} s ({type(last).__name__}); "
                    f"{what} was not completed and is not queued: retry it once the runtime is up "
                    f"(`uniun-ray up`, or uniun_ray.start())") from error
            await asyncio.sleep(0.2)
            # killed for good and created again: a new actor under the same name
            self.scheduler = _lookup_scheduler() or self.scheduler

    async def still_held(self, lease: Lease) -> bool:
        """The ModelActor refused our epoch: True when the scheduler never revoked it, so the
        device must have restarted (it forgot the epoch)."""
        try:
            return await self.scheduler.renew.remote(lease.job_id, lease.epoch)
        except Exception:
            return False  # revoked, reclaimed, or the scheduler restarted: not a device fault

    async def device_lost(self, lease: Lease, reason: str) -> None:
        """Report that the device died under the lease; the job is re-queued (or recovered,
        if the scheduler went too). DeviceLost when it failed too often."""
        try:
            requeued = await self.scheduler.device_lost.remote(lease.job_id, lease.epoch, reason)
        except Exception as error:
            await self.recover(error)
            return
        if not requeued:
            raise DeviceLost(f"job {lease.job_id}: the model actor died under it too many times ({reason})")


class GenerationStream:
    """An async iterator of text pieces; `completion` is set once it is exhausted. Work for
    the lease loop: each turn generates from prompt + what earlier turns produced (R6)."""

    def __init__(self, job: Job, request: GenerateRequest, follows_chat_model: bool = False) -> None:
        self.job, self.request = job, request
        self.completion: Completion | None = None
        self._follows_chat_model = follows_chat_model

    def __aiter__(self) -> AsyncIterator[str]:
        return self._run()

    async def _run(self) -> AsyncIterator[str]:
        started = time.perf_counter()
        self.job = _bound(self.job, None if self._follows_chat_model else self.job.model_id)
        await _check(self.job.model_id, self.request)  # clear errors, nothing queued
        limit = self.request.max_new_tokens
        produced: tuple[int, ...] = ()   # token ids of the finished runs: an exact resume (R6)
        lossy = False                    # a run died with the device: resume from the text instead
        count = 0                        # tokens produced (streamed, for a run the device lost)
        text, ttft = [], None
        prompt_tokens = tier = finish_reason = None
        prefills: list[dict] = []
        loop = LeaseLoop(self.job)
        turns = loop.turns()
        try:
            async for turn in turns:
                resume = {"resume_text": "".join(text)} if lossy else {"resume_tokens": produced}
                request = replace(self.request, max_new_tokens=limit - count, **resume)
                result, streamed = None, 0
                async with turn:
                    tier = turn.lease.tier if tier is None else tier
                    async for item in _generation(turn.model, turn.lease, request):
                        if "piece" in item:
                            text.append(item["piece"])
                            streamed = item["tokens"]
                            yield item["piece"]
                            if ttft is None:
                                ttft = time.perf_counter() - started
                                await self._first_token(loop, turn.lease)
                        else:
                            result = item["result"]
                if result is not None:
                    produced += tuple(result["token_ids"])
                    count += len(result["token_ids"])
                    finish_reason = result["finish_reason"]
                    prefills.append({key: result[key] for key in ("prompt_tokens", "cached_tokens", "prefill_s", "mean_batch")})
                    if prompt_tokens is None:
                        prompt_tokens = result["prompt_tokens"]
                elif streamed:
                    lossy, count = True, count + streamed
                if count >= limit:
                    turn.done()          # whatever stopped the run, nothing is left to produce
                elif turn.outcome == "done" and (result is None or result["finish_reason"] == "cancel"):
                    turn.stopped()       # stopped at a revoke before its end
                elif turn.outcome == "lost" and result is not None:
                    turn.done() if result["finish_reason"] != "cancel" else turn.stopped()
        finally:
            await turns.aclose()
        self.completion = Completion("".join(text), count, ttft, time.perf_counter() - started,
                                     loop.revokes, self.job.id, self.job.model_id, prompt_tokens, tier,
                                     finish_reason, tuple(prefills))

    @staticmethod
    async def _first_token(loop: LeaseLoop, lease: Lease) -> None:
        try:
            await loop.scheduler.report_first_token.remote(lease.job_id, lease.epoch)
        except Exception:
            pass  # for the log only; a lost scheduler shows at release


def astream(kind: Kind | str, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
            model_id: str | None = None, producer: str | None = None, deadline: float | None = None,
            foreground_hint: bool = False, subject: str | None = None, max_new_tokens: int = 128,
            **generation) -> GenerationStream:
    """Validated here, before anything is queued; runs when iterated. ``generation``: the other
    fields of GenerateRequest (temperature, top_p, top_k, repetition_penalty, stop, seed,
    presence_penalty, frequency_penalty, logit_bias, json_schema, tools). Sampling fields left
    None take the model's generation_config (greedy for the embedded models)."""
    job = _job(kind, model_id, producer, deadline, foreground_hint, subject)
    request = GenerateRequest(prompt=prompt, messages=messages, max_new_tokens=max_new_tokens, **generation)
    _check_prompt(prompt, messages)
    return GenerationStream(job, request, follows_chat_model=model_id is None)


async def aprepare(model_id: str | None = None) -> bool:
    """Whether the model's weights are ready on the device; if not, their one-time conversion
    (an embedded GGUF: up to a minute) starts there in the background, and a server can tell its
    client to come back rather than hold the request. UnknownModel for an id nothing resolves."""
    return await handles().model.prepare.remote(model_id or active_chat_model())


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
                        **sampling) -> str:
        """``sampling``: temperature, top_p, top_k, repetition_penalty, stop, seed (GenerateRequest)."""
        request = GenerateRequest(prompt=prompt, messages=messages, max_new_tokens=max_new_tokens, **sampling)
        result = None
        async for item in _generation(self._model, self.lease, request):
            result = item.get("result", result)
        if result["finish_reason"] == "cancel":
            raise LeaseRevoked(f"lease {self.lease.epoch} of job {self.lease.job_id} was revoked")
        return result["text"]

    def generate(self, prompt: str | None = None, **kwargs) -> str:
        return _LOOP.run(self.agenerate(prompt, **kwargs))


async def arun(kind, model_id: str | None, work: Callable[[LeaseHandle], Awaitable[Any]], *,
               producer=None, deadline=None, foreground_hint=False, subject=None) -> Any:
    """The notes' run<T>: hold the device for `work(lease)`, which may call the model
    several times. After a revoke, a lost device or a scheduler restart, `work` restarts
    from scratch on the next lease."""
    job = _bound(_job(kind, model_id, producer, deadline, foreground_hint, subject), model_id)
    loop = LeaseLoop(job, dropped=LeaseRevoked)
    turns = loop.turns()
    try:
        async for turn in turns:
            async with turn:
                turn.done(await work(LeaseHandle(turn.lease, turn.model)))
    finally:
        await turns.aclose()
    return loop.value


async def _on_actors(call: Callable[[Any], Awaitable[Any]]) -> Any:
    """`call(handles())`, once more after looking the actors up again when the one it reached
    is gone: a scheduler or embedder killed and created again under its name leaves this
    process's cached handle pointing at the dead one (the lease loop re-resolves by itself)."""
    from ray.exceptions import RayActorError

    try:
        return await call(handles())
    except RayActorError:
        forget_handles()
        return await call(handles())


async def aembed(texts: list[str]) -> list[list[float]]:
    return await _on_actors(lambda h: h.embedder.embed.remote(texts))


async def aset_foreground(kind: Kind | str | None, subject: str | None = None) -> None:
    if kind is not None:
        kind = Kind.parse(kind).value
    await _on_actors(lambda h: h.scheduler.set_foreground.remote(kind, subject))


async def astatus() -> dict:
    """The scheduler's status, once the releases this process sent have arrived: a job that
    returned here shows as ended (a release is one-way, `runtime.releases`)."""
    await RELEASES.settled()
    return await _on_actors(lambda h: h.scheduler.status.remote())


async def await_generating(kind: Kind | str, timeout_s: float = 120.0, min_held_s: float = 0.5) -> dict | None:
    """Wait until a job of `kind` is generating in a slot of a device of the pool: it runs, its lease
    is granted (so its model is loaded: a job still loading would end its turn unserved, not
    be revoked) and it has held the device `min_held_s`. Returns the running job's snapshot
    (its `device` too), or None after `timeout_s`. What demos, benchmarks, jobs and tests use
    before they preempt something."""
    kind = Kind.parse(kind).value
    deadline = time.monotonic() + timeout_s
    while True:
        status = await astatus()
        for running in (job for d in status["devices"] for job in d["jobs"]):   # every slot's
            lease = status["leases"].get(running["id"], {})
            if running["kind"] == kind and lease.get("state") == "granted" and lease.get("held_s", 0.0) >= min_held_s:
                return running
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.05)


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


def wait_generating(kind: Kind | str, timeout_s: float = 120.0, min_held_s: float = 0.5) -> dict | None:
    return _LOOP.run(await_generating(kind, timeout_s, min_held_s))
