"""The transformers engine (SPEC §7's default; the card's engine; the embedded models).

A thin adapter of the seam over `models.Engine` (weights, dtype and thread probe, prefix cache)
and `models.decode.loop.DecodeLoop` (every slot in one batched forward per step, §6). A job's handle is
the batch's own `Job`, read as it fills; `cancel` sets the job's flag, which the batch reads
before every step and the layer gate before every decoder layer of a prefill chunk. Nothing is
copied or re-queued in between, so the embedded models run exactly as fast as without the seam.
"""
from __future__ import annotations

import threading
from typing import Hashable

from . import Wake
from ..models.decode.batch import Job
from ..models.decode.engine import Engine
from ..models.decode.loop import DecodeLoop
from ..models.registry import resolve
from ..models.requests.request import GenerateRequest, GenerationResult
from ..settings import MAX_SLOTS, EngineSettings
from ..models.swap import Swap
from ..models.requests.vocabulary import inspect_request


class TransformersRun:
    """A `JobRun` over the batch's `Job`: its pieces and result, its loop's failure."""

    def __init__(self, job: Job, loop: DecodeLoop) -> None:
        self._job, self._loop = job, loop
        self.done = job.done

    @property
    def result(self) -> GenerationResult | None:
        return self._job.result

    @property
    def failure(self) -> BaseException | None:
        result = self._job.result
        return self._loop.failure if result is not None and result.finish_reason == "error" else None

    def drain(self) -> tuple[str, int]:
        return "".join(self._job.drain()), self._job.sequence.emitted_tokens


class TransformersEngine:
    """The `Engine` protocol over the project's own decode loop. The batch holds up to
    MAX_SLOTS rows; the policy fills as many as the device's slots."""

    name = "transformers"

    def __init__(self, wake: Wake, device: str = "cpu", settings: EngineSettings | None = None,
                 thread_budget: int | None = None, shares: int = 1) -> None:
        self.model = Engine(device, settings, thread_budget=thread_budget, shares=shares)
        self._loop = DecodeLoop(self.model, MAX_SLOTS, wake)
        self._flags: dict[Hashable, tuple[threading.Event, Job]] = {}
        self._lock = threading.Lock()

    @property
    def loaded(self) -> str | None:
        return self.model.loaded

    @property
    def capacity(self) -> int:
        return self._loop.capacity

    def load(self, model_id: str, abandon: threading.Event | None = None) -> Swap:
        return self.model.load(model_id, abandon)

    def unload(self) -> float:
        return self.model.unload()

    def check(self, model_id: str, request: GenerateRequest) -> int:
        return inspect_request(resolve(model_id), request)

    def start(self, job_id: Hashable, request: GenerateRequest, revocable: bool = True) -> TransformersRun:
        """Blocking (it tokenizes): call it off an event loop."""
        flag = threading.Event()
        job = self._loop.add(request, flag, revocable)
        with self._lock:
            self._flags = {key: kept for key, kept in self._flags.items() if not kept[1].done.is_set()}
            self._flags[job_id] = (flag, job)
        return TransformersRun(job, self._loop)

    def cancel(self, job_id: Hashable) -> None:
        kept = self._flags.get(job_id)
        if kept is not None:
            kept[0].set()

    def step_profile(self) -> dict[int, float]:
        return self.model.step_profile()

    def status(self) -> dict:
        return self.model.describe() | {
            "engine": self.name, "model": self.model.loaded, "running": self._loop.rows,
            "context_length": self.model.context_length, "warm": self.model.warm,
            "steps_by_batch": dict(sorted(self._loop.batch_sizes.items())),
            "step_s_by_batch": {rows: round(s, 6) for rows, s in sorted(self._loop.step_seconds.items())},
            "step_cpu_s_by_batch": {rows: round(s, 6) for rows, s in sorted(self._loop.step_cpu_seconds.items())}} \
            | self._loop.describe()
