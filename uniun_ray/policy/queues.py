"""Where queued jobs wait: one small ordered structure per tier, each answering "who is
first?" in O(log n), globally or among the jobs that want a given model (R15).

Jobs are indexed by what never changes about them (kind, model, subject, deadline,
submit order); tiers are not stored. The picker asks in tier order, and that order makes
the cheap answers exact: T3 and T4 are only consulted when T1 is empty (so no job is
hoisted), and T4 only once T3 is empty in the same scope (so every queued pool job in
that scope is past no deadline).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

from sortedcontainers import SortedKeyList, SortedList

from .fairness import ProducerFlow, VruntimeLedger
from .tiers import Foreground, Tier
from .types import POOL_KINDS, Job, Kind


@dataclass(eq=False, slots=True)
class Entry:
    """A job inside the policy. `seq` is its place in submit order: a revoked job goes back
    with the same `seq`, which is what "re-queued at its original place" means (R3, R6)."""

    job: Job
    seq: int
    submitted: float
    dispatched_at: float | None = None
    dispatch_tier: Tier | None = None
    revoke_sent: bool = False
    cancelled: bool = False
    slot: int = 0            # while running: its slot on the device (R21)
    handed: bool = False     # revoked, and its slot already taken by the next job (R22)
    dispatch_no: int = -1    # while running: when it was dispatched, in dispatch order

    @property
    def flow(self) -> ProducerFlow:
        return (self.job.kind, self.job.producer)


def _by_seq(entry: Entry) -> int:
    return entry.seq


def _fifo() -> SortedKeyList:
    return SortedKeyList(key=_by_seq)


def _by_deadline(entry: Entry) -> tuple[float, int]:
    return (entry.job.deadline, entry.seq)


class Ordered:
    """Entries sorted by a fixed key, all together and per model."""

    def __init__(self, key: Callable[[Entry], object]) -> None:
        self._key = key
        self._all = SortedKeyList(key=key)
        self._by_model: dict[str, SortedKeyList] = defaultdict(lambda: SortedKeyList(key=key))

    def add(self, entry: Entry) -> None:
        self._all.add(entry)
        self._by_model[entry.job.model_id].add(entry)

    def remove(self, entry: Entry) -> None:
        self._all.remove(entry)
        bucket = self._by_model[entry.job.model_id]
        bucket.remove(entry)
        if not bucket:
            del self._by_model[entry.job.model_id]

    def head(self, model: str | None = None) -> Entry | None:
        bucket = self._all if model is None else self._by_model.get(model)
        return bucket[0] if bucket else None

    def first_key_after(self, key: object) -> Entry | None:
        i = self._all.bisect_key_right(key)
        return self._all[i] if i < len(self._all) else None

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._all)


class Buckets:
    """Entries sorted by submit order, grouped by a fixed attribute (a kind, a subject)."""

    def __init__(self, key_of: Callable[[Entry], object]) -> None:
        self._key_of = key_of
        self._buckets: dict[object, SortedKeyList] = defaultdict(_fifo)

    def add(self, entry: Entry) -> None:
        self._buckets[self._key_of(entry)].add(entry)

    def remove(self, entry: Entry) -> None:
        key = self._key_of(entry)
        self._buckets[key].remove(entry)
        if not self._buckets[key]:
            del self._buckets[key]

    def head(self, key: object) -> Entry | None:
        bucket = self._buckets.get(key)
        return bucket[0] if bucket else None

    def count(self, key: object) -> int:
        bucket = self._buckets.get(key)
        return len(bucket) if bucket else 0


class Tally:
    """How many entries share a fixed attribute, where only the count is ever asked."""

    def __init__(self, key_of: Callable[[Entry], object]) -> None:
        self._key_of = key_of
        self._counts: Counter = Counter()

    def add(self, entry: Entry) -> None:
        self._counts[self._key_of(entry)] += 1

    def remove(self, entry: Entry) -> None:
        key = self._key_of(entry)
        self._counts[key] -= 1
        if not self._counts[key]:
            del self._counts[key]

    def count(self, key: object) -> int:
        return self._counts.get(key, 0)


class FairPool:
    """T4 (R8): the kind with the lowest vruntime, then its producer with the lowest
    vruntime, then that producer's oldest job. Ties go to the flow whose oldest job came
    first (R9). A flow's rank is model-independent, so "the best job on the loaded model"
    (R12) is exactly the first job on that model in the pool's one global order.

    Producers are kept in a sorted list per (kind, scope), scope being all jobs or the jobs
    on one model, keyed by (vruntime, oldest seq, name); a key changes only when the
    producer is charged, decayed or its oldest job changes, and is then re-inserted.

    On a pool of devices or slots (R19, R24) the flows' running jobs count before they
    finish: `inflight` gives, per kind and per (kind, producer), how many run and what they
    count for (each the time it has held its device so far, at least its flow's last run). A
    flow's rank is first its running jobs per unit of weight (fewer first), then its vruntime
    plus that time (divided by its weight). Ranked by time alone, a flow that took many slots
    while it was behind kept them for as long as its jobs ran, gaining on the other at the
    difference of their slot counts: two equal flows drifted to 5x the largest job apart with
    7 slots (found by the two-flow property); holding equal slot counts, they stay within
    about twice the largest job at every slot count. With one device of one slot nothing runs
    while the pool is asked, and the rank is the stored one."""

    _GLOBAL = None

    def __init__(self, ledger: VruntimeLedger, inflight: Callable[[], dict]) -> None:
        self._ledger = ledger
        self._inflight = inflight
        self._jobs: dict[tuple[ProducerFlow, str | None], SortedKeyList] = defaultdict(_fifo)
        self._kind_jobs: dict[tuple[Kind, str | None], SortedKeyList] = defaultdict(_fifo)
        self._producers: dict[tuple[Kind, str | None], SortedList] = defaultdict(SortedList)
        self._keys: dict[tuple[ProducerFlow, str | None], tuple] = {}
        self._models: dict[ProducerFlow, set[str]] = defaultdict(set)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, entry: Entry) -> None:
        flow, model = entry.flow, entry.job.model_id
        self._size += 1
        self._models[flow].add(model)
        for scope in (self._GLOBAL, model):
            self._jobs[(flow, scope)].add(entry)
            self._kind_jobs[(flow[0], scope)].add(entry)
        self.reprice(flow)

    def remove(self, entry: Entry) -> None:
        flow, model = entry.flow, entry.job.model_id
        self._size -= 1
        for scope in (self._GLOBAL, model):
            for index, key in ((self._jobs, (flow, scope)), (self._kind_jobs, (flow[0], scope))):
                index[key].remove(entry)
                if not index[key]:
                    del index[key]
        if (flow, model) not in self._jobs:
            self._rekey(flow, model)  # drops the flow from that model's ranking
            self._models[flow].discard(model)
            if not self._models[flow]:
                del self._models[flow]
        self.reprice(flow)

    def reprice(self, flow: ProducerFlow) -> None:
        """The flow's vruntime or oldest job changed: move it in every scope it is in."""
        for scope in (self._GLOBAL, *self._models.get(flow, ())):
            self._rekey(flow, scope)

    def reprice_all(self) -> None:
        for flow in list(self._models):
            self.reprice(flow)

    def _rekey(self, flow: ProducerFlow, scope: str | None) -> None:
        key = None
        if (flow, scope) in self._jobs:
            oldest = self._jobs[(flow, self._GLOBAL)][0].seq
            key = (self._ledger.producer_vruntime(flow), oldest, flow[1])
        old = self._keys.get((flow, scope))
        if key == old:
            return  # the common case: a job joined the back of its flow
        ranking = self._producers[(flow[0], scope)]
        if old is not None:
            ranking.remove(old)
            del self._keys[(flow, scope)]
        if key is not None:
            ranking.add(key)
            self._keys[(flow, scope)] = key
        elif not ranking:
            del self._producers[(flow[0], scope)]

    def head(self, model: str | None = None) -> Entry | None:
        running = self._inflight()
        kinds = [
            (self._rank(kind, self._ledger.kind_vruntime(kind), kind.value, running),
             self._kind_jobs[(kind, self._GLOBAL)][0].seq, kind)
            for kind in POOL_KINDS
            if (kind, model) in self._kind_jobs
        ]
        if not kinds:
            return None
        kind = min(kinds)[2]
        return self._jobs[((kind, self._fairest(kind, model, running)), model)][0]

    def _rank(self, flow: object, vruntime: float, name: str, running: dict) -> tuple[float, float]:
        held, count = running.get(flow, (0.0, 0))
        weight = self._ledger.weight(name)
        return (count / weight, vruntime + held / weight) if count else (0.0, vruntime)

    def _fairest(self, kind: Kind, model: str | None, running: dict) -> str:
        """The producer of `kind` to serve. The stored ranking leaves out running time, which
        only raises a rank, so the scan stops at the first producer with nothing running:
        it looks at most at one producer per device, and one more."""
        best = None
        for vruntime, oldest, producer in self._producers[(kind, model)]:
            key = (self._rank((kind, producer), vruntime, producer, running), oldest, producer)
            best = key if best is None or key < best else best
            if (kind, producer) not in running:
                break
        return best[2]


class Queues:
    """All queued jobs, indexed for the picker."""

    def __init__(self, ledger: VruntimeLedger, inflight: Callable[[], dict]) -> None:
        self._entries: dict[str, Entry] = {}
        self._chat = Ordered(_by_seq)
        self._extract = Ordered(_by_seq)
        self._deadlines = Ordered(_by_deadline)
        self._by_kind = Buckets(lambda e: e.job.kind)
        self._by_subject = Buckets(lambda e: e.job.subject)
        self._by_kind_subject = Tally(lambda e: (e.job.kind, e.job.subject))
        self._by_kind_model = Buckets(lambda e: (e.job.kind, e.job.model_id))
        self._by_subject_model = Buckets(lambda e: (e.job.subject, e.job.model_id))
        self._by_model = Tally(lambda e: e.job.model_id)
        self.pool = FairPool(ledger, inflight)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def get(self, job_id: str) -> Entry | None:
        return self._entries.get(job_id)

    def _indexes(self, entry: Entry) -> Iterator[Ordered | Buckets | Tally | FairPool]:
        """Every index this entry belongs to. Only hinted extracts are filed under their
        kind: a foreground extract page hoists those alone (R1)."""
        job = entry.job
        yield self._by_model
        if job.kind is Kind.CHAT:
            yield self._chat
            return
        if job.subject is not None:
            yield self._by_subject
            yield self._by_subject_model
        if job.kind is Kind.EXTRACT:
            yield self._extract
            if job.foreground_hint:
                yield from self._kind_indexes(job)
            return
        yield from self._kind_indexes(job)
        yield self.pool
        if job.deadline is not None:
            yield self._deadlines

    def add(self, entry: Entry) -> None:
        self._entries[entry.job.id] = entry
        for index in self._indexes(entry):
            index.add(entry)

    def remove(self, entry: Entry) -> None:
        del self._entries[entry.job.id]
        for index in self._indexes(entry):
            index.remove(entry)

    def count_on(self, model: str) -> int:
        """Queued jobs that want `model` (R17: how much a swap away from it would cost)."""
        return self._by_model.count(model)

    def _kind_indexes(self, job: Job) -> Iterator[Buckets | Tally]:
        yield self._by_kind
        yield self._by_kind_model
        if job.subject is not None:
            yield self._by_kind_subject

    def _hoisted_count(self, foreground: Foreground) -> int:
        if foreground.kind is None:
            return 0
        if foreground.subject is not None:
            return self._by_subject.count(foreground.subject)
        return self._by_kind.count(foreground.kind)

    def _hoisted_by_both(self, a: Foreground, b: Foreground) -> int:
        if a.kind is None or b.kind is None:
            return 0
        if a.subject is not None and b.subject is not None:  # by subject: the same set or disjoint
            return self._by_subject.count(a.subject) if a.subject == b.subject else 0
        if a.subject is None and b.subject is None:  # by kind: the same set or disjoint
            return self._by_kind.count(a.kind) if a.kind is b.kind else 0
        kind_only, subject = (a, b.subject) if a.subject is None else (b, a.subject)
        return self._by_kind_subject.count((kind_only.kind, subject))

    def moved_by(self, before: Foreground, after: Foreground) -> bool:
        """Whether changing the foreground from `before` to `after` moves some queued job in
        or out of T1 (R4: a change that alters no tier is no event). From counts, O(1):
        the two hoisted sets differ exactly when they are not both their intersection."""
        both = self._hoisted_by_both(before, after)
        return self._hoisted_count(before) != both or self._hoisted_count(after) != both

    def hoisted_head(self, foreground: Foreground, model: str | None = None) -> Entry | None:
        """The first T1 job (among those wanting `model`, when given: a device with free
        slots takes the best job on its own model, R21)."""
        if foreground.kind is None:
            return None
        if foreground.subject is not None:
            if model is None:
                return self._by_subject.head(foreground.subject)
            return self._by_subject_model.head((foreground.subject, model))
        if model is None:
            return self._by_kind.head(foreground.kind)
        return self._by_kind_model.head((foreground.kind, model))

    def head(self, tier: Tier, foreground: Foreground, now: float, model: str | None = None) -> Entry | None:
        """The first job of `tier` (among jobs wanting `model`, when given). Valid when every
        lower-numbered tier is empty in the same scope: the picker asks in tier order."""
        if tier is Tier.CHAT:
            return self._chat.head(model)
        if tier is Tier.FOREGROUND:
            return self.hoisted_head(foreground, model)
        if tier is Tier.EXTRACT:
            return self._extract.head(model)
        if tier is Tier.DEADLINE:
            first = self._deadlines.head(model)
            return first if first is not None and first.job.deadline <= now else None
        return self.pool.head(model)

    def next_deadline_after(self, now: float) -> float | None:
        """The earliest queued deadline strictly after `now` (R5's wake-up)."""
        entry = self._deadlines.first_key_after((now, float("inf")))
        return entry.job.deadline if entry is not None else None
