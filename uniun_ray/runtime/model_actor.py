"""The ModelActor: the one accelerator, as a thin Ray shell around an `engines.Engine`.

It holds one model, loads and unloads it when the scheduler says so, and streams
generations for whoever holds a live lease of one of its slots (SPEC §6). What runs the
forward passes is the engine's (SPEC §7: `UNIUN_ENGINE`, transformers by default, or vLLM);
the actor drives it through the seam only and never asks which.
Fencing: the scheduler announces each new lease epoch with `grant`, naming the epochs still
live beside it; every other epoch is fenced, and `revoke` withdraws one. `generate` serves
only live epochs, and a fence or revoke cancels that job in the engine, which stops it at its
next step (within one token, or one prefill chunk) while the others go on.

Blocking work (load, tokenizing a request, the engine's steps) runs in threads so the actor's
event loop stays free to take a revoke while the device decodes.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict

from .. import engines
from ..models.registry import UnknownModel, configure, configured, prepared, resolve
from ..models.requests.request import GenerateRequest
from ..settings import MAX_SLOTS, EngineSettings
from ..models.swap import HOST, NONE, RESIDENT, Swap
from ..models.requests.vocabulary import tool_call_format
from .metrics import ModelMetrics
from .placement import DEVICE_RESOURCE, assigned_resources, devices_here, node_id, stand_ins_here
from .protocol import DeviceLost, LeaseRevoked

log = logging.getLogger(__name__)
#: After a piece goes out, what the model makes in this long goes out as the next piece. Each
#: stream item costs the actor's loop (and its GIL, shared with the model's thread) about as
#: much as a fast model's token: sent one by one, 1,800 tokens of a 1M-parameter model took 3x
#: the bare engine's time. 50 pieces a second is still smooth to read; the first token is
#: not delayed. (vLLM's ``stream_interval`` is the same idea, counted in tokens.)
STREAM_INTERVAL_S = 0.02
#: The same for background runs (revocable): nobody reads them token by token, and on a small
#: host every stream item (Ray's stream, then HTTP's) takes CPU from the batch they decode in.
BACKGROUND_STREAM_INTERVAL_S = 0.25
#: The swaps `state` lists, the latest last.
SWAPS_SHOWN = 16


class ModelActor:
    """``settings`` come from the process that starts the actor (``UNIUN_ENGINE``,
    ``UNIUN_DTYPE``, ``UNIUN_THREADS``...). Unless ``UNIUN_THREADS`` fixes them, the engine measures the cores the
    actor's process may run on (not Ray's OMP_NUM_THREADS=1: the model is the only work of
    this device) against half of them and keeps the faster. N stand-in devices of one node
    (`uniun-ray up --devices N` on a CPU machine) share its cores: 1/N each at most, so that
    two devices running at once do not fight over every core."""

    def __init__(self, device: str = "cpu", settings: EngineSettings | None = None,
                 models: dict[str, str] | None = None, served=None) -> None:
        settings = settings or EngineSettings()
        configure(models or {})   # the operator's ids (`uniun-ray up --model ID=PATH`) resolve here too
        self._served = served     # async () -> the scheduler's table of them, asked for an id not known here
        budget = None
        if device == "cpu" and DEVICE_RESOURCE in assigned_resources():
            budget = max(1, settings.resolved_threads() // stand_ins_here())
        # the node's devices share its memory: each plans with its share (``uniun_ray.memory``)
        self._engine = engines.create(settings, device, self._wake_threadsafe, budget, devices_here())
        self._device = device
        self._epoch = 0                     # the newest epoch granted
        self._live: set[int] = {0}          # the epochs whose leases hold a slot
        self._running: dict[int, threading.Event] = {}   # epoch -> its stop flag (set: cancelled)
        self._streams: set[asyncio.Event] = set()   # one per running generation: woken after each step
        self._idle = asyncio.Event()
        self._idle.set()
        self._swap_lock = asyncio.Lock()
        self._loading: tuple[str, threading.Event] | None = None   # the load in flight and its abandon flag
        self._last_revoke: dict[int, float] = {}
        self.stop_latencies: deque[float] = deque(maxlen=1024)  # the latest; the histogram has all
        self._swaps: deque[Swap] = deque(maxlen=SWAPS_SHOWN)      # the latest, for status
        self._metrics = ModelMetrics()
        self._loop: asyncio.AbstractEventLoop | None = None
        if os.nice(0) > 0:
            log.warning("this ModelActor runs at niceness %d (Ray's worker_niceness): every busy program of "
                        "the host takes the CPU first, and a chat can wait seconds for its first token. Start "
                        "Ray with RAY_worker_niceness=0 (uniun-ray up and the local clusters of uniun-ray do).",
                        os.nice(0))

    def __repr__(self) -> str:
        return (f"ModelActor(device={self._device}, engine={self._engine.name}, loaded={self._engine.loaded}, "
                f"epoch={self._epoch}, live={sorted(self._live)}, generating={sorted(self._running)})")

    # -- swaps -----------------------------------------------------------------------------
    async def load(self, model_id: str) -> Swap:
        """Make `model_id` resident; returns the swap (`Swap`: its kind, cold load, warm copy
        or switch, and its measured seconds; kind "none" if it already was). A generation
        still stopping (a fenced lease) is cancelled and awaited first."""
        async with self._swap_lock:
            await self._drain()
            self._loading = (model_id, threading.Event())
            try:
                swap = await self._resolving(self._engine.load, model_id, self._loading[1])
            finally:
                self._loading = None
            if swap.kind != NONE:
                self._swaps.append(swap)
            return swap

    async def abandon(self, model_id: str) -> None:
        """Give up a load of `model_id` still in flight (R13: a chat needs the device for
        another model): it stops at its next step and raises SwapAbandoned; the model it
        replaced stays warm. Anything else (no load, another model's) is left alone."""
        loading = self._loading
        if loading is not None and loading[0] == model_id:
            loading[1].set()

    async def unload(self) -> float:
        async with self._swap_lock:
            await self._drain()
            return await asyncio.to_thread(self._engine.unload)

    async def reset(self) -> None:
        """Back to a just-started device: no model (none warm), no cached KV, no stop or swap
        history. The lease
        epoch stays (it only ever grows, so that every older lease stays fenced). A new
        scheduler on a running cluster, or a test wanting a fresh device, gets one without the
        cost of a new actor process (torch and transformers imported again: seconds)."""
        async with self._swap_lock:
            await self._drain()
            await asyncio.to_thread(self._engine.unload)   # the warm models too
            configure({})   # the next scheduler gives its own table of served models
            self._last_revoke.clear()
            self.stop_latencies.clear()
            self._swaps.clear()

    async def _drain(self) -> None:
        for epoch in list(self._running):
            self._stop(epoch)
        await self._idle.wait()

    def _stop(self, epoch: int) -> None:
        """Cancel the job of `epoch` in the engine. The flag covers a job still starting (a
        revoke that comes while `start` tokenizes): `generate` cancels it once started."""
        self._running[epoch].set()
        self._engine.cancel(epoch)

    # -- fencing ---------------------------------------------------------------------------
    async def grant(self, epoch: int, live: tuple[int, ...] = (), model: str | None = None) -> str | None:
        """Make `epoch` a live lease beside `live` (the scheduler's other leases on this
        device, SPEC §6): a newer grant fences every epoch it does not name, and a generation
        still running under one stops at its next step. A grant older than the newest one seen
        arrived late: the newer one named it already. `model`: what the scheduler believes is
        resident; a device that restarted (or whose engine lost its model: its server died)
        holds nothing and loads it here, before any holder's call runs (`generate` waits for a
        load). Returns the resident model."""
        if epoch > self._epoch:
            self._epoch, self._live = epoch, set(live) | {epoch}
            for older in list(self._running):
                if older < epoch and older not in self._live:   # a newer one's grant is still coming
                    self._stop(older)
        if model is not None and self._engine.loaded != model:
            await self.load(model)
        return self._engine.loaded

    def _admits(self, epoch: int) -> bool:
        """A live epoch, or one newer than every grant seen: the scheduler hands a lease out
        without waiting for the device's answer to its grant (one hop less per job), so the
        holder's call may overtake the grant, which then fences as usual when it comes. A
        device that has seen no grant since it started admits nothing early: a stale holder
        of a restarted device is refused."""
        return epoch in self._live or 0 < self._epoch < epoch

    async def revoke(self, epoch: int) -> None:
        self._live.discard(epoch)
        if epoch in self._running:
            self._last_revoke[epoch] = time.perf_counter()
            self._stop(epoch)

    async def slots(self, setting: int | None = None) -> dict:
        """R25: the jobs the resident model may decode together here: `setting` (the
        scheduler's `UNIUN_SLOTS`) or, for None ("auto"), chosen from the step profile
        measured at load; and that profile (seconds per step by batch size: the policy's R23
        input). Never more than the engine can run together (a model that cannot be batched: 1)."""
        return await asyncio.to_thread(self._slot_plan, setting)

    def _slot_plan(self, setting: int | None) -> dict:
        from ..models.runner.profile import auto_slots

        profile = self._engine.step_profile()
        chosen = setting or auto_slots(profile, limit=MAX_SLOTS)
        return {"slots": min(chosen, self._engine.capacity), "step_profile": profile, "auto": setting is None}

    async def steps(self) -> dict:
        """The step times this device serves now (R23: the policy reads those, not only the
        probe's at load), which the scheduler asks for now and then while the device is busy:
        the resident model and its step profile (`Engine.step_profile`). Off the event loop,
        and off the decode loop's thread: the engine keeps the figures as it steps."""
        return await asyncio.to_thread(self._served_steps)

    def _served_steps(self) -> dict:
        return {"model": self._engine.loaded, "step_profile": self._engine.step_profile()}

    async def serve(self, models: dict[str, str]) -> None:
        """The scheduler's table of the operator's ids (id -> folder), replacing this process's:
        a model added to a running runtime reaches every device that exists already."""
        configure(models)

    async def _resolving(self, call, model_id: str, *args):
        """`call(model_id, *args)` in a thread; an id this process does not know is asked of the
        scheduler, which holds the one table of served models (a device made by an earlier
        scheduler, or restarted by Ray with its first arguments, may lag behind it), then tried once more."""
        try:
            return await asyncio.to_thread(call, model_id, *args)
        except UnknownModel:
            table = await self._served() if self._served is not None else None
            if table is None or table == configured():
                raise
            configure(table)
        return await asyncio.to_thread(call, model_id, *args)

    # -- work ------------------------------------------------------------------------------
    async def check(self, model_id: str, request: GenerateRequest) -> int:
        """Validate a request against a model without loading its weights (tokenizer and
        config only): prompt too long, messages to a model without a chat template, what the
        engine cannot follow... Returns the prompt's token count. Clients call this before queueing."""
        return await self._resolving(self._engine.check, model_id, request)

    async def prepare(self, model_id: str) -> bool:
        """Whether the model's weights are ready here; if not, their one-time conversion starts
        in the background (`registry.prepared`). UnknownModel for an id nothing resolves."""
        return await self._resolving(lambda model_id: prepared(resolve(model_id)), model_id)

    async def generate(self, epoch: int, request: GenerateRequest, revocable: bool = True):
        """Stream {"piece": text, "tokens": n} items (n: the run's tokens streamed so far, text
        being a batch of them), then one {"result": ...}. Call with
        `.options(num_returns="streaming")`. The run joins the engine's batch at its next
        step. `revocable=False` (a chat lease: only its own cancel stops it) lets the engine
        read the prompt in long chunks. DeviceLost when the engine lost its model under the
        job (its server died): the client re-queues the job, and the next grant reloads."""
        if not self._admits(epoch):
            raise LeaseRevoked(f"lease epoch {epoch} is not live (newest {self._epoch}, live {sorted(self._live)})")
        if self._swap_lock.locked():   # a load under way (a grant's, after a restart): the run needs its model
            async with self._swap_lock:
                pass
        self._loop = asyncio.get_running_loop()
        flag, stepped = threading.Event(), asyncio.Event()
        self._running[epoch] = flag
        self._streams.add(stepped)
        self._idle.clear()
        run = None
        try:
            run = await asyncio.to_thread(self._engine.start, epoch, request, revocable)
            if flag.is_set():   # revoked while it started
                self._engine.cancel(epoch)
            async for item in self._stream(run, stepped, STREAM_INTERVAL_S if not revocable else
                                           BACKGROUND_STREAM_INTERVAL_S):
                yield item
            result = self._result(epoch, run)
            await asyncio.to_thread(self._observe_kv_cache)   # an engine's status may ask its server
            yield {"result": result}
        finally:
            self._engine.cancel(epoch)  # a consumer that went away stops the run at the next step
            # shielded: a second cancel of this call (its caller going away again) must not leave
            # the run counted as running for ever (a later load would wait for it)
            await asyncio.shield(asyncio.ensure_future(self._forget(epoch, run, stepped)))

    async def _forget(self, epoch: int, run, stepped: asyncio.Event) -> None:
        """Once the run has stopped: the device no longer counts it (`_drain`, `state`)."""
        if run is not None:
            await _ended(run, stepped)
        self._streams.discard(stepped)
        del self._running[epoch]
        if not self._running:
            self._idle.set()

    async def _stream(self, run, stepped: asyncio.Event, interval: float):
        """The job's pieces as the engine steps: what piled up since the last item goes as one
        (a fast model outruns a per-token Ray stream; the first token still goes at once)."""
        while True:
            stepped.clear()               # a step that ends after this wakes the wait below
            ended = run.done.is_set()     # read before the pieces: every piece is out once it is set
            text, tokens = run.drain()
            if text:
                yield {"piece": text, "tokens": tokens}
            if ended:
                return
            if text:
                await self._pause(run, stepped, interval)
            else:
                await stepped.wait()

    @staticmethod
    async def _pause(run, stepped: asyncio.Event, interval: float) -> None:
        """Let pieces pile up for `interval`, but no longer than the run lasts: a run that ends
        (a revoke, its last token) frees its slot's bookkeeping at once."""
        try:
            await asyncio.wait_for(_ended(run, stepped), interval)
        except asyncio.TimeoutError:
            pass

    def _result(self, epoch: int, run) -> dict:
        result = asdict(run.result)
        if result["finish_reason"] == "error":
            if self._engine.loaded is None:
                raise DeviceLost(f"the {self._engine.name} engine lost its model: {run.failure!r}") from run.failure
            raise RuntimeError(f"the model failed: {run.failure!r}") from run.failure
        revoked_at = self._last_revoke.pop(epoch, None)
        if revoked_at is not None:
            result["stop_latency_s"] = time.perf_counter() - revoked_at
            self.stop_latencies.append(result["stop_latency_s"])
            self._metrics.stop.observe(result["stop_latency_s"], tags={"model": str(self._engine.loaded)})
        return result

    def _observe_kv_cache(self) -> None:
        described = self._engine.status()
        if "kv_cache" in described:
            self._metrics.kv_cache(described["model"], described["kv_cache"])

    def _wake_threadsafe(self) -> None:
        """From the engine's threads, after any job stepped or ended: wake every stream."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        for stepped in self._streams:
            stepped.set()

    async def state(self) -> dict:
        engine = await asyncio.to_thread(self._engine.status)   # it may ask the engine's server
        calls = await asyncio.to_thread(_tool_call_format, self._engine.loaded)   # reads a tokenizer once
        return {"device": self._device, "loaded": self._engine.loaded, "epoch": self._epoch,
                "live": sorted(self._live), "generating": sorted(self._running),
                "slots": {"rows": engine["running"], "steps_by_batch": engine.get("steps_by_batch", {})},
                "context_length": engine.get("context_length"),
                "engine": engine | {"niceness": os.nice(0),   # its threads run at it
                                    "tool_call_format": calls,
                                    # over a window: the cores this process used, against its threads
                                    "process_cpu_s": time.process_time()},
                "models": _models(self._engine.loaded, self._swaps),
                "swaps": [swap.describe() for swap in self._swaps],
                "ray_resources": assigned_resources(), "node": node_id(),
                "stop_latency_s": list(self.stop_latencies)}


def _models(active: str | None, swaps: deque[Swap]) -> dict:
    """Which models this device holds: the active one, and the idle ones resident beside it
    or warm in host memory, as the latest swap left them (a reset or an unload keeps none)."""
    kept = swaps[-1].kept if swaps and swaps[-1].model == active else {}
    return {"active": active, "resident": [m for m, where in kept.items() if where == RESIDENT],
            "warm": [m for m, where in kept.items() if where == HOST]}


@functools.lru_cache(maxsize=16)
def _tool_call_format(model_id: str | None) -> str | None:
    """The loaded model's tool-call format, for status (its tokenizer is read once)."""
    if model_id is None:
        return None
    try:
        return tool_call_format(resolve(model_id))
    except (ValueError, OSError) as error:   # for status only: never fail a state query
        return f"unknown: {error}"


async def _ended(run, stepped: asyncio.Event) -> None:
    """Until the run is done (woken by the engine after each step)."""
    while not run.done.is_set():
        stepped.clear()
        if not run.done.is_set():
            await stepped.wait()
