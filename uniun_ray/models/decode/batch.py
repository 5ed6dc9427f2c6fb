"""Several runs on one model, one batched forward pass per step (continuous batching, Ray-free).

A CPU or GPU reads a model's weights once per forward pass whatever the batch size, so decoding
B sequences together costs far less than B passes of one. ``Batch`` keeps the engine's rules
per job: its own cancel flag (a revoked job leaves before the next step, the others go on; the
rows' flags are read once a step), its own logits processors and ends (``decoding``; applied to
every row at once, ``choice``: only the chosen ids come to the host), detokenizer, stop text,
stream of pieces and result (``token_ids`` for an exact resume), and its own prefix-cache entry.

* A joining job's prefill runs on its own (batch 1, its own cache, starting from its prefix-cache
  hit), one chunk per step between the others' decode steps, so nobody waits for a long prompt
  for more than about one step. Its KV then joins the batch's rows (``runner.rows``: how rows are
  kept, padded or static, is the device's mechanism; when they join and leave is decided here).
* A leaving job's row is dropped; its KV, cut out of the rows, goes into the prefix cache as the
  engine stores it (a revoked job's for its resume).
* One run alone is a batch of one row (``generation.Generation``): the prefill-chunk rule and
  the decode step live here once.
* Only models whose every cache layer is a plain full-attention ``DynamicLayer`` are batched:
  a sliding-window layer (Gemma) drops its oldest tokens per row and cannot be padded or cut out
  the same way. Those run one job at a time (``slots`` is 1; the others wait their turn).

Greedy output per job is token-identical to the job running alone in float32: padded positions
get exactly zero attention weight (tested with the tiny model; in lower precision a batched
kernel may round differently and flip a near-tie, unless ``UNIUN_DETERMINISTIC`` has a CPU
compute each row as alone: ``runner.attention``, ``load.packing``).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext
from operator import methodcaller
from typing import TYPE_CHECKING, Any, Callable

import torch

from .choice import Choice
from .sequence import Sequence
from ..runner.gate import CancelFlag, Interrupted
from ..tune.tuning import CHUNK_DECODE_STEPS, MAX_CHUNK, MIN_CHUNK
from ..load.weights import Loaded
from ..runner import rows as kv_rows
from ..kv.prefix import crop_layers
from ..requests.request import GenerateRequest, GenerationResult

if TYPE_CHECKING:   # the engine makes batches (a lone run is one); a batch only calls it
    from .engine import Engine

#: Rows a batch decodes together unless told otherwise.
DEFAULT_SLOTS = 8
_IS_SET = methodcaller("is_set")


class Job:
    """One request in a ``Batch``. Its text arrives in ``pieces`` as the batch steps (``drain``
    returns what is new); ``result`` is set, and ``done`` set, when it ends."""

    def __init__(self, sequence: Sequence, revocable: bool) -> None:
        self.sequence = sequence
        self.revocable = revocable
        self.cache: Any = None          # its own KV while it prefills, before it joins the batch
        self.joined: tuple[int, int] | None = None   # the batch's (steps, rows stepped) when it joined
        self.result: GenerationResult | None = None
        self.done = threading.Event()
        self._taken = 0

    @property
    def pieces(self) -> list[str]:
        return self.sequence.text()

    def drain(self) -> list[str]:
        """The pieces handed out since the last call (their text made now, in the caller's thread)."""
        pieces = self.sequence.text()[self._taken :]
        self._taken += len(pieces)
        return pieces


class Batch:
    """The runs on ``engine``'s loaded model, stepped together by one thread (``step`` / ``run``).

    ``add`` may be called from any thread; a job beyond ``slots`` rows (None: DEFAULT_SLOTS; 1
    for a model that cannot be batched, see ``runner.rows.batchable``) waits for a row. Jobs join one at a
    time, in the order they were added. The engine refuses ``load``/``unload`` while any job
    added here has not ended.
    """

    def __init__(self, engine: Engine, slots: int | None = None, first_token: Callable[[], None] | None = None) -> None:
        """``first_token``: called (from the stepping thread) as soon as a joining job has its
        first token, before that step's batched decode and the job's KV joining the batch, so
        that its stream need not wait for them (a chat's TTFT beside busy slots, R23)."""
        loaded = engine.resident
        if loaded is None:
            raise RuntimeError("no model is loaded; call load(model_id) first")
        if slots is not None and (not isinstance(slots, int) or slots < 1):
            raise ValueError(f"slots must be an int >= 1 or None, got {slots!r}")
        self.engine, self.loaded, self._first_token = engine, loaded, first_token
        self.batched = kv_rows.batchable(loaded.model)
        slots = (slots or DEFAULT_SLOTS) if self.batched else 1
        # the rows' KV, in the order of _decoding: a static store holds at most its rows
        self._kv = kv_rows.rows_for(loaded.runner, engine.device, slots, loaded.rows)
        self.slots = min(slots, self._kv.capacity or slots)
        self._lock = threading.Lock()
        self._waiting: deque[Job] = deque()
        self._joining: Job | None = None
        self._decoding: list[Job] = []
        self._choice: Choice | None = None         # how the rows choose their tokens (made again as they change)
        self._lists: _RowLists | None = None       # what a step reads of its rows (likewise)
        self._steps = self._rows_stepped = 0       # decode steps taken, and their rows in all
        self.last_step_rows = 0                  # rows the last step decoded (0: it only prefilled)

    @property
    def rows(self) -> int:
        """Jobs decoding together now (a joining job's prefill not counted)."""
        return len(self._decoding)

    @property
    def busy(self) -> bool:
        return bool(self._decoding or self._joining or self._waiting)

    def add(self, request: GenerateRequest, cancel: CancelFlag, revocable: bool = True) -> Job:
        """Queue a run; checked here, eagerly, as ``generation.generate`` checks it. A run that is
        not ``revocable`` (chat) reads its prompt in one pass (see ``_chunk``)."""
        sequence = self.engine.admit(request, cancel)
        if sequence.loaded is not self.loaded:
            raise RuntimeError("the engine's model changed after this batch was made")
        return self.enqueue(sequence, revocable)

    def enqueue(self, sequence: Sequence, revocable: bool = True) -> Job:
        """Queue a run the engine admitted (``Engine.admit``); it counts as running from now on."""
        self.engine.begin(sequence)
        job = Job(sequence, revocable)
        with self._lock:
            self._waiting.append(job)
        return job

    def run(self) -> None:
        """Step until every job has ended."""
        while self.step():
            pass

    def step(self) -> bool:
        """Drop the cancelled jobs, read one chunk of the joining job's prompt, then decode one
        token for every row in one forward pass (not in the step a job joined an empty batch: its
        first token is handed out before its next is computed). Returns whether any job is left.

        While a chat waits with a row free for it, the cancelled rows leave after its prefill
        instead: leaving copies each one's KV out of the batch (for its resume), and a chat that
        revokes the others beside it (R23) has a dozen of them, leaving at the very step it joins."""
        self.last_step_rows = 0
        try:
            chat = self._chat_may_join()
            if not chat:
                self._leave_cancelled()
            self._drop_cancelled_waiting()
            self._next_joining()
            alone = not self._decoding
            prefilled = self._joining is not None
            if prefilled:
                self._prefill(self._joining)
            if chat or prefilled:   # flags set while a prompt was read
                self._leave_cancelled()
            if self._decoding and not (alone and len(self._decoding) == 1):   # a lone joiner's first token ends its step
                self._decode()
        except BaseException:
            self._fail()
            raise
        return self.busy

    def close(self) -> None:
        """End every job now, as cancelled (their KV kept for their resume)."""
        self._leave(list(self._decoding), "cancel")
        if self._joining is not None:
            self._end(self._joining, "cancel", self._joining.cache)
            self._joining = None
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            self._end(job, "cancel", job.cache)

    # -- joining -----------------------------------------------------------------------------

    def _next_joining(self) -> None:
        """Start the prefill of the next waiting job, if none is running and a row is free: a
        chat first (nothing but its own cancel stops it: its time to first token is the goal),
        else the oldest. A chat's tokens come no slower for the others' prompts (R23): a prompt
        is read in a forward pass of its own, about one more decode step's time, so while a chat
        decodes no other job starts its prompt, and one that was reading its prompt when a chat
        came steps aside (back to the front of the queue, its KV so far kept)."""
        joining = self._joining
        if joining is not None and joining.revocable and self._chat_waiting():
            with self._lock:
                self._waiting.appendleft(joining)
            self._joining = None
        if not self._row_free():
            return
        with self._lock:
            job = self._waiting_chat()
            if job is None and self._waiting and not self._chat_decoding():
                job = self._waiting[0]
            if job is None:
                return
            self._waiting.remove(job)
        sequence = job.sequence
        if job.cache is None and not sequence.fed:     # not begun: from what the prefix cache holds
            sequence.start_from(self.loaded.prefix.lookup(sequence.context))
            job.cache = sequence.hit.cache
        self._joining = job

    def _chat_decoding(self) -> bool:
        return any(not job.revocable for job in self._decoding)

    def _chat_waiting(self) -> bool:
        with self._lock:
            return self._waiting_chat() is not None

    def _row_free(self) -> bool:
        """Whether a waiting job may start its prefill now: none is prefilling and a row is free."""
        return self._joining is None and len(self._decoding) < self.slots

    def _waiting_chat(self) -> Job | None:
        """The first waiting job only its own cancel may stop (a chat); call with the lock held."""
        return next((job for job in self._waiting if not job.revocable), None)

    def _chat_may_join(self) -> bool:
        with self._lock:
            chat = self._waiting_chat() is not None
        return chat and self._row_free()

    def _drop_cancelled_waiting(self) -> None:
        """End the waiting jobs revoked before they joined, at once (no work done): a revoke
        waits for nobody's prompt, however many joiners are ahead of it."""
        with self._lock:
            cancelled = [job for job in self._waiting if job.sequence.cancelled]
            for job in cancelled:
                self._waiting.remove(job)
        for job in cancelled:
            self._end(job, "cancel", job.cache)   # a job that stepped aside keeps the prompt it read

    def _prefill(self, job: Job) -> None:
        """One chunk of the joining job's prompt; at its end, its first token, then its row. A
        prompt the prefix cache held whole, with the logits after it, reads nothing."""
        sequence, start = job.sequence, job.sequence.fed
        if sequence.hit.logits is not None and start == len(sequence.context):
            logits = None if sequence.cancelled else sequence.hit.logits
        else:
            logits, job.cache, sequence.fed = prefill_chunk(
                self.loaded, sequence.context, job.cache, sequence.fed, self._chunk(job), self.engine.device,
                sequence.decoding.cancel)
            sequence.prefilled(start)
        if logits is None:
            self._joining = None
            self._end(job, "cancel", job.cache)
            return
        if sequence.fed < len(sequence.context):
            return
        self._joining = None
        sequence.prefilled_at = time.perf_counter()
        sequence.prompt_logits = logits.clone()     # not a view that holds the pass's output
        tokens, ends = Choice([sequence], self.engine.device).step(logits[None])
        sequence.append(tokens[0], ends.get(0))
        if self._first_token is not None and sequence.text():
            self._first_token()
        if sequence.ended:
            self._end(job, None, job.cache)
        else:
            self._join(job)

    def _chunk(self, job: Job) -> int:
        """Prompt tokens in this step's chunk: the engine's fixed size if set; a run nothing but
        its own cancel may stop (chat) reads its prompt in one pass, the others waiting for it
        (its time to first token is the goal, R23); otherwise the engine's time-sized chunk, cut
        to about CHUNK_DECODE_STEPS decode steps while others decode (they wait for it).

        The same request asked again gets the first token, and every greedy one, it got the first
        time, in any dtype: its prompt's KV and the logits after it are kept (``kv.prefix``, a
        whole hit), so it reads nothing. An ``exact`` prefix cache (``UNIUN_DETERMINISTIC``, in
        every dtype) has the last token read alone and every other in passes of two or more, as a
        fresh read reads them (``kv.prefix``: such passes compute each token to the bit alike; a
        lone token rounds otherwise): the answer then does not depend on what the prefix cache
        held. A prompt of two tokens is read in one pass then."""
        chunk, left = self._sized_chunk(job), len(job.sequence.context) - job.sequence.fed
        return _exact_chunk(chunk, left) if self.loaded.prefix.exact else chunk

    def _sized_chunk(self, job: Job) -> int:
        clock = self.loaded.clock
        if self.engine.prefill_chunk:
            return self.engine.prefill_chunk
        if not job.revocable:
            return MAX_CHUNK
        if self._decoding:
            return max(MIN_CHUNK, int(clock.chunk * CHUNK_DECODE_STEPS / clock.decode_steps))
        return clock.chunk

    def _join(self, job: Job) -> None:
        """Add the job's KV to the batch as a new row."""
        self._kv.join(job.cache, job.sequence.fed)
        job.cache = None
        job.joined = (self._steps, self._rows_stepped)
        self._decoding.append(job)
        self._choice = self._lists = None

    # -- decoding ----------------------------------------------------------------------------

    def _decode(self) -> None:
        """One forward pass over every row's last token (fed on the device); then every row's
        token is chosen on the device for the whole batch, and only the chosen ids come to the
        host, in one copy (``choice``, which also says which rows they end). Each row's token is
        appended to its list; only the rows that end or have stop strings are asked more."""
        rows, count = self._decoding, len(self._decoding)
        started = time.perf_counter()
        if self._choice is None:
            self._choice = Choice([job.sequence for job in rows], self.engine.device)
        tokens, ends = self._choice.step(self._kv.decode(self._choice.inputs()))
        seconds = time.perf_counter() - started
        self.loaded.clock.observe(1, seconds)
        self.loaded.served.observe(count, seconds)
        self.last_step_rows = count
        self._steps += 1
        self._rows_stepped += count
        lists = self._row_lists()
        for ids, token in zip(lists.ids, tokens):
            ids.append(token)
        asked = sorted(ends.keys() | lists.watched)
        self._leave([rows[row] for row in asked if rows[row].sequence.settle(ends.get(row))], None)

    # -- leaving -----------------------------------------------------------------------------

    def _leave_cancelled(self) -> None:
        """The rows whose cancel flag is set leave: the flags read once, over the batch."""
        flags = self._row_lists().flags
        if any(map(_IS_SET, flags)):
            self._leave([job for job, flag in zip(self._decoding, flags) if flag.is_set()], "cancel")

    def _row_lists(self) -> _RowLists:
        if self._lists is None:
            self._lists = _RowLists(self._decoding)
        return self._lists

    def _leave(self, jobs: list[Job], reason: str | None) -> None:
        """Drop the jobs' rows in one cut of the rows' KV, each job's own KV kept."""
        if not jobs:
            return
        caches, order = self._kv.leave([self._decoding.index(job) for job in jobs])
        kept = [job for job in self._decoding if job not in jobs]
        self._decoding = [kept[index] for index in order]      # as the rows step from now on
        self._choice = self._lists = None
        for job, cache in zip(jobs, caches):
            self._end(job, reason, cache)

    def _end(self, job: Job, reason: str | None, cache: Any) -> None:
        sequence = job.sequence
        if job.joined is not None:
            steps, rows = job.joined
            sequence.decoded(self._steps - steps, self._rows_stepped - rows)
            job.joined = None
        sequence.finish(reason)
        self.engine.retire(sequence, cache)
        job.result = sequence.result()
        job.done.set()

    def _fail(self) -> None:
        """The model raised: every job ends with "error" (no KV kept: it may be half written)."""
        jobs = self._decoding + ([self._joining] if self._joining is not None else []) + list(self._waiting)
        self._decoding, self._joining, self._waiting = [], None, deque()
        self._choice = self._lists = None
        self._kv.clear()
        for job in jobs:
            if job.result is None:
                job.sequence.reason = "error"
                self._end(job, None, None)


class _RowLists:
    """What a step reads of its rows, in row order; made again when a row joins or leaves: their
    cancel flags, their token lists (the step appends each row's token to its list, no call a
    row) and the rows whose text may end them (stop strings: asked after every token)."""

    def __init__(self, jobs: list[Job]) -> None:
        self.flags = [job.sequence.decoding.cancel.flag for job in jobs]
        self.ids = [job.sequence.ids for job in jobs]
        self.watched = [row for row, job in enumerate(jobs) if job.sequence.stop_text.stops]


def prefill_chunk(
    loaded: Loaded, context: list[int], cache: Any, start: int, chunk: int, device: torch.device,
    cancel: CancelFlag,
) -> tuple[torch.Tensor | None, Any, int]:
    """Read ``context[start:start + chunk]`` into ``cache`` (which holds ``context[:start]``),
    checking ``cancel`` before the pass and, where the model has a layer gate, before each of
    its layers. Returns the last logits (None when cancelled), the cache and how many tokens it
    holds: a chunk cut short is cropped away; a cache that cannot be cropped back is dropped."""
    if cancel.is_set():
        return None, cache, start
    try:
        with loaded.gate.armed(cancel) if loaded.gate is not None else nullcontext():
            started = time.perf_counter()
            ids = context[start : start + chunk]
            logits, extended = loaded.runner.prefill(ids, cache, device)
            loaded.clock.observe(len(ids), time.perf_counter() - started)
    except Interrupted:
        if cache is None or not crop_layers(cache, start):
            return None, None, 0
        return None, cache, start
    return logits, extended, min(start + chunk, len(context))


def _exact_chunk(chunk: int, left: int) -> int:
    """``chunk`` of the ``left`` prompt tokens, cut so that the last is read alone and no other is."""
    if left <= 2:
        return left
    chunk = max(2, min(chunk, left - 1))
    if left - 1 - chunk == 1:       # no lone token before the last
        chunk += 1 if chunk == 2 else -1
    return chunk
