"""Producer actors: the submission sites of the notes' table (§6) as named Ray actors.

Each producer submits through the same async client API that scripts use (`agenerate`,
`aset_foreground`, `astatus`), so a producer is nothing but a long-lived client with the
kind, foreground behaviour, deadline and model choice of its site:

    site                    kind     foreground while open        deadline   model
    ChatProducer.send       chat     chat (Shiv page)             -          active chat model
    NatarajProducer (deck)  nataraj  nataraj (deck page)          -          active chat model
    GanaProducer.run        gana     gana, subject=its flow id    -          desired_model_id
    GanaProducer.fire/cron  gana     never                        fire time  desired_model_id
    ExtractProducer         extract  extract, subject=note id     -          active chat model
                                     (open_note: hint + subject)

`model_id=None` means the active chat model, as in the client; tests pass "tiny". Every
job carries the producer's flow id ("gana:42") so the fair pool separates two Ganas (R8).
An actor is named `producer:<kind>:<id>` in namespace "uniun"; its repr shows its state (deck
fill, jobs in flight, failures), and Ray prints it in the dashboard and in the actor's errors.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections import deque

import ray

from .client import Completion, agenerate, aset_foreground, astatus, error_text
from .policy import Kind
from .runtime.protocol import NAMESPACE

#: Seconds a background loop waits after a failed job before it submits again, so a broken
#: runtime (model missing, scheduler restarting) is not hammered.
RETRY_S = 1.0

CARD_TOPICS = ("patience", "curiosity", "rivers", "small habits", "old friends", "the night sky",
               "starting over", "quiet mornings")


def producer_name(kind: Kind | str, producer_id: str) -> str:
    return f"producer:{Kind.parse(kind).value}:{producer_id}"


class _Producer:
    """What every producer shares: its flow id, its model, counters, and its page (the
    foreground it set while its surface is open)."""

    kind: Kind

    def __init__(self, producer_id: str, model_id: str | None = None, max_new_tokens: int = 48) -> None:
        if not isinstance(producer_id, str) or not producer_id:
            raise ValueError(f"producer_id must be a non-empty string, got {producer_id!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.flow = f"{self.kind.value}:{producer_id}"
        self.model_id = model_id
        self.max_new_tokens = max_new_tokens
        self.in_flight = self.done = self.failed = 0
        self.last_error: str | None = None
        self._page: dict | None = None   # the foreground this producer set, while its page is open
        self._tasks: set[asyncio.Task] = set()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self._fields().items() if v not in (None, ""))
        return f"{type(self).__name__}({self.flow}, {fields})"

    def _fields(self) -> dict:
        return {"model": self.model_id or "active", "page_open": self._page is not None,
                "in_flight": self.in_flight, "done": self.done, "failed": self.failed,
                "last_error": self.last_error}

    async def state(self) -> dict:
        return {"flow": self.flow, **self._fields()}

    async def _generate(self, prompt: str | None, **job) -> Completion:
        """One job through the client. `in_flight` is counted before the first await, so a
        caller that checks it and then calls this cannot overshoot."""
        self.in_flight += 1
        try:
            completion = await agenerate(self.kind, prompt, model_id=self.model_id, producer=self.flow,
                                         max_new_tokens=self.max_new_tokens, **job)
        except Exception as error:
            self.failed += 1
            self.last_error = error_text(error)[:300]
            raise
        finally:
            self.in_flight -= 1
        self.done += 1
        return completion

    def _spawn(self, coro) -> asyncio.Task:
        """A background task that `stop` can withdraw (async actors construct and run in
        their event loop, so this works from __init__ too)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """Withdraw all background work (its queued or running jobs are cancelled at the
        scheduler) and close the page. Call it before dropping a producer: the jobs of a
        killed actor hold their place until the scheduler reaps them (lease timeout)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.close_page()

    async def open_page(self, subject: str | None = None) -> None:
        """The producer's surface is on screen: its kind (and subject) goes in front (T1)."""
        await aset_foreground(self.kind, subject)
        self._page = {"kind": self.kind.value, "subject": subject}

    async def close_page(self) -> None:
        """Leave the foreground empty, unless another page took it since we opened ours
        (the last page opened owns it). The check and the clear are two calls; a page
        opened between them loses its foreground, as a fast double navigation would."""
        page, self._page = self._page, None
        if page is not None and (await astatus())["foreground"] == page:
            await aset_foreground(None)


class ChatProducer(_Producer):
    """Shiv chat / composer panel: T0 jobs on the active chat model."""

    kind = Kind.CHAT

    def __init__(self, producer_id: str, model_id: str | None = None, max_new_tokens: int = 64) -> None:
        super().__init__(producer_id, model_id, max_new_tokens)
        self.last_ttft_s: float | None = None

    def _fields(self) -> dict:
        return super()._fields() | {"last_ttft_s": self.last_ttft_s}

    async def send(self, prompt: str | None = None, *, messages: list[dict] | None = None) -> Completion:
        completion = await self._generate(prompt, messages=messages)
        self.last_ttft_s = completion.ttft_s
        return completion


class NatarajProducer(_Producer):
    """NatarajGenerator.fillBuffer: keeps a deck of `deck_size` cards, one nataraj job per
    card, refilling as `take_card` consumes them. `parallel` jobs may be queued at once (the
    app fills one at a time)."""

    kind = Kind.NATARAJ

    def __init__(self, producer_id: str, deck_size: int = 4, model_id: str | None = None,
                 max_new_tokens: int = 48, parallel: int = 1) -> None:
        super().__init__(producer_id, model_id, max_new_tokens)
        for name, value in (("deck_size", deck_size), ("parallel", parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.deck_size = deck_size
        self.deck: deque[dict] = deque()
        self.taken = 0
        self._topics = itertools.cycle(CARD_TOPICS)
        self._room = asyncio.Event()    # set when a card was taken
        self._added = asyncio.Event()   # set when a card was added
        for _ in range(parallel):
            self._spawn(self._fill())

    def _fields(self) -> dict:
        return super()._fields() | {"deck": f"{len(self.deck)}/{self.deck_size}", "taken": self.taken}

    async def _fill(self) -> None:
        while True:
            if len(self.deck) + self.in_flight >= self.deck_size:
                self._room.clear()
                await self._room.wait()
                continue
            topic = next(self._topics)
            try:
                card = await self._generate(f"A short, warm reflection card about {topic}:\n")
            except Exception:  # recorded in last_error; the deck keeps trying
                await asyncio.sleep(RETRY_S)
                continue
            self.deck.append({"topic": topic, "text": card.text, "job_id": card.job_id,
                              "total_s": card.total_s, "revokes": card.revokes})
            self._added.set()

    async def take_card(self) -> dict | None:
        """The oldest card, or None when the deck is empty; its slot is refilled."""
        if not self.deck:
            return None
        self.taken += 1
        self._room.set()
        return self.deck.popleft()

    async def wait_deck(self, count: int | None = None, timeout_s: float = 60.0) -> int:
        """Wait until the deck holds `count` cards (default: full); returns the deck size
        reached, which is smaller when the timeout came first."""
        count = self.deck_size if count is None else count
        deadline = time.monotonic() + timeout_s
        while len(self.deck) < count and (left := deadline - time.monotonic()) > 0:
            self._added.clear()
            try:
                await asyncio.wait_for(self._added.wait(), left)
            except asyncio.TimeoutError:
                break
        return len(self.deck)


class GanaProducer(_Producer):
    """GanaEngine.processGana. Interactive runs (the form's preview) carry the flow id as
    subject, and `open_page` puts that subject in front, so only this Gana is hoisted.
    Cron-fired runs never touch the foreground: they carry the fire time as deadline and are
    queued before it, so they wait in the fair pool and rise to T3 when they fall due."""

    kind = Kind.GANA

    def __init__(self, producer_id: str, desired_model_id: str | None = None, max_new_tokens: int = 48) -> None:
        super().__init__(producer_id, desired_model_id, max_new_tokens)
        self.fired: deque[dict] = deque(maxlen=50)

    def _fields(self) -> dict:
        late = [f["late_s"] for f in self.fired if f.get("late_s") is not None]
        return super()._fields() | {"fired": len(self.fired),
                                    "max_late_s": round(max(late), 2) if late else None}

    async def open_page(self, subject: str | None = None) -> None:
        """The Gana form is open: this Gana's interactive runs are in front."""
        await super().open_page(self.flow if subject is None else subject)

    async def run(self, prompt: str) -> Completion:
        """An interactive run (the form's preview)."""
        return await self._generate(prompt, subject=self.flow)

    async def fire(self, prompt: str, fire_at: float | None = None) -> dict:
        """One cron-fired run due at `fire_at` (epoch s; default now). Returns its record:
        the job's deadline and model, and how late it finished."""
        fire_at = time.time() if fire_at is None else fire_at
        record = {"deadline": fire_at, "model_id": self.model_id, "submitted": time.time()}
        self.fired.append(record)
        try:
            completion = await self._generate(prompt, deadline=fire_at)
        except Exception as error:
            record["error"] = error_text(error)
            return record
        now = time.time()
        record.update(job_id=completion.job_id, model_id=completion.model_id, text=completion.text,
                      finished=now, late_s=now - fire_at, revokes=completion.revokes)
        return record

    async def cron(self, prompt: str, every_s: float, runs: int) -> list[dict]:
        """`runs` ticks every `every_s` seconds; tick k is due at start + (k+1)*every_s and is
        queued one period ahead of it. Returns the runs' records once all ended."""
        if not every_s > 0 or isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise ValueError(f"cron needs every_s > 0 and runs >= 1, got {every_s!r}, {runs!r}")
        start = time.time()
        ticks = []
        for k in range(runs):
            ticks.append(self._spawn(self.fire(prompt, start + (k + 1) * every_s)))
            if k + 1 < runs:
                await asyncio.sleep(max(0.0, start + (k + 1) * every_s - time.time()))
        return list(await asyncio.gather(*ticks))


class ExtractProducer(_Producer):
    """ExtractKnowledgeUseCase. Opening a note hoists its extraction (foreground extract
    with the note as subject, and a job with foreground_hint and that subject); the backfill
    loop submits plain extract jobs (T2, under the budget of R11)."""

    kind = Kind.EXTRACT

    def __init__(self, producer_id: str, model_id: str | None = None, max_new_tokens: int = 32) -> None:
        super().__init__(producer_id, model_id, max_new_tokens)
        self.backfilled = 0

    def _fields(self) -> dict:
        return super()._fields() | {"backfilled": self.backfilled}

    @staticmethod
    def _prompt(note_id: str, text: str | None) -> str:
        return f"Note {note_id}: {text or 'a meeting about the river project, Tuesday.'}\nKey facts:\n"

    async def open_note(self, note_id: str, text: str | None = None) -> Completion:
        await self.open_page(note_id)
        return await self._generate(self._prompt(note_id, text), foreground_hint=True, subject=note_id)

    async def close_note(self) -> None:
        await self.close_page()

    async def backfill(self, note_ids: list[str], per_second: float = 1.0) -> dict:
        """Submit one extract job per note at `per_second`, without waiting for each to end
        (notes scenario 5). Returns counts once all ended."""
        if not per_second > 0:
            raise ValueError(f"per_second must be > 0, got {per_second!r}")
        jobs = []
        for index, note_id in enumerate(note_ids):
            if index:
                await asyncio.sleep(1.0 / per_second)
            jobs.append(self._spawn(self._generate(self._prompt(note_id, None))))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        done = sum(not isinstance(r, BaseException) for r in results)
        self.backfilled += done
        return {"submitted": len(jobs), "done": done, "failed": len(jobs) - done}


PRODUCERS: dict[Kind, type[_Producer]] = {Kind.CHAT: ChatProducer, Kind.NATARAJ: NatarajProducer,
                                          Kind.GANA: GanaProducer, Kind.EXTRACT: ExtractProducer}
_REMOTE = {kind: ray.remote(cls) for kind, cls in PRODUCERS.items()}


def spawn_producer(kind: Kind | str, producer_id: str, *, detached: bool = False, **options):
    """Get or create the producer actor `producer:<kind>:<id>`. Options go to its
    constructor and are checked here, in the caller; an existing actor keeps its own. Not
    detached by default: a producer dies with the script (or job) that spawned it."""
    kind = Kind.parse(kind)
    try:
        inspect.signature(PRODUCERS[kind]).bind(producer_id, **options)
    except TypeError as error:
        raise ValueError(f"{PRODUCERS[kind].__name__}: {error}") from None
    lifetime = {"lifetime": "detached"} if detached else {}
    return _REMOTE[kind].options(name=producer_name(kind, producer_id), namespace=NAMESPACE,
                                 get_if_exists=True, num_cpus=0, **lifetime).remote(producer_id, **options)
