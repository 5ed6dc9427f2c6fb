"""Ray shells: the actor classes as the cluster runs them, and how they are placed.

Placement (which GPU or stand-in resource each actor takes, how many devices the cluster
declares) is decided in `placement`. Model actors and the embedder use `num_cpus=0` so they
never queue behind CPU tasks; torch's thread count is set deliberately inside (see
model_actor).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Mapping

import ray

from . import nodes, placement
from .embedding_actor import EmbeddingActor
from .metrics import SchedulerMetrics
from .model_actor import ModelActor
from .protocol import NAMESPACE, SCHEDULER_NAME, DeviceGone, DeviceLost, UniunError, model_actor_name
from .service import RuntimeConfig, SchedulerService
from .warmstart import WarmStart
from ..models.registry import configure
from ..settings import EngineSettings

from .placement import Seat


#: How long the scheduler waits for a dying ModelActor that Ray restarts (max_restarts).
RESTART_WAIT_S = 60.0
#: How often the scheduler compares its pool with the cluster's resources (a GCS read or
#: two, and a name lookup per device).
WATCH_PERIOD_S = 3.0
#: The longest `status` waits for a device to describe its engine (a dead one never answers).
DESCRIBE_WAIT_S = 2.0
#: A node that joined: how long its capacity may wait for Ray to show its seats free, and how
#: often the scheduler looks meanwhile.
JOIN_PATIENCE_S = 5.0
JOIN_LOOK_S = 0.2

log = logging.getLogger(__name__)


class RayDevice:
    """The ModelActor seen through its handle, as the scheduler's `Device`. The handle is
    looked up by name, and again after a failure, so a re-created ModelActor is found. A call
    that dies with the actor raises DeviceLost; a restarted actor (max_restarts) comes back
    empty, and reloads the model the scheduler believes is resident at its next grant."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cached = None
        self.node: str | None = None     # the Ray node it runs on, once it said (`locate`)

    def _handle(self):
        if self._cached is None:
            self._cached = ray.get_actor(self._name, namespace=NAMESPACE)
        return self._cached

    async def _call(self, method: str, *args):
        try:
            handle = self._handle()
        except ValueError as error:  # no actor by that name (killed for good)
            raise DeviceGone(f"no model actor {self._name!r}: {error}") from error
        try:
            return await getattr(handle, method).remote(*args)
        except ray.exceptions.RayActorError as error:
            self._cached = None
            if not await self._restarted():
                raise DeviceGone(f"{self._name} is gone for good ({type(error).__name__})") from error
            raise DeviceLost(f"{self._name} died or is restarting ({type(error).__name__})") from error

    async def _restarted(self, timeout_s: float = RESTART_WAIT_S) -> bool:
        """Wait until a restarting ModelActor answers again, so that the job re-queued after
        this loss is not dispatched into the restart, failing at once until its device faults
        run out. False when it is gone for good: its name is free (killed without restart, out
        of restarts), or it did not come back within `timeout_s` (its node left and no other
        node has a free seat for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await self._handle().state.remote()
                return True
            except ValueError:       # nothing will come back under this name
                return False
            except ray.exceptions.RayActorError:
                self._cached = None
                await asyncio.sleep(0.2)
        return False

    async def load(self, model_id: str) -> float:
        return await self._call("load", model_id)

    async def abandon(self, model_id: str) -> None:
        await self._call("abandon", model_id)

    async def grant(self, epoch: int, live: tuple[int, ...] = (), model: str | None = None) -> None:
        await self._call("grant", epoch, live, model)

    async def serve(self, models: Mapping[str, str]) -> None:
        await self._call("serve", dict(models))   # a restarted actor reloads `model` itself

    async def slots(self, setting: int | None = None) -> dict:
        return await self._call("slots", setting)

    async def steps(self) -> dict:
        return await self._call("steps")

    async def revoke(self, epoch: int) -> None:
        await self._call("revoke", epoch)

    async def _state(self) -> dict:
        state = await self._call("state")
        self.node = state.get("node") or self.node
        return state

    async def current_epoch(self) -> int:
        return (await self._state())["epoch"]

    async def describe(self) -> dict:
        """How the device runs its model on this host (dtype, threads, prefill chunk), for status."""
        try:
            return (await asyncio.wait_for(self._state(), DESCRIBE_WAIT_S))["engine"]
        except (DeviceLost, asyncio.TimeoutError) as error:
            return {"error": str(error) or "no answer"}

    async def locate(self) -> str | None:
        """The node the ModelActor runs on: asked once it answers (a new one imports torch
        first); None if it died before it did."""
        if self.node is None:
            try:
                await self._state()
            except DeviceLost:
                pass
        return self.node

    async def retire(self) -> None:
        """Kill the ModelActor for good: its node died. Ray would keep its name while it waits
        to restart it on a seat that may never come, and calls to it would wait with it."""
        def kill() -> None:
            try:
                ray.kill(ray.get_actor(self._name, namespace=NAMESPACE), no_restart=True)
            except ValueError:  # gone already
                pass
        await asyncio.to_thread(kill)
        self._cached = None

    async def alive(self) -> bool:
        """False once the ModelActor is gone for good: no actor holds its name any more."""
        def named() -> bool:   # a GCS lookup: off the event loop
            try:
                ray.get_actor(self._name, namespace=NAMESPACE)
                return True
            except ValueError:
                return False
        return await asyncio.to_thread(named)


async def served_folders() -> dict[str, str] | None:
    """The scheduler's table of the operator's ids (its `served_models`), which a ModelActor asks
    for an id it does not know; None while there is no scheduler to ask."""
    try:
        scheduler = await asyncio.to_thread(ray.get_actor, SCHEDULER_NAME, namespace=NAMESPACE)
        return (await scheduler.served_models.remote())["folders"]
    except (ValueError, ray.exceptions.RayActorError):
        return None


@dataclass(frozen=True)
class ModelFleet:
    """How ModelActors are made, by `start()` for the first pool and by the scheduler for a
    device it discovers later, alike: the engine settings and forced torch device of the
    process that started the runtime, and the GPUs the embedder took (never devices)."""

    settings: EngineSettings
    forced: str | None = None
    embedder_gpus: int = 0
    models: tuple[tuple[str, str], ...] = ()   # the operator's ids and folders (`registry.configure`)

    def seat(self, resources: Mapping[str, float]) -> Seat:
        return placement.model_seat(resources, self.forced)

    def create(self, device: str, resources: Mapping[str, float]):
        """Get or create the ModelActor of `device` (named `model:<device>`)."""
        seat = self.seat(resources)
        return RemoteModel.options(**model_actor_options(model_actor_name(device), seat)).remote(
            device=seat.torch_device, settings=self.settings, models=dict(self.models), served=served_folders)


class SchedulerActor(SchedulerService):
    """The named, detached singleton. Every method is async: a plain `def` would block the
    actor's event loop, and with it every waiter and heartbeat. It watches the cluster and
    keeps its pool of devices in step (`watch_pool`)."""

    def __init__(self, devices: list[str], fleet: ModelFleet, config: RuntimeConfig | None = None) -> None:
        super().__init__({d: RayDevice(model_actor_name(d)) for d in devices}, config, SchedulerMetrics())
        self._fleet = fleet
        self._watcher: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        self._nodes: dict[str, nodes.Node] = {}   # node id -> the node, as the GCS last said
        self._pool_lock = asyncio.Lock()         # one look at the cluster at a time
        self._retiring: set[str] = set()         # devices of a dead node whose actors are being killed
        self._warm_start = WarmStart(self)

    def __repr__(self) -> str:
        running = {d: [f"{j.kind.value}:{j.id}" for j in jobs] for d, jobs in self.policy.slot_jobs.items() if jobs}
        return (f"SchedulerActor(loaded={self.policy.loaded_models}, queued={self.policy.queued}, "
                f"running={running}, events={self.events.path})")

    async def status(self) -> dict:
        """The service's status, each device with its engine (`engine`: the first device's),
        plus this actor's Ray worker id: the `WorkerId` label of its series on the metrics
        endpoint."""
        snap = await super().status()
        engines = await asyncio.gather(*(self.drivers[d["device"]].device.describe() for d in snap["devices"]))
        for device, engine in zip(snap["devices"], engines):
            device["engine"] = engine
            device["node"] = self.drivers[device["device"]].device.node
        placed = {d: driver.device.node for d, driver in self.drivers.items()}
        return snap | {"worker_id": ray.get_runtime_context().get_worker_id(),
                       "engine": engines[0] if engines else {}, "nodes": nodes.describe(self._nodes.values(), placed)}

    async def ping(self) -> str:
        return "ok"

    async def ready(self, wait: bool = True) -> str | None:
        """The warm start (`warmstart`): what still loads, None once ready."""
        self._keep_running()
        return await self._warm_start.ready(wait)

    async def warming(self) -> str | None:
        """What the warm start still loads ("MODEL on DEVICE"), None when none runs (/health)."""
        return self._warm_start.loading

    async def chat_model(self) -> str:
        """The active chat model: what every client means by `model_id=None`."""
        self._keep_running()
        return self.config.chat_model

    async def served_models(self) -> dict:
        """What a request from outside may name (`registry.check_served`), beside the embedded
        ids: the active chat model and the operator's ids; `hub`: whether Hugging Face repo ids
        cached on the host are served too; `folders`: the operator's ids -> their folders, for the
        server's own processes (the HTTP replicas read a served model's template), never shown."""
        return {"ids": [self.config.chat_model, *self.config.models], "hub": self.config.hub_models,
                "folders": dict(self.config.models)}

    async def serve(self, models: Mapping[str, str]) -> dict:
        """Add the operator's `models` (id -> folder) to what this runtime serves, and give the
        whole table to every device (one made later gets it with the fleet). An id served
        already keeps its folder: naming another for it is a ValueError, and nothing changes.
        Returns which ids were added and which were served already."""
        table = dict(self.config.models)
        clashes = {m: (table[m], f) for m, f in models.items() if m in table and table[m] != str(f)}
        if clashes:
            raise ValueError("; ".join(f"model {m!r} is served from {old!r} already, not {new!r}: serve the "
                                       f"other folder under another id" for m, (old, new) in clashes.items()))
        added = sorted(set(models) - set(table))
        if added:
            table.update({m: str(models[m]) for m in added})
            configure(table)   # checks the ids (an embedded one cannot be taken) before anything changes
            self.config = replace(self.config, models=table)
            self._fleet = replace(self._fleet, models=tuple(table.items()))
        await asyncio.gather(*(self._serve_on(driver.device, table) for driver in list(self.drivers.values())))
        return {"added": added, "kept": sorted(set(table) - set(added)), "chat_model": self.config.chat_model}

    @staticmethod
    async def _serve_on(device: RayDevice, table: dict[str, str]) -> None:
        try:
            await device.serve(table)
        except (DeviceLost, DeviceGone):   # a restarted one asks for the table itself
            pass

    # -- the pool follows the cluster ---------------------------------------------------------
    def _keep_running(self) -> None:
        super()._keep_running()
        loop = asyncio.get_running_loop()
        if self._watcher is None or self._watcher.done():
            self._watcher = loop.create_task(self._watch())
        if self._follower is None or self._follower.done():
            self._follower = loop.create_task(self._follow_nodes())

    async def _follow_nodes(self) -> None:
        """Ray's node table, as the GCS publishes its changes (`nodes.changes`): each node that
        dies takes its devices out of the pool, each that joins gets its declared devices."""
        for driver in list(self.drivers.values()):
            self._spawn(driver.device.locate())
        async for changed in nodes.changes(ray.get_runtime_context().gcs_address):
            for node in changed:
                try:
                    await self.node_changed(node)
                except Exception:  # a GCS hiccup: the periodic watch catches up
                    log.exception("following node %s failed", node.named())

    async def node_changed(self, node: nodes.Node) -> dict:
        """One node's news: dead, its devices leave the pool at once (R20: their jobs go back
        to their places and resume elsewhere); joined, its capacity gets devices. Returns what
        changed in the pool."""
        known = self._nodes.get(node.id)
        if known is not None and not node.address:  # a death notice carries the id, not the rest
            node = replace(node, address=known.address, head=known.head)
        self._nodes[node.id] = node
        if known is not None and known.alive == node.alive:
            return {"added": [], "removed": []}
        if not node.alive:
            if known is not None:
                self._emit("node", None, node=node.id, address=node.address, change="left", reason=node.death)
            return {"added": [], "removed": await self._node_left(node)}
        self._emit("node", None, node=node.id, address=node.address, change="joined")
        return await self._node_joined()

    async def _node_left(self, node: nodes.Node) -> list[str]:
        """Remove the devices that ran on `node` at once, busy ones too (their holders' calls
        fail with the node), whatever a look at the cluster is doing meanwhile; then kill their
        actors for good, so that Ray frees their names (until then no look adopts them)."""
        leaving = {d: driver.device for d, driver in self.drivers.items() if driver.device.node == node.id}
        self._retiring.update(leaving)
        try:
            for device in leaving:
                self.remove_device(device, f"its node {node.named()} {node.death or 'left the cluster'}")
            await asyncio.gather(*(actor.retire() for actor in leaving.values()))
        finally:
            self._retiring.difference_update(leaving)
        return list(leaving)

    async def _node_joined(self) -> dict:
        """Place the capacity a joining node declares. Ray may show its resources as free a
        moment after it registered: look again briefly while a device waits for its seat."""
        deadline = time.monotonic() + JOIN_PATIENCE_S
        while True:
            change = await self.watch_pool()
            if not change["waiting"] or time.monotonic() >= deadline:
                return change
            await asyncio.sleep(JOIN_LOOK_S)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                await self.watch_pool()
            except Exception:  # a GCS hiccup: look again next period
                log.exception("watching the cluster's devices failed")

    async def watch_pool(self) -> dict:
        """One look at the cluster (`placement.reconcile`): a device whose actor is gone for
        good and that runs nothing leaves the pool (a busy one leaves through its job's fault
        path, which re-queues the job); declared capacity without a device gets a ModelActor
        as soon as its seat is free, or the one that already holds the name (made before this
        scheduler restarted). Returns what changed, and the devices still `waiting` for a seat."""
        async with self._pool_lock:
            return await self._reconcile()

    async def _reconcile(self) -> dict:
        resources = await asyncio.to_thread(ray.cluster_resources)
        present = list(self.drivers)
        gone = await asyncio.gather(*(self.drivers[d].gone() for d in present))
        change = placement.reconcile(resources, self._fleet.embedder_gpus, present,
                                     [d for d, lost in zip(present, gone) if lost])
        busy = self.policy.running_jobs
        removed = [d for d in change.remove if d not in busy]
        for device in removed:
            self.remove_device(device, "its model actor is gone")
        added, waiting = [], []
        if change.add:
            available = dict(await asyncio.to_thread(ray.available_resources))
            seat = self._fleet.seat(resources)
            for device in (d for d in change.add if d not in self.drivers):  # a busy gone one stays, for now
                model = RayDevice(model_actor_name(device))
                if device in self._retiring:  # its dead node's actor still holds the name
                    waiting.append(device)
                    continue
                if not await model.alive():
                    try:
                        placement.check_free(model_actor_name(device), seat, available)
                    except UniunError:  # its seat is not free (yet): look again next period
                        waiting.append(device)
                        continue
                    for resource, amount in seat.needs.items():
                        available[resource] -= amount
                    self._fleet.create(device, resources)
                self.add_device(device, model)
                self._spawn(model.locate())
                added.append(device)
        return {"added": added, "removed": removed, "waiting": waiting}


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
