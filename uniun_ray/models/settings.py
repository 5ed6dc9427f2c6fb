"""How a user forces the engine's host choices: ``UNIUN_DTYPE`` and ``UNIUN_THREADS``.

Parsed without torch, in the process that starts the ModelActor (so a bad value is refused with
a clear message before any actor exists) and handed to the actor as plain data: an environment
variable set in a driver does not reach an actor's worker process on its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

DTYPE_ENV = "UNIUN_DTYPE"
THREADS_ENV = "UNIUN_THREADS"

#: "auto" measures, per host and model, which precision runs fastest on a CPU (see ``tuning``);
#: on a GPU it means bfloat16, or float16 where bf16 is not supported.
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EngineSettings:
    """``dtype``: one of ``DTYPES``. ``threads``: torch's intra-op threads, or None for every
    core this process may run on (its CPU affinity), never Ray's OMP_NUM_THREADS=1 default."""

    dtype: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads must be an int >= 1 or None, got {self.threads!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "EngineSettings":
        dtype = environ.get(DTYPE_ENV, "").strip() or "auto"
        if dtype not in DTYPES:
            raise ValueError(f"{DTYPE_ENV}={dtype!r} is not a dtype; use one of {', '.join(DTYPES)}")
        raw = environ.get(THREADS_ENV, "").strip()
        if not raw:
            return cls(dtype)
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{THREADS_ENV}={raw!r} is not a thread count; use an integer >= 1")
        return cls(dtype, int(raw))

    def resolved_threads(self) -> int:
        """The thread count to give torch in this process."""
        return self.threads or len(os.sched_getaffinity(0)) or 1
