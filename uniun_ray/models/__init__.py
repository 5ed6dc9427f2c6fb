"""Models: the registry of model ids, and the Ray-free engine the ModelActor wraps.

Attributes load lazily: the registry, `GenerateRequest`, `GenerationResult` and the request
checks are light (no torch), the engine and its weights pull in torch, and a client that only
builds requests should not pay for that.
"""
from importlib import import_module

_WHERE = {
    "Engine": "decode.engine", "Generation": "decode.generation", "generate": "decode.generation", "Batch": "decode.batch", "Job": "decode.batch",
    "default_dtype": "load.weights",
    "PromptTooLong": "requests.vocabulary", "inspect_request": "requests.vocabulary",
    "GenerateRequest": "requests.request", "GenerationResult": "requests.request",
    "DEFAULT_CHAT_MODEL": "registry", "ModelSpec": "registry", "Origin": "registry",
    "UnknownModel": "registry", "cache_dir": "registry", "known_ids": "registry",
    "materialize": "registry", "resolve": "registry",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
