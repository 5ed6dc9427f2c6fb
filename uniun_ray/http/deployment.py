"""The OpenAI-compatible app (SPEC §4) as a Ray Serve application.

Deployed by `uniun-ray up` (see `deploy`), or by Serve's own CLI on a running cluster:

    serve run uniun_ray.http:app                 # 127.0.0.1:8000, the key from $UNIUN_API_KEY

(`serve start --http-host H --http-port P` first to bind elsewhere.) One replica is plenty:
it only awaits the scheduler, and the device, not the replica, is what is scarce. It
takes no CPU slot (`num_cpus=0`) so it never waits behind CPU tasks for placement, and
admits up to MAX_ONGOING requests at once so that every request reaches the scheduler,
which decides the order (Serve's default of 5 would queue the rest in front of the policy).
"""
from __future__ import annotations

import ray
from ray import serve
from ray.serve import Application

from ..settings import read
from ..runtime.launch import never_start
from .app import create_app

APP_NAME = "uniun-http"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: Requests one replica holds at once; beyond it Serve queues them at the proxy.
MAX_ONGOING = 4096
#: How long Serve's controller waits for its proxy to say it is ready, and how many times a
#: start that met a killed proxy is made (`_start_serve`).
PROXY_READY_S, PROXY_STARTS = 30, 3


@serve.deployment(name="openai", num_replicas=1, max_ongoing_requests=MAX_ONGOING,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIServer:
    """A Serve replica holding the FastAPI app; every request is a client-API call."""

    def __init__(self, api_key: str | None = None) -> None:
        never_start()   # a request that finds no runtime is answered 503, never starts one
        self._api_key = api_key or None

    def __serve_build_asgi_app__(self):
        return create_app(self._api_key)


def build(api_key: str | None = None) -> Application:
    """The application; `api_key` defaults to $UNIUN_API_KEY of the process that builds it
    (the key travels inside the deployment's arguments, never on a command line)."""
    if api_key is None:
        api_key = read("api_key")
    return OpenAIServer.bind(api_key)


def deploy(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None) -> str:
    """Start Serve's proxy on host:port (head node only) and run the app at "/"; returns the
    base URL. Ray must be connected. Serve keeps running after this process exits.
    OSError when the port is taken (Serve's proxy would retry binding it for ever)."""
    _check_free(host, port)
    _start_serve(host, port)
    serve.run(build(api_key), name=APP_NAME, route_prefix="/", blocking=False)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _start_serve(host: str, port: int) -> None:
    """Serve's controller and its proxy. The controller gives a starting proxy 5 s to say it is
    ready, then kills it and starts another: on a 2-core host where several jobs start at once
    the proxy took longer, and `serve.start` raised the kill. The controller is given
    PROXY_READY_S instead, and a start that still meets a killed proxy is tried again (the
    controller, running by then, starts the proxy anew)."""
    options = {"runtime_env": {"env_vars": {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(PROXY_READY_S)}}}
    for attempt in range(1, PROXY_STARTS + 1):
        try:
            serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port},
                        controller_options=options)
            return
        except ray.exceptions.RayActorError:
            if attempt == PROXY_STARTS:
                raise


def _check_free(host: str, port: int) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot serve HTTP on {host}:{port}: {error.strerror or error} "
                          f"(pass another --http-port, or --no-http)") from None


def undeploy() -> None:
    """Remove the app (Serve itself stays up for other applications)."""
    serve.delete(APP_NAME)
