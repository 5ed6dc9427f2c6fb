"""The jobs computing together on one device, advanced a step at a time (SPEC §6, continuous
batching), as the simulator models it.

Each step (one batched forward) gives every *decoding* job its next token and, when a job is
still prefilling, reads one prefill chunk of one such job: the one of the best tier at its
dispatch (a chat first), the earliest joined among equals; the others wait their turn. A chat
(T0: nothing but its cancel stops it) reads its whole prompt in one chunk, as the engine's
``Batch`` reads it in one pass while the others wait: its time to first token is the goal. A step
of b decoding jobs alone costs ``step_s(b)``; a chunk alone costs its prefill time
(``chunk x prefill_s_per_token``); a step that carries both is one forward pass, which reads
the weights once: the chunk's time plus what the b decoding rows add to a pass,
``step_s(b) - fixed_s`` (the step curve's intercept, the part of a step that does not grow
with the batch; with no batching gain it is 0 and the two simply add up). A job's last chunk
yields its first token, and it decodes from the next step on. With one job this is exactly the
one-job run of `device`: a prefill in chunks, then one decode step per token.

Jobs join and leave only at step boundaries. Between two changes of the batch every step is
the same, so the simulator does not visit each step: an `Epoch` is a run of identical steps,
`plan` finds how many come before the batch changes (a chunk shorter than the others, a job's
first token, a job's last token), and `advance` applies the steps up to a boundary. A device
with a batch of 16 is visited a few times per job, not once per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .device import ModelSpeed

#: Slack, in steps, when rounding a time to a step boundary (float noise).
_EPS = 1e-9


@dataclass
class Progress:
    """One job's progress in one run on a device."""

    prompt: int     # the job's prompt tokens
    context: int    # prompt + the tokens produced before this run: what the run must have read
    goal: int       # the job's output tokens
    to_read: int    # context tokens this run has still to prefill
    tokens: int     # tokens the job has produced so far, before this run and in it
    tier: int = 0   # its tier at dispatch: who prefills first

    @property
    def decoding(self) -> bool:
        return self.to_read == 0

    @property
    def done(self) -> bool:
        return self.tokens >= self.goal

    def kv_tokens(self) -> int:
        """Tokens whose KV exists: the context read so far, or, once decoding, the prompt and
        every produced token but the last (its KV is written by the step that reads it)."""
        return self.context - self.to_read if self.to_read else self.prompt + self.tokens - 1


@dataclass(frozen=True)
class Epoch:
    """`count` identical steps of `length` seconds from `start`: each gives `decoders` a token
    and, when `reader` is set, reads `chunk` of its context."""

    start: float
    length: float
    count: int
    decoders: tuple[Progress, ...]
    reader: Progress | None
    chunk: int

    @property
    def end(self) -> float:
        return self.start + self.count * self.length

    def boundary_after(self, t: float) -> float:
        """The first step boundary at or after `t` (the epoch's end at the latest)."""
        steps = math.ceil((t - self.start) / self.length - _EPS)
        return self.start + min(self.count, max(0, steps)) * self.length

    def advance(self, t: float) -> list[Progress]:
        """Apply the steps up to the boundary `t`; return the jobs whose prefill ended (each
        produced its first token of the run)."""
        steps = min(self.count, max(0, round((t - self.start) / self.length)))
        for job in self.decoders:
            job.tokens += steps
        if self.reader is None or steps == 0:
            return []
        self.reader.to_read -= steps * self.chunk
        if self.reader.to_read:
            return []
        self.reader.tokens += 1
        return [self.reader]


def plan(batch: list[Progress], start: float, speed: ModelSpeed, chunk: int) -> Epoch | None:
    """The steps from `start` until the batch (in joining order) next changes; None if empty."""
    if not batch:
        return None
    decoders = tuple(job for job in batch if job.decoding)
    reader = min((job for job in batch if not job.decoding), key=lambda job: job.tier, default=None)
    count, length, read = math.inf, 0.0, 0
    if decoders:
        count = min(job.goal - job.tokens for job in decoders)
        length = speed.step_s(len(decoders))
    if reader is not None:   # a chat reads its prompt in one pass, the others waiting (as the engine's Batch)
        read = reader.to_read if reader.tier == 0 else min(chunk, reader.to_read)
        count = min(count, max(1, reader.to_read // read))
        length += speed.prefill_s(read) - (speed.fixed_s if decoders else 0.0)
    return Epoch(start, length, count, decoders, reader, read)
