"""Ray shells: the actor classes as the cluster runs them, and how they are placed.

Placement. The ModelActor takes the accelerator: `num_gpus=1` where a CUDA GPU is
present, otherwise the custom resource `uniun_device` that stands in for it (a local
cluster started by `uniun-ray up` declares one). The embedder takes a second GPU where
there is one, otherwise `uniun_embedder`. Both use `num_cpus=0` so they never queue behind
CPU tasks; torch's thread count is set deliberately inside (see model_actor).
"""
from __future__ import annotations

import ray

from .embedding_actor import EmbeddingActor
from .metrics import SchedulerMetrics
from .model_actor import ModelActor
from .protocol import NAMESPACE
from .service import RuntimeConfig, SchedulerService

DEVICE_RESOURCE = "uniun_device"
EMBEDDER_RESOURCE = "uniun_embedder"


class RayDevice:
    """The ModelActor seen through its handle, as the scheduler's `Device`. Looked up by
    name on every call, so a restarted ModelActor is found again."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _handle(self):
        return ray.get_actor(self._name, namespace=NAMESPACE)

    async def load(self, model_id: str) -> float:
        return await self._handle().load.remote(model_id)

    async def grant(self, epoch: int) -> None:
        await self._handle().grant.remote(epoch)

    async def revoke(self, epoch: int) -> None:
        await self._handle().revoke.remote(epoch)


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

    async def ping(self) -> str:
        return "ok"


def cuda_devices() -> int:
    """GPUs Ray sees in the cluster (0 on this project's CPU machines)."""
    return int(ray.cluster_resources().get("GPU", 0))


def model_actor_options(name: str) -> dict:
    place = {"num_gpus": 1} if cuda_devices() >= 1 else {"resources": {DEVICE_RESOURCE: 1}}
    return dict(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=3, max_task_retries=0, **place)


def embedder_options(name: str) -> dict:
    place = {"num_gpus": 1} if cuda_devices() >= 2 else {"resources": {EMBEDDER_RESOURCE: 1}}
    return dict(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=3, max_task_retries=3, max_concurrency=2, **place)


def scheduler_options(name: str) -> dict:
    return dict(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=-1, max_task_retries=0)


RemoteScheduler = ray.remote(SchedulerActor)
RemoteModel = ray.remote(ModelActor)
RemoteEmbedder = ray.remote(EmbeddingActor)
