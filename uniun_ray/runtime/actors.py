"""Ray shells: the actor classes as the cluster runs them, and how they are placed.

Placement (which GPU or stand-in resource each actor takes) is decided in `placement`. Both
use `num_cpus=0` so they never queue behind CPU tasks; torch's thread count is set deliberately
inside (see model_actor).
"""
from __future__ import annotations

import asyncio
import time

import ray

from .embedding_actor import EmbeddingActor
from .metrics import SchedulerMetrics
from .model_actor import ModelActor
from .protocol import NAMESPACE, DeviceLost
from .service import RuntimeConfig, SchedulerService

from .placement import Seat


#: How long the scheduler waits for a dying ModelActor that Ray restarts (max_restarts).
RESTART_WAIT_S = 60.0


class RayDevice:
    """The ModelActor seen through its handle, as the scheduler's `Device`. The handle is
    looked up by name, and again after a failure, so a re-created ModelActor is found. A call
    that dies with the actor raises DeviceLost; a restarted actor (max_restarts) comes back
    empty, so `grant` reloads the model the scheduler believes is resident."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cached = None
        self._model: str | None = None   # what the last successful load made resident

    def _handle(self):
        if self._cached is None:
            self._cached = ray.get_actor(self._name, namespace=NAMESPACE)
        return self._cached

    async def _call(self, method: str, *args):
        try:
            handle = self._handle()
        except ValueError as error:  # no actor by that name (killed for good)
            raise DeviceLost(f"no model actor {self._name!r}: {error}") from error
        try:
            return await getattr(handle, method).remote(*args)
        except ray.exceptions.RayActorError as error:
            self._cached = None
            await self._restarted()
            raise DeviceLost(f"{self._name} died or is restarting ({type(error).__name__})") from error

    async def _restarted(self, timeout_s: float = RESTART_WAIT_S) -> None:
        """Wait until a restarting ModelActor answers again (or is gone for good), so that the
        job re-queued after this loss is not dispatched into the restart, failing at once
        until its device faults run out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await self._handle().state.remote()
                return
            except ValueError:       # killed for good: nothing will come back under this name
                return
            except ray.exceptions.RayActorError:
                self._cached = None
                await asyncio.sleep(0.2)

    async def load(self, model_id: str) -> float:
        self._model = None
        seconds = await self._call("load", model_id)
        self._model = model_id
        return seconds

    async def grant(self, epoch: int) -> None:
        loaded = await self._call("grant", epoch)
        if self._model is not None and loaded != self._model:  # the actor restarted: reload
            await self._call("load", self._model)

    async def revoke(self, epoch: int) -> None:
        await self._call("revoke", epoch)

    async def current_epoch(self) -> int:
        return (await self._call("state"))["epoch"]

    async def describe(self) -> dict:
        """How the device runs its model on this host (dtype, threads, prefill chunk), for status."""
        try:
            return (await self._call("state"))["engine"]
        except DeviceLost as error:
            return {"error": str(error)}


class SchedulerActor(SchedulerService):
    """The named, detached singleton. Every method is async: a plain `def` would block the
    actor's event loop, and with it every waiter and heartbeat."""

    def __init__(self, model_actor: str, config: RuntimeConfig | None = None) -> None:
        super().__init__(RayDevice(model_actor), config, SchedulerMetrics())
        self._model_actor = model_actor

    def __repr__(self) -> str:
        running = self.policy.running_job
        return (f"SchedulerActor(loaded={self.policy.loaded_model}, queued={self.policy.queued}, "
                f"running={running.kind.value + ':' + running.id if running else None}, events={self.events.path})")

    async def status(self) -> dict:
        """The service's status, plus this actor's Ray worker id: the `WorkerId` label of
        its series on the metrics endpoint."""
        return await super().status() | {"worker_id": ray.get_runtime_context().get_worker_id(),
                                         "engine": await self.driver.device.describe()}

    async def ping(self) -> str:
        return "ok"

    async def chat_model(self) -> str:
        """The active chat model: what every client means by `model_id=None`."""
        return self.config.chat_model


def model_actor_options(name: str, seat: Seat) -> dict:
    return dict(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=3, max_task_retries=0, **seat.options)


def embedder_options(name: str, seat: Seat, concurrency: int) -> dict:
    return dict(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=3, max_task_retries=3, max_concurrency=concurrency, **seat.options)


#: Concurrent calls the scheduler takes. Every queued job's caller holds a `grant` long-poll
#: open, so Ray's async default (1000) would queue status, renew and release calls behind
#: the polls once 1000 jobs wait (a stall until polls time out). Calls are cheap coroutines.
SCHEDULER_MAX_CONCURRENCY = 100_000


def scheduler_options(name: str) -> dict:
    return dict(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=SCHEDULER_MAX_CONCURRENCY)


RemoteScheduler = ray.remote(SchedulerActor)
RemoteModel = ray.remote(ModelActor)
RemoteEmbedder = ray.remote(EmbeddingActor)
