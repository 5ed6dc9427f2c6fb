"""An OpenAI-compatible HTTP endpoint on Ray Serve (SPEC §4).

    serve run uniun_ray.http:app        # or: uniun-ray up (deploys it on 127.0.0.1:8000)

`app` is the Serve application (built on first access, with $UNIUN_API_KEY);
`create_app` the plain FastAPI app; `deploy` what `uniun-ray up` calls.
"""
from __future__ import annotations

from importlib import import_module

__all__ = ["app", "build", "create_app", "deploy", "undeploy", "APP_NAME"]


def __getattr__(name: str):
    if name == "app":
        return import_module(".deployment", __name__).build()
    if name in ("build", "deploy", "undeploy", "APP_NAME", "DEFAULT_HOST", "DEFAULT_PORT"):
        return getattr(import_module(".deployment", __name__), name)
    if name == "create_app":
        return import_module(".app", __name__).create_app
    raise AttributeError(f"module 'uniun_ray.http' has no attribute {name!r}")
