"""The ModelActor: the one accelerator, as a thin Ray shell around `models.Engine`.

It holds one model, loads and unloads it when the scheduler says so, and streams
generations for whoever holds the current lease. Fencing: the scheduler announces each new
lease epoch with `grant` and withdraws one with `revoke`; `generate` serves only the
current, unrevoked epoch, and a revoke sets the running generation's cancel flag, which the
engine reads before every forward pass (so it stops within one token, or one prefill chunk).

Blocking work (load, a whole generation, tokenizer checks) runs in threads so the actor's
event loop stays free to take a revoke while a generation is running.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict

from ..models.registry import prepared, resolve
from ..models.request import GenerateRequest
from ..models.settings import EngineSettings
from .metrics import ModelMetrics
from .placement import DEVICE_RESOURCE, assigned_resources, node_id, stand_ins_here
from .protocol import LeaseRevoked

log = logging.getLogger(__name__)
_END = object()
#: After a piece goes out, what the model makes in this long goes out as the next piece. Each
#: stream item costs the actor's loop (and its GIL, shared with the model's thread) about as
#: much as a fast model's token: sent one by one, 1,800 tokens of a 1M-parameter model took 3x
#: the bare engine's time. 50 pieces a second is still smooth to read; the first token is
#: not delayed. (vLLM's ``stream_interval`` is the same idea, counted in tokens.)
STREAM_INTERVAL_S = 0.02


class ModelActor:
    """``settings`` come from the process that starts the actor (``UNIUN_DTYPE``,
    ``UNIUN_THREADS``). Unless ``UNIUN_THREADS`` fixes them, the engine measures the cores the
    actor's process may run on (not Ray's OMP_NUM_THREADS=1: the model is the only work of
    this device) against half of them and keeps the faster. N stand-in devices of one node
    (`uniun-ray up --devices N` on a CPU machine) share its cores: 1/N each at most, so that
    two devices running at once do not fight over every core."""

    def __init__(self, device: str = "cpu", settings: EngineSettings | None = None) -> None:
        from ..models.engine import Engine  # torch: only in the actor's own process

        settings = settings or EngineSettings()
        budget = None
        if device == "cpu" and DEVICE_RESOURCE in assigned_resources():
            budget = max(1, settings.resolved_threads() // stand_ins_here())
        self._engine = Engine(device=device, dtype=settings.dtype, num_threads=settings.threads, thread_budget=budget,
                              kv_cache_mb=settings.kv_cache_mb, kv_offload_mb=settings.kv_offload_mb,
                              max_memory=settings.max_memory)
        self._device = device
        self._epoch = 0
        self._revoked = False
        self._running: dict[int, threading.Event] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._swap_lock = asyncio.Lock()
        self._last_revoke: dict[int, float] = {}
        self.stop_latencies: deque[float] = deque(maxlen=1024)  # the latest; the histogram has all
        self._metrics = ModelMetrics()
        if os.nice(0) > 0:
            log.warning("this ModelActor runs at niceness %d (Ray's worker_niceness): every busy program of "
                        "the host takes the CPU first, and a chat can wait seconds for its first token. Start "
                        "Ray with RAY_worker_niceness=0 (uniun-ray up and the local clusters of uniun-ray do).",
                        os.nice(0))

    def __repr__(self) -> str:
        return f"ModelActor(device={self._device}, loaded={self._engine.loaded}, epoch={self._epoch})"

    # -- swaps -----------------------------------------------------------------------------
    async def load(self, model_id: str) -> float:
        """Make `model_id` resident; returns the measured seconds (0.0 if it already was).
        A generation still stopping (a fenced lease) is cancelled and awaited first."""
        async with self._swap_lock:
            await self._drain()
            return await asyncio.to_thread(self._engine.load, model_id)

    async def unload(self) -> float:
        async with self._swap_lock:
            await self._drain()
            return await asyncio.to_thread(self._engine.unload)

    async def reset(self) -> None:
        """Back to a just-started device: no model, no cached KV, no stop history. The lease
        epoch stays (it only ever grows, so that every older lease stays fenced). A new
        scheduler on a running cluster, or a test wanting a fresh device, gets one without the
        cost of a new actor process (torch and transformers imported again: seconds)."""
        async with self._swap_lock:
            await self._drain()
            await asyncio.to_thread(self._engine.unload)
            self._last_revoke.clear()
            self.stop_latencies.clear()

    async def _drain(self) -> None:
        for flag in self._running.values():
            flag.set()
        await self._idle.wait()

    # -- fencing ---------------------------------------------------------------------------
    async def grant(self, epoch: int) -> str | None:
        """Make `epoch` the current lease. A newer epoch fences every older one: a generation
        still running under an older lease stops at its next token. Returns the resident
        model (None after a restart), so the scheduler can tell the device lost it."""
        if epoch > self._epoch:
            self._epoch, self._revoked = epoch, False
            for older, flag in self._running.items():
                if older < epoch:
                    flag.set()
        return self._engine.loaded

    async def revoke(self, epoch: int) -> None:
        if epoch == self._epoch:
            self._revoked = True
        flag = self._running.get(epoch)
        if flag is not None:
            self._last_revoke[epoch] = time.perf_counter()
            flag.set()

    # -- work ------------------------------------------------------------------------------
    async def check(self, model_id: str, request: GenerateRequest) -> int:
        """Validate a request against a model without loading its weights (tokenizer and
        config only): prompt too long, messages to a model without a chat template... Returns
        the prompt's token count. Clients call this before queueing."""
        from ..models.vocabulary import inspect_request

        return await asyncio.to_thread(inspect_request, resolve(model_id), request)

    async def prepare(self, model_id: str) -> bool:
        """Whether the model's weights are ready here; if not, their one-time conversion starts
        in the background (`registry.prepared`). UnknownModel for an id nothing resolves."""
        return await asyncio.to_thread(prepared, resolve(model_id))

    async def generate(self, epoch: int, request: GenerateRequest, revocable: bool = True):
        """Stream {"piece": text, "tokens": n} items (n: the run's tokens streamed so far, text
        being a batch of them), then one {"result": ...}. Call with
        `.options(num_returns="streaming")`. `revocable=False` (a chat lease: only its own
        cancel stops it) reads the prompt in long chunks (see `Engine.generate`)."""
        if epoch != self._epoch or self._revoked:
            raise LeaseRevoked(f"lease epoch {epoch} is not current (current {self._epoch}, "
                               f"revoked={self._revoked})")
        flag = threading.Event()
        generation = self._engine.generate(request, flag, revocable)
        self._running[epoch] = flag
        self._idle.clear()
        loop, pieces = asyncio.get_running_loop(), asyncio.Queue()

        def pump() -> None:  # one thread runs the whole generation, handing pieces to the loop
            try:
                for piece in generation:
                    loop.call_soon_threadsafe(pieces.put_nowait, (piece, generation.emitted_tokens))
            finally:
                loop.call_soon_threadsafe(pieces.put_nowait, _END)

        pumping = asyncio.ensure_future(asyncio.to_thread(pump))
        try:
            ended = False
            while not ended:
                # what piled up while the last item went out goes as one piece: a fast model
                # outruns a per-token Ray stream, and the first token still goes at once
                batch = [await pieces.get()]
                while not pieces.empty():
                    batch.append(pieces.get_nowait())
                ended = batch[-1] is _END
                batch = batch[:-1] if ended else batch
                if batch:
                    yield {"piece": "".join(text for text, _ in batch), "tokens": batch[-1][1]}
                    if not ended:
                        await asyncio.sleep(STREAM_INTERVAL_S)
            await pumping  # the model's exception, if it raised one
            result = asdict(generation.result)
            revoked_at = self._last_revoke.pop(epoch, None)
            if revoked_at is not None:
                result["stop_latency_s"] = time.perf_counter() - revoked_at
                self.stop_latencies.append(result["stop_latency_s"])
                self._metrics.stop.observe(result["stop_latency_s"], tags={"model": str(self._engine.loaded)})
            yield {"result": result}
            described = self._engine.describe()
            if "kv_cache" in described:
                self._metrics.kv_cache(described["model"], described["kv_cache"])
        finally:
            flag.set()  # a consumer that went away stops the run at the next token
            await asyncio.wait([pumping])
            await asyncio.to_thread(generation.close)
            del self._running[epoch]
            if not self._running:
                self._idle.set()

    async def state(self) -> dict:
        return {"device": self._device, "loaded": self._engine.loaded, "epoch": self._epoch,
                "revoked": self._revoked, "generating": sorted(self._running),
                "context_length": self._engine.context_length,
                "engine": self._engine.describe() | {"niceness": os.nice(0)},   # its threads run at it
                "ray_resources": assigned_resources(), "node": node_id(),
                "stop_latency_s": list(self.stop_latencies)}
