"""The device's decode loop: one thread stepping a ``Batch`` of the loaded model while any job is in it.

SPEC §6: every slot of a device decodes in one batched forward per step. Jobs are added from
any thread (the actor's, one per request); the first job starts the stepping thread, which
runs until the batch is empty and then ends, so an idle device holds no thread and no GIL.
After every step ``wake`` is called (the actor hands it to its event loop, which streams
what each job produced). A failure of the model ends every job of the batch with
``finish_reason`` "error"; the exception is kept in ``failure`` for their callers to raise.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable

import torch

from .batch import Batch, Job
from .engine import Engine
from ..tune.cores import CoreShare
from ..runner.gate import CancelFlag
from ..requests.request import GenerateRequest

log = logging.getLogger(__name__)


class DecodeLoop:
    def __init__(self, engine: Engine, slots: int, wake: Callable[[], None]) -> None:
        self._engine, self._slots, self._wake = engine, slots, wake
        self._batch: Batch | None = None
        self._cores: CoreShare | None = None
        self._lock = threading.Lock()
        self._stepping = False
        self.failure: BaseException | None = None
        self.batch_sizes: Counter = Counter()   # rows decoded together -> steps taken so
        #: rows decoded together -> the seconds those steps took (0: steps that only prefilled): with
        #: the time jobs held the device, what says where its time went (benchmarks/device_time.py)
        self.step_seconds: Counter = Counter()
        #: rows decoded together -> the stepping thread's own CPU seconds in those steps: at one
        #: thread, a step's seconds less these are its time off a core (the GIL, another program)
        self.step_cpu_seconds: Counter = Counter()

    @property
    def rows(self) -> int:
        batch = self._batch
        return batch.rows if batch is not None else 0

    def describe(self) -> dict:
        """The threads the loop runs with and why (``cores``)."""
        return self._cores.describe() if self._cores is not None else {}

    @property
    def capacity(self) -> int:
        """Rows the loaded model may decode together: 1 for a model that cannot be batched."""
        return self._current().slots

    def add(self, request: GenerateRequest, cancel: CancelFlag, revocable: bool = True) -> Job:
        """Queue a run (checked eagerly, as ``generation.generate`` checks it) and make sure the
        loop steps. Blocking (it tokenizes): call it off the actor's event loop."""
        batch = self._current()
        job = batch.add(request, cancel, revocable)
        with self._lock:
            if not self._stepping:
                self._stepping = True
                threading.Thread(target=self._run, args=(batch,), name="decode-loop", daemon=True).start()
        return job

    def _current(self) -> Batch:
        """The batch of the resident model (a new one after a load)."""
        with self._lock:
            if self._batch is None or self._batch.loaded is not self._engine.resident:
                self._batch = Batch(self._engine, self._slots, first_token=self._wake)
                # the probe of this load just set torch's threads: the most the loop may run
                self._cores = CoreShare(torch.get_num_threads(), self._engine.threads_fixed)
            return self._batch

    def _run(self, batch: Batch) -> None:
        self._cores.enter()
        try:
            while True:
                with self._lock:  # an `add` after this look starts a new thread
                    if not batch.busy:
                        self._stepping = False
                        return
                self._cores.before_step(streaming=batch.rows > 0)
                started, cpu = time.perf_counter(), time.thread_time()
                batch.step()
                self.step_seconds[batch.last_step_rows] += time.perf_counter() - started
                self.step_cpu_seconds[batch.last_step_rows] += time.thread_time() - cpu
                self._cores.after_step()
                if batch.last_step_rows:
                    self.batch_sizes[batch.last_step_rows] += 1
                self._wake()
        except BaseException as error:   # the batch ended every job with "error"
            log.exception("the decode loop failed; its jobs end with an error")
            self.failure = error
            with self._lock:
                self._stepping = False
            self._wake()
