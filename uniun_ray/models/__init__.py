"""Models: the registry of model ids, and the Ray-free engine the ModelActor wraps."""

from .engine import (
    Engine,
    GenerateRequest,
    Generation,
    GenerationResult,
    PromptTooLong,
    default_dtype,
    inspect_request,
)
from .registry import (
    DEFAULT_CHAT_MODEL,
    ModelSpec,
    Origin,
    UnknownModel,
    cache_dir,
    known_ids,
    materialize,
    resolve,
)

__all__ = [
    "DEFAULT_CHAT_MODEL",
    "Engine",
    "GenerateRequest",
    "Generation",
    "GenerationResult",
    "ModelSpec",
    "Origin",
    "PromptTooLong",
    "UnknownModel",
    "cache_dir",
    "default_dtype",
    "inspect_request",
    "known_ids",
    "materialize",
    "resolve",
]
