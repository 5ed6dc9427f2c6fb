"""Joining or starting Ray, and getting or creating the actors: the scheduler, one
ModelActor per device of the pool, the embedder.

Everything is idempotent: actors are named and created with `get_if_exists`, so any
number of scripts, producers and CLI calls can `start()` at once and share one scheduler.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import ray

from . import placement
from .. import engines
from .actors import ModelFleet, RemoteEmbedder, RemoteScheduler, embedder_options, scheduler_options
from .head import stand_in_resources, worker_niceness
from .protocol import EMBEDDER_NAME, NAMESPACE, SCHEDULER_NAME, UniunError, model_actor_name
from .releases import RELEASES
from .service import RuntimeConfig
from ..models.registry import configure, known_ids, resolve
from ..settings import Settings

#: Resources a local cluster declares for one stand-in device of a CPU-only machine.
LOCAL_RESOURCES = stand_in_resources(0)
#: What `ray.init` says when the raylet did not register with the GCS within the 30 s Ray
#: allows (hard-coded in ray/_private/node.py): on a host busy enough, a new Ray's start can
#: take longer, and a second start usually succeeds. How many starts a local Ray gets.
STARTUP_TIMEOUT = "timed out during startup"
STARTS = 3

log = logging.getLogger(__name__)


def ensure_auth_mode() -> str:
    """Ray's auth mode is always explicit: unset, a local ray.init() writes
    ~/.ray/auth_token and later clusters fail with misleading errors. Default: disabled,
    which is right for a workstation bound to 127.0.0.1 (see the README for token mode)."""
    return os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _ray_start_address() -> str | None:
    """The address the last `ray start` on this machine recorded (Ray's own lookup; unlike
    address="auto" it never picks an arbitrary running cluster, such as a test session's)."""
    try:
        from ray._private.services import find_bootstrap_address
        return find_bootstrap_address(None)
    except Exception:  # a Ray internal that moved: treat as "none recorded"
        return None


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """A GCS that does not answer would make ray.init retry for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return True  # not host:port; let Ray judge it
    try:
        socket.create_connection((host, int(port)), timeout_s).close()
        return True
    except OSError:
        return False


def find_cluster(address: str | None = None) -> str | None:
    """Which running cluster to join: `address`, else RAY_ADDRESS, else the head that
    `uniun-ray up` started (its auth mode too), else the last `ray start`; None if none
    answers. Never Ray's address="auto", which may pick anyone's cluster."""
    from .head import HeadState

    state = HeadState.load()
    running = state if state and state.alive() else None
    if running is not None:
        os.environ.setdefault("RAY_AUTH_MODE", running.auth_mode)
    found = address or os.environ.get("RAY_ADDRESS") or (running.address if running else None) \
        or _ray_start_address()
    return found if found and reachable(found) else None


def connect(address: str | None = None, namespace: str = NAMESPACE, **init_kwargs) -> None:
    """Join a running Ray (see `find_cluster`), or start a private local one with the
    stand-in device resources. No-op when already connected."""
    if ray.is_initialized():
        return
    found = find_cluster(address)
    ensure_auth_mode()
    init_kwargs.setdefault("log_to_driver", False)
    if found is not None:
        ray.init(address=found, namespace=namespace, **init_kwargs)
    elif address is not None:
        raise UniunError(f"no Ray cluster answers at {address}")
    else:
        init_local(namespace, **init_kwargs)


def init_local(namespace: str = NAMESPACE, *, dashboard: bool = False, devices: int = 1, **init_kwargs):
    """Start a private local Ray with the stand-in resources of `devices` devices: never a
    running cluster (address="local"), no dashboard unless asked (then on 127.0.0.1), the
    driver not flooded with workers' logs, the workers at `worker_niceness()`. The one place a
    local cluster is made: `connect`, the demo, the replay, the benchmarks and the tests all
    come here. Returns Ray's context."""
    ensure_auth_mode()
    worker_niceness()
    init_kwargs.setdefault("log_to_driver", False)
    if dashboard:
        init_kwargs.setdefault("dashboard_host", "127.0.0.1")
    for attempt in range(1, STARTS + 1):
        try:
            return ray.init(address="local", namespace=namespace, resources=stand_in_resources(0, devices),
                            include_dashboard=dashboard, **init_kwargs)
        except Exception as error:   # Ray raises a bare Exception when its raylet registers late
            if STARTUP_TIMEOUT not in str(error) or attempt == STARTS:
                raise
            log.warning("Ray's node did not register in time (a busy host?); starting it again (%d/%d)",
                        attempt + 1, STARTS)
            ray.shutdown()


@contextmanager
def local_cluster(namespace: str = NAMESPACE, **options):
    """`init_local` for the length of a block, then `ray.shutdown()` of that Ray only."""
    context = init_local(namespace, **options)
    try:
        yield context
    finally:
        RELEASES.flush()   # the scheduler logs the finishes of this process's last jobs before it goes
        forget_handles()
        ray.shutdown()


@dataclass(frozen=True)
class Handles:
    scheduler: object
    model: object       # a ModelActor of the pool, requests are checked there (`checking_model`)
    embedder: object
    chat_model: str     # the scheduler's setting, asked once per session
    models: dict = field(default_factory=dict, compare=False)   # device -> its ModelActor, as met

    def model_of(self, device: str):
        """The ModelActor of `device` (a lease's `device`), looked up by name once."""
        handle = self.models.get(device)
        if handle is None:
            handle = self.models[device] = ray.get_actor(model_actor_name(device), namespace=NAMESPACE)
        return handle


def config_from(settings: Settings | None = None, models: Mapping[str, str] | None = None,
                hub_models: bool = False) -> RuntimeConfig:
    """The configuration a new scheduler gets unless told otherwise: the chat model and the
    slot count per device of `settings` (None: the environment's), the models it serves beside
    the embedded ones (the settings', then `models`, id -> folder; `hub_models`: cached Hugging
    Face repo ids too), each checked here, before any actor exists."""
    settings = settings or Settings.load()
    config = RuntimeConfig(chat_model=settings.chat_model, slots=settings.slots,
                           models={**settings.models, **(models or {})}, hub_models=hub_models)
    return served_by_id(config)


def served_by_id(config: RuntimeConfig) -> RuntimeConfig:
    """`config` with its models checked (UnknownModel names the choices) and a chat model given
    as a folder served under the folder's name, so that what HTTP shows (/v1/models, an
    answer's `model`) is an id, never a path."""
    configure(config.models)
    chat = config.chat_model
    folder = _folder(chat) if chat not in known_ids() and chat not in config.models else None
    if folder is not None:
        name = folder.name
        if name in known_ids() or name in config.models:
            raise ValueError(f"the chat model's folder {chat!r} would be served as {name!r}, which is taken: "
                             f"name it yourself (--model ID={chat} --chat-model ID)")
        config = replace(config, chat_model=name, models={**config.models, name: str(folder)})
        configure(config.models)
    for model_id in (*config.models, config.chat_model):
        resolve(model_id)
    return config


def _folder(model_id: str) -> Path | None:
    try:
        folder = Path(model_id).expanduser()
    except RuntimeError:   # "~someone" without a home here
        return None
    return folder.resolve() if folder.is_dir() else None


def checking_model():
    """A ModelActor to check requests with (`Handles.model`): the pool's first device's
    (`cpu0` or `gpu0`), else any other of the pool that exists, since the first one's node
    may have left the cluster. ValueError when there is none."""
    first = model_actor_name(placement.device_name(ray.cluster_resources()))
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == NAMESPACE and a["name"].startswith(model_actor_name("")))
    if not names:
        raise ValueError("no model actor in the cluster")
    return ray.get_actor(first if first in names else names[0], namespace=NAMESPACE)


def start(config: RuntimeConfig | None = None, *, models: Mapping[str, str] | None = None,
          hub_models: bool | None = None, wait_ready: bool = True, settings: Settings | None = None) -> Handles:
    """Get or create the scheduler, a model actor per device the cluster declares, and the
    embedder. `config` only applies when the scheduler is created here (a running one keeps
    its own, and its pool), but for its models: `models` (id -> folder of weights) and
    `config.models` are added to what a running scheduler serves, and reach every device, as
    `uniun-ray up --model ID=PATH` does (what was added, and a chat model not taken, is logged);
    `hub_models` is what `--hub-models` sets. Placement follows what the cluster
    declares (`placement`); an actor whose seat is taken is refused at once, naming the
    resource, rather than left waiting for ever. The scheduler then loads the active chat
    model on its device (the warm start, `warmstart`; `UNIUN_WARM_START=0` skips it), and
    `start` returns once it has, unless not `wait_ready` (`uniun-ray up` serves /health
    meanwhile: 503 "loading"). `settings`: what `uniun-ray up` read with its flags; None: the
    environment's, read here, so that a bad one fails clearly before any actor exists."""
    settings = settings or Settings.load()
    engines.check(settings.engine_settings)   # an engine this host cannot run (EngineUnavailable)
    config = config or config_from(settings)
    config = served_by_id(replace(config, models={**config.models, **(models or {})},
                                  hub_models=config.hub_models if hub_models is None else hub_models))
    settings = settings.given(chat_model=config.chat_model, slots=config.slots, models=dict(config.models))
    config = replace(config, settings=tuple(settings.describe()))
    forced = settings.torch_device
    connect()
    resources = ray.cluster_resources()
    embedder_seat = placement.embedder_seat(resources, forced, settings.embedder_device == "cpu")
    fleet = ModelFleet(settings.engine_settings, forced, int(embedder_seat.needs.get("GPU", 0)),
                       tuple(config.models.items()))
    devices = placement.device_names(resources, fleet.embedder_gpus)
    _check_seats([(model_actor_name(d), fleet.seat(resources)) for d in devices] + [(EMBEDDER_NAME, embedder_seat)])
    models = {d: fleet.create(d, resources) for d in devices}
    embedder = RemoteEmbedder.options(**embedder_options(EMBEDDER_NAME, embedder_seat, settings.embed_concurrency)).remote(
        device=embedder_seat.torch_device, hub_kernels=settings.hub_kernels)
    scheduler = RemoteScheduler.options(**scheduler_options(SCHEDULER_NAME)).remote(devices, fleet, config)
    _served(ray.get(scheduler.serve.remote(dict(config.models))), config)
    if settings.warm_start:
        started = scheduler.ready.remote(wait_ready)
        if wait_ready:
            ray.get(started)
    return _remember(Handles(scheduler, models[devices[0]], embedder, ray.get(scheduler.chat_model.remote()),
                             models))


def _served(answer: dict, config: RuntimeConfig) -> None:
    """Say what a running scheduler kept of `config`: the models it serves now, the ones this
    call added, and a chat model it did not take (it keeps its own)."""
    if answer["added"]:
        log.info("uniun-ray: now serving %s (added %s)", ", ".join(answer["added"] + answer["kept"]),
                 ", ".join(answer["added"]))
    if answer["chat_model"] != config.chat_model:
        log.warning("uniun-ray: the running scheduler keeps its chat model %r, not %r (uniun-ray down, then "
                    "start, to change it)", answer["chat_model"], config.chat_model)


def _check_seats(seats: list[tuple[str, "placement.Seat"]], grace_s: float = 3.0) -> None:
    """Actors that do not exist yet must find their seat free: the model and the embedder
    together, when they ask for the same resource (two GPUs, one of them taken). A seat freed a
    moment ago (an actor just killed) shows as free within a second or two: wait that long."""
    missing = []
    for name, seat in seats:
        try:
            ray.get_actor(name, namespace=NAMESPACE)   # it exists: get_if_exists takes it as it is
        except ValueError:
            missing.append((name, seat))
    deadline = time.monotonic() + grace_s
    while True:
        available = dict(ray.available_resources())
        try:
            for name, seat in missing:
                placement.check_free(name, seat, available)
                for resource, amount in seat.needs.items():
                    available[resource] = available.get(resource, 0) - amount
            return
        except UniunError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


#: The handles this process last found or made, and the Ray session they belong to. A named
#: lookup is a GCS round trip; every client call used to make three.
_cached: tuple[object, Handles] | None = None


def _session_key():
    """What tells one Ray session from the next in this process (a shutdown and a new init):
    its session name and the driver's core worker. Attribute reads only (well under 1 us)."""
    worker = ray._private.worker.global_worker
    core = getattr(worker, "core_worker", None)
    node = getattr(worker, "node", None)
    return None if core is None or node is None else (id(core), node.session_name)


def _remember(h: Handles) -> Handles:
    global _cached
    _cached = (_session_key(), h)
    return h


def forget_handles() -> None:
    """Drop the cached handles: the next `handles()` looks the actors up by name again. The
    client calls it when an actor died for good (killed, then created again under its name)."""
    global _cached
    _cached = None


def handles() -> Handles:
    """The running actors, created on first use; cached per Ray session (a detached actor's
    handle stays valid across its restarts)."""
    cached = _cached
    if cached is not None and cached[0] is not None and cached[0] == _session_key():
        return cached[1]
    connect()
    try:
        get = lambda name: ray.get_actor(name, namespace=NAMESPACE)  # noqa: E731
        scheduler = get(SCHEDULER_NAME)
        return _remember(Handles(scheduler, checking_model(), get(EMBEDDER_NAME),
                                 ray.get(scheduler.chat_model.remote())))
    except ValueError:
        return start()
