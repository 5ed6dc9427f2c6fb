"""Where the ModelActors and the EmbeddingActor go, decided from what the cluster declares.

A plain `ray start --head` must work as it is (SPEC §3), so placement never asks for a resource
the cluster does not have:

| cluster declares                      | ModelActors (the pool, §5)       | EmbeddingActor                 |
|---------------------------------------|----------------------------------|--------------------------------|
| no GPU (a plain `ray start --head`)   | one, `cpu0`, on the CPU          | CPU                            |
| `uniun_device: N` / `uniun_embedder`  | N, `cpu0`..: one `uniun_device` each | pinned by `uniun_embedder` |
| one GPU                               | one, `gpu0`                      | CPU (its resource if declared) |
| G >= 2 GPUs                           | G - 1, `gpu0`..: a GPU each      | a GPU of its own               |

The pool follows the cluster: `reconcile` says which devices to add as capacity is declared
(a node joins) and which to remove when their actor is gone for good; the scheduler applies it
every few seconds. Device names count GPUs (or stand-ins) cluster-wide, not per node.

A resource the cluster has but that is all taken (another job holds the GPU) is refused at once
with its name and the command that adds one, instead of an actor that waits for ever.

`UNIUN_EMBEDDER_DEVICE=cpu` keeps the embedder on the CPU with two or more GPUs, so that every
GPU serves models (SPEC §5). `UNIUN_TORCH_DEVICE=cpu` keeps torch on the CPU inside actors Ray gave a GPU: GPUs declared
Ray-side (`ray start --num-gpus=1` on a CPU machine) exercise every GPU placement path in CI.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from typing import Iterable, Mapping

from .protocol import UniunError

DEVICE_RESOURCE = "uniun_device"
EMBEDDER_RESOURCE = "uniun_embedder"


@dataclass(frozen=True)
class Seat:
    """One actor's place: the Ray options that pin it, and the torch device inside it."""

    options: dict = field(hash=False)
    torch_device: str

    @property
    def needs(self) -> dict[str, float]:
        needs = dict(self.options.get("resources", {}))
        if self.options.get("num_gpus"):
            needs["GPU"] = self.options["num_gpus"]
        return needs


def model_seat(resources: Mapping[str, float], forced: str | None = None) -> Seat:
    if resources.get("GPU", 0) >= 1:
        return Seat({"num_gpus": 1}, forced or "cuda")
    if resources.get(DEVICE_RESOURCE, 0) >= 1:
        return Seat({"resources": {DEVICE_RESOURCE: 1}}, "cpu")
    return Seat({}, "cpu")


def embedder_seat(resources: Mapping[str, float], forced: str | None = None, on_cpu: bool = False) -> Seat:
    """Ray shows an actor only the GPU it was given, as cuda:0. `on_cpu`: never a GPU."""
    if resources.get("GPU", 0) >= 2 and not on_cpu:
        return Seat({"num_gpus": 1}, forced or "cuda")
    if resources.get(EMBEDDER_RESOURCE, 0) >= 1:
        return Seat({"resources": {EMBEDDER_RESOURCE: 1}}, "cpu")
    return Seat({}, "cpu")


def device_name(resources: Mapping[str, float]) -> str:
    """The first device's name: the one every pool on this cluster starts with."""
    return "gpu0" if resources.get("GPU", 0) >= 1 else "cpu0"


def device_capacity(resources: Mapping[str, float], embedder_gpus: int = 0) -> tuple[str, int]:
    """The devices the cluster declares for models: their kind ("gpu" or "cpu", the prefix of
    their names) and how many. `embedder_gpus`: the GPUs the embedder took (not devices).
    A cluster without GPUs or stand-ins runs one device on the CPU."""
    gpus = int(resources.get("GPU", 0))
    if gpus >= 1:
        return "gpu", max(gpus - embedder_gpus, 0)
    return "cpu", max(int(resources.get(DEVICE_RESOURCE, 0)), 1)


def device_names(resources: Mapping[str, float], embedder_gpus: int = 0) -> list[str]:
    """The pool a new scheduler starts with: `gpu0`, `gpu1`, ... or `cpu0`, `cpu1`, ..."""
    kind, n = device_capacity(resources, embedder_gpus)
    return [f"{kind}{i}" for i in range(n)]


@dataclass(frozen=True)
class PoolChange:
    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()


def reconcile(resources: Mapping[str, float], embedder_gpus: int, present: Iterable[str],
              gone: Iterable[str]) -> PoolChange:
    """The pool against the cluster: remove the devices whose actor is `gone` for good; add
    devices, under the lowest free names, until the live ones match the declared capacity (a
    node joined, or a gone device's seat is free again). A live device is never removed for
    capacity: which one a node took with it shows only as its actor dying."""
    present, gone = list(present), set(gone)
    kind, n = device_capacity(resources, embedder_gpus)
    alive = {d for d in present if d not in gone}
    missing = n - sum(1 for d in alive if d.startswith(kind))
    fresh = (f"{kind}{i}" for i in count() if f"{kind}{i}" not in alive)
    return PoolChange(tuple(next(fresh) for _ in range(max(missing, 0))),
                      tuple(d for d in present if d in gone))


def check_free(actor: str, seat: Seat, available: Mapping[str, float]) -> None:
    """Refuse to create `actor` where its seat is taken: Ray would queue it for ever."""
    for resource, amount in seat.needs.items():
        if available.get(resource, 0) < amount:
            add = "--num-gpus=1" if resource == "GPU" else f"--resources='{{\"{resource}\": 1}}'"
            raise UniunError(
                f"cannot place {actor}: it needs {amount:g} {resource!r}, and none of this cluster's "
                f"is free (in use by another actor or job). Free it, or add one to a node with "
                f"`ray start {add}` (on a CPU-only machine, `uniun-ray up` declares the stand-in "
                f"resources).")


def assigned_resources() -> dict:
    """What Ray gave the calling actor (a GPU, a stand-in resource, nothing), for its state;
    empty outside a Ray worker (an actor class driven directly, as its tests do)."""
    import ray

    try:
        return dict(ray.get_runtime_context().get_assigned_resources())
    except AssertionError:  # "only available when the process is a worker"
        return {}


def node_id() -> str | None:
    """The Ray node the calling actor runs on (hex), for the scheduler to know which devices a
    node takes with it when it dies; None outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def stand_ins_here() -> int:
    """How many stand-in devices the calling actor's node declares (`uniun_device`; at least 1,
    and 1 outside a Ray worker). Their model actors share that node's cores."""
    return max(1, int(_node_resources().get(DEVICE_RESOURCE, 1)))


def devices_here() -> int:
    """How many ModelActors the calling actor's node runs: one per GPU, else per stand-in device
    (at least 1; 1 outside a Ray worker). They share the node's host memory (the warm budget)."""
    resources = _node_resources()
    return max(1, int(resources.get("GPU") or resources.get(DEVICE_RESOURCE, 1)))


def _node_resources() -> dict:
    """The resources the calling actor's node declares; empty outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return {}
    node = ray.get_runtime_context().get_node_id()
    return next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node), {})
