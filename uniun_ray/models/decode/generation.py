"""One run of the engine as an iterator of text pieces: a batch of one row, stepped by its consumer.

``generate`` hands this out for callers that run one request at a time (the demo, the
benchmarks, tests); it is a function of this room, not an engine method, so that the engine
below it knows nothing of batches or generations: the prefill chunks, the decode step and the KV kept at the end are the
batch's own, so a lone run decodes exactly as a row of ``Batch`` does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from .batch import Batch
from .sequence import Sequence
from ..requests.request import GenerationResult

if TYPE_CHECKING:
    from .engine import Engine
    from ..requests.request import GenerateRequest
    from ..runner.gate import CancelFlag


class Generation(Iterator[str]):
    """One run of the engine: an iterator of text pieces, with ``result`` set when it ends.

    Advance it from one thread at a time; which thread may change between pieces (the actor
    hands each ``next`` to a thread pool). ``close()``, or dropping it, ends the run early,
    recorded as a cancel. ``result`` stays None if the iterator was never advanced: the run
    starts (and counts as running, see ``Engine.load``) at the first ``next``.
    """

    def __init__(self, engine: Engine, sequence: Sequence, revocable: bool = True) -> None:
        self.result: GenerationResult | None = None
        #: Generated tokens whose text has been handed out so far: what a consumer that loses
        #: the run (and `result`) has of it.
        self.emitted_tokens = 0
        self._steps = self._run(engine, sequence, revocable)

    def __next__(self) -> str:
        return next(self._steps)

    def close(self) -> None:
        self._steps.close()

    def _run(self, engine: Engine, sequence: Sequence, revocable: bool) -> Iterator[str]:
        batch = Batch(engine, slots=1)
        job = batch.enqueue(sequence, revocable)
        try:
            busy = True
            while busy:
                busy = batch.step()
                for piece in job.drain():
                    self.emitted_tokens = sequence.emitted_tokens
                    yield piece
        finally:
            batch.close()     # the consumer closed the iterator: the run ends as a cancel
            self.result = job.result


def generate(engine: Engine, request: GenerateRequest, cancel: CancelFlag, revocable: bool = True) -> Generation:
    """Start a run on ``engine``: iterate the result for text pieces, then read its ``.result``.

    The request is checked here, eagerly (see ``Engine.check``); the model runs only as the
    iterator is advanced, in the thread that advances it. Setting ``cancel`` stops the run
    before its next forward pass: within one token while decoding, within one prefill chunk
    while reading the prompt. A run that is not ``revocable`` (nothing but its own cancel
    stops it: chat) reads its prompt in chunks of up to MAX_CHUNK tokens instead of chunks
    sized to one decode step.
    """
    return Generation(engine, engine.admit(request, cancel), revocable)
