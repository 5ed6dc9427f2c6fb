"""Joining or starting Ray, and getting or creating the three actors.

Everything is idempotent: actors are named and created with `get_if_exists`, so any
number of scripts, producers and CLI calls can `start()` at once and share one scheduler.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import ray

from .actors import (DEVICE_RESOURCE, EMBEDDER_RESOURCE, RemoteEmbedder, RemoteModel, RemoteScheduler,
                     cuda_devices, embedder_options, model_actor_options, scheduler_options)
from .protocol import EMBEDDER_NAME, NAMESPACE, SCHEDULER_NAME, UniunError, model_actor_name
from .service import RuntimeConfig

#: Resources a local cluster declares for the stand-in devices of a CPU-only machine.
LOCAL_RESOURCES = {DEVICE_RESOURCE: 1, EMBEDDER_RESOURCE: 1}


def ensure_auth_mode() -> str:
    """Ray's auth mode is always explicit: unset, a local ray.init() writes
    ~/.ray/auth_token and later clusters fail with misleading errors. Default: disabled,
    which is right for a workstation bound to 127.0.0.1 (see the README for token mode)."""
    return os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def connect(address: str | None = None, namespace: str = NAMESPACE, **init_kwargs) -> None:
    """Join a running Ray (address, or the local one), or start a local one with the
    stand-in device resources. No-op when already connected."""
    if ray.is_initialized():
        return
    ensure_auth_mode()
    init_kwargs.setdefault("log_to_driver", False)
    if address is not None:
        ray.init(address=address, namespace=namespace, **init_kwargs)
        return
    try:
        ray.init(address="auto", namespace=namespace, **init_kwargs)
    except ConnectionError:
        ray.init(address="local", namespace=namespace, resources=LOCAL_RESOURCES,
                 include_dashboard=False, **init_kwargs)


@dataclass(frozen=True)
class Handles:
    scheduler: object
    model: object
    embedder: object


def device_name() -> str:
    return "gpu0" if cuda_devices() >= 1 else "cpu0"


def start(config: RuntimeConfig | None = None) -> Handles:
    """Get or create the scheduler, the model actor and the embedder. `config` only
    applies when the scheduler is created here (a running one keeps its own)."""
    connect()
    gpu = cuda_devices() >= 1
    if not gpu and ray.cluster_resources().get(DEVICE_RESOURCE, 0) < 1:
        raise UniunError(
            f"this Ray cluster has no GPU and no {DEVICE_RESOURCE!r} resource, so the model actor "
            f"cannot be placed. Start Ray with `uniun-ray up`, or `ray start --head "
            f"--resources='{{\"{DEVICE_RESOURCE}\": 1, \"{EMBEDDER_RESOURCE}\": 1}}'`.")
    model_name = model_actor_name(device_name())
    model = RemoteModel.options(**model_actor_options(model_name)).remote(device="cuda" if gpu else "cpu")
    embedder = RemoteEmbedder.options(**embedder_options(EMBEDDER_NAME)).remote(
        device="cuda:1" if cuda_devices() >= 2 else "cpu")
    scheduler = RemoteScheduler.options(**scheduler_options(SCHEDULER_NAME)).remote(model_name, config)
    ray.get(scheduler.ping.remote())
    return Handles(scheduler, model, embedder)


def handles() -> Handles:
    """The running actors, created on first use."""
    connect()
    try:
        get = lambda name: ray.get_actor(name, namespace=NAMESPACE)  # noqa: E731
        return Handles(get(SCHEDULER_NAME), get(model_actor_name(device_name())), get(EMBEDDER_NAME))
    except ValueError:
        return start()
