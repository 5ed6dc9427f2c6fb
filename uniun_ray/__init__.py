"""uniun-ray: schedule LLM work from many producers onto one accelerator (SPEC.md).

The client API is imported lazily, so `uniun_ray.policy` (pure Python) can be used
without importing Ray or torch.
"""
from importlib import import_module

_CLIENT = {"generate", "stream", "run", "embed", "set_foreground", "status", "agenerate", "astream",
           "arun", "aembed", "aset_foreground", "astatus", "aprepare", "Completion", "LeaseHandle", "wait_generating",
           "await_generating"}
_LAUNCH = {"connect", "start", "local_cluster"}
_PROTOCOL = {"Preempted", "JobDropped", "LeaseRevoked", "QueueFull", "UniunError", "SchedulerUnavailable", "DeviceLost",
             "ModelUnavailable", "UnknownJob"}

__all__ = sorted(_CLIENT | _LAUNCH | _PROTOCOL | {"Kind", "EngineUnavailable"})


def __getattr__(name: str):
    if name in _CLIENT:
        return getattr(import_module(".client", __name__), name)
    if name in _LAUNCH:
        return getattr(import_module(".runtime.launch", __name__), name)
    if name in _PROTOCOL:
        return getattr(import_module(".runtime.protocol", __name__), name)
    if name == "Kind":
        return import_module(".policy", __name__).Kind
    if name == "EngineUnavailable":
        return import_module(".engines", __name__).EngineUnavailable
    raise AttributeError(f"module 'uniun_ray' has no attribute {name!r}")
