"""Where the ModelActor and the EmbeddingActor go, decided from what the cluster declares.

A plain `ray start --head` must work as it is (SPEC §3), so placement never asks for a resource
the cluster does not have:

| cluster declares                      | ModelActor                 | EmbeddingActor                 |
|---------------------------------------|----------------------------|--------------------------------|
| no GPU (a plain `ray start --head`)   | CPU                        | CPU                            |
| `uniun_device` / `uniun_embedder`     | pinned by those resources  | pinned by those resources      |
| one GPU                               | the GPU                    | CPU (its resource if declared) |
| two or more GPUs                      | a GPU                      | a GPU of its own               |

A resource the cluster has but that is all taken (another job holds the GPU) is refused at once
with its name and the command that adds one, instead of an actor that waits for ever.

`UNIUN_TORCH_DEVICE=cpu` keeps torch on the CPU inside actors Ray gave a GPU: GPUs declared
Ray-side (`ray start --num-gpus=1` on a CPU machine) exercise every GPU placement path in CI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from .protocol import UniunError

DEVICE_RESOURCE = "uniun_device"
EMBEDDER_RESOURCE = "uniun_embedder"
TORCH_DEVICE_ENV = "UNIUN_TORCH_DEVICE"
EMBED_CONCURRENCY_ENV = "UNIUN_EMBED_CONCURRENCY"
#: The notes' Semaphore(2): two embeds at once keep the pipeline busy without flooding the device.
DEFAULT_EMBED_CONCURRENCY = 2


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


def torch_device(environ: Mapping[str, str] = os.environ) -> str | None:
    """The forced torch device ("cpu" or "cuda"), or None to follow the placement."""
    forced = environ.get(TORCH_DEVICE_ENV, "").strip()
    if forced and forced not in ("cpu", "cuda"):
        raise ValueError(f"{TORCH_DEVICE_ENV}={forced!r}: use 'cpu' or 'cuda' (or leave it unset)")
    return forced or None


def embed_concurrency(environ: Mapping[str, str] = os.environ) -> int:
    raw = environ.get(EMBED_CONCURRENCY_ENV, "").strip()
    if not raw:
        return DEFAULT_EMBED_CONCURRENCY
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{EMBED_CONCURRENCY_ENV}={raw!r} is not a concurrency; use an integer >= 1")
    return int(raw)


def model_seat(resources: Mapping[str, float], forced: str | None = None) -> Seat:
    if resources.get("GPU", 0) >= 1:
        return Seat({"num_gpus": 1}, forced or "cuda")
    if resources.get(DEVICE_RESOURCE, 0) >= 1:
        return Seat({"resources": {DEVICE_RESOURCE: 1}}, "cpu")
    return Seat({}, "cpu")


def embedder_seat(resources: Mapping[str, float], forced: str | None = None) -> Seat:
    """Ray shows an actor only the GPU it was given, as cuda:0."""
    if resources.get("GPU", 0) >= 2:
        return Seat({"num_gpus": 1}, forced or "cuda")
    if resources.get(EMBEDDER_RESOURCE, 0) >= 1:
        return Seat({"resources": {EMBEDDER_RESOURCE: 1}}, "cpu")
    return Seat({}, "cpu")


def device_name(resources: Mapping[str, float]) -> str:
    return "gpu0" if resources.get("GPU", 0) >= 1 else "cpu0"


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
