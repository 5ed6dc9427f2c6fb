"""One request's side of a decode loop: its tokens, its decoding, its text and how it ended.

Apart from the loop that drives it (``batch.Batch``, several in one forward pass per step; a
lone run is a one-row batch), so that the tokens it chooses, the stop strings it cuts, the KV it
keeps of a finished or revoked run and its report are one run's, whatever ran beside it.

Its text is made when it is read (``text``: by whoever streams it, or at the end), not in the
step that chose the tokens: detokenizing is a step's largest host work per row, and the step
need not wait for it. A run with stop strings is the exception: its text decides its end, so
each token's text is made in its step.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from .decoding import StopText, decoding
from .detokenizer import Detokenizer
from ..load.weights import Loaded
from ..kv.prefix import Hit, PrefixCache
from ..requests.request import GenerateRequest, GenerationResult


class Sequence:
    """The state of one run on ``loaded``. ``fed``: how many of its tokens the KV cache holds (while
    a batch decodes it, the batch keeps the count: ``decoded``); ``read``:
    how many of the first of them it holds as any prefill reads them (``kv.prefix``); ``reason``:
    why it ended ("error" until a loop says otherwise); ``pieces``: the text handed out."""

    def __init__(self, loaded: Loaded, context: list[int], request: GenerateRequest, cancel: Any) -> None:
        self.started = time.perf_counter()
        self.loaded = loaded
        self.context = context
        self.eos_ids = loaded.eos_ids
        self.decoding = decoding(loaded.model, loaded.vocabulary.tokenizer, request, len(context),
                                 loaded.eos_ids, cancel)
        self.detokenizer = Detokenizer(loaded.vocabulary.tokenizer, context)
        self.stop_text = StopText(request.stop)
        self.ids = list(context)      # the context, then the tokens chosen
        self.pieces: list[str] = []
        self._detokenized = len(context)      # ids made into text so far
        self._text_lock = threading.Lock()    # the stepping thread and a reader both make text
        self.hit, self.fed, self.read = Hit(None, 0), 0, 0
        self.prompt_logits: Any = None      # after the context, once read: kept with its KV (``keep``)
        self.first_token_at = self.prefilled_at = None
        self.reason = "error"       # what an exception from the model leaves
        self.ended = False
        self.steps = self.step_rows = 0   # decode steps taken, and the rows of all of them

    @property
    def cancelled(self) -> bool:
        return self.decoding.cancel.is_set()

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def emitted_tokens(self) -> int:
        """Generated tokens whose text has been handed out."""
        return len(self.detokenizer.committed)

    def start_from(self, hit: Hit) -> None:
        """Start from the prefix cache's ``hit`` (its KV is the caller's to extend)."""
        self.hit, self.fed, self.read = hit, hit.tokens, hit.read

    def prefilled(self, start: int) -> None:
        """A prefill pass read the tokens from ``start`` to ``fed``: several in one pass, they are read as
        any prefill reads them; one alone (the last prompt token) rounds otherwise."""
        if self.fed - start >= 2 and self.read == start:
            self.read = self.fed

    def decoded(self, steps: int, rows: int) -> None:
        """A batch took ``steps`` decode steps of it since it joined, ``rows`` rows in all (each
        fed its last token): counted when it leaves, not a row at a time in each step."""
        self.fed += steps
        self.steps += steps
        self.step_rows += rows

    def append(self, token: int, ended: str | None) -> None:
        """Continue with ``token`` (a batch chose it: ``choice``), which ends the run if ``ended``
        says why. Sets ``ended`` (and ``reason``) when the run ends, a stop string included."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.ids.append(token)
        self.settle(ended)

    def settle(self, ended: str | None) -> bool:
        """Whether the run ends with its last token: ``ended`` says why when the batch decided it
        (None: it did not), else a stop string may. A batch appends its rows' tokens itself and
        asks only the rows with an end or stop strings."""
        if ended is None and self.decoding.stopped(self.ids):
            ended = "stop"
        if self.stop_text.stops:
            self.text()
            if self.stop_text.stopped:
                ended = "stop"  # seen in the text at a token boundary the criterion had not
        if ended is not None:
            self.reason, self.ended = ended, True
        return self.ended

    def text(self) -> list[str]:
        """Make the text of the tokens chosen since the last call; return every piece so far."""
        with self._text_lock:
            for token in self.ids[self._detokenized :]:
                self._detokenized += 1
                if token not in self.eos_ids:
                    self._hand_out(self.stop_text.push(self.detokenizer.push(token)))
            return self.pieces

    def finish(self, reason: str | None = None) -> str:
        """End the run (``reason``: why, if ``accept`` did not end it); return the text still held.

        A cancelled run leaves out text still held for an incomplete character (its tokens are
        not committed: the resumed run recomputes them), but not text held back as a possible
        stop string, whose tokens are."""
        if reason is not None:
            self.reason = reason
        self.ended = True
        self.text()
        with self._text_lock:
            stop_text = self.stop_text
            tail = stop_text.flush() if self.reason == "cancel" else stop_text.push(self.detokenizer.flush())
            if not stop_text.stopped:
                tail += stop_text.flush()
            return self._hand_out(tail)

    def keep(self, prefix: PrefixCache, cache: Any) -> None:
        """Store the KV of the tokens fed, for the next turn or for the resume of a revoked run."""
        if self.reason != "error" and self.fed:
            prefix.put(self.ids[: self.fed], cache, preempted=self.reason == "cancel",
                       prompt=len(self.context), read=self.read, logits=self.prompt_logits)

    def result(self) -> GenerationResult:
        return GenerationResult(
            text="".join(self.pieces),
            token_ids=tuple(self.detokenizer.committed),
            prompt_tokens=len(self.context),
            finish_reason=self.reason,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.started,
            total_s=time.perf_counter() - self.started,
            cached_tokens=self.hit.tokens,
            prefill_s=None if self.prefilled_at is None else self.prefilled_at - self.started,
            mean_batch=self.step_rows / self.steps if self.steps else None,
        )

    def _hand_out(self, piece: str) -> str:
        if piece:
            self.pieces.append(piece)
        return piece
