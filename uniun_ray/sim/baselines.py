"""Baseline policies with the SPEC §1 API, to measure the real policy against.

* `TwoLaneQueue`: the app's old ``local_inference_queue`` that issue #118 is about.
* `Fifo`: one queue, first come first served, nothing ever preempted.
* `StrictPriority`: the shape of vLLM's ``priority`` scheduling policy: fixed tiers,
  preemption on arrival, and nothing else (no fair share, no T2 budget, no model
  affinity, no deadlines).

None of them looks at model affinity: each swaps whenever the next job wants another
model. They share the bookkeeping of `_Baseline` and differ only in how they order jobs
and whether an arrival preempts.
"""
from __future__ import annotations

from sortedcontainers import SortedKeyList

from uniun_ray.policy import Dispatch, Foreground, Job, Kind, Requeued, Revoke, RevokeCause, tier_of


class _Queue:
    """Jobs in submit order; a revoked job goes back to its original place."""

    def __init__(self, order: dict[str, int]) -> None:
        self._jobs = SortedKeyList(key=lambda job: order[job.id])

    def add(self, job: Job) -> None:
        self._jobs.add(job)

    def discard(self, job: Job) -> bool:
        if job in self._jobs:
            self._jobs.remove(job)
            return True
        return False

    def first(self) -> Job | None:
        return self._jobs[0] if self._jobs else None

    def __iter__(self):
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)


class _Baseline:
    """Time checks, the running job, the loaded model, revoke and re-queue (R6, which the
    baselines follow too so that only the ordering differs)."""

    name = "baseline"

    def __init__(self, config=None) -> None:  # config: built like SchedulerPolicy(config)
        self._now: float | None = None
        self._order: dict[str, int] = {}  # job id -> submit number
        self._submitted = 0
        self._jobs: dict[str, Job] = {}
        self._running: Job | None = None
        self._revoked = False
        self._cancelled: set[str] = set()
        self._loaded: str | None = None
        self._foreground = Foreground()

    # -- what a baseline decides -----------------------------------------------------------
    def _queues(self) -> list[_Queue]:
        raise NotImplementedError

    def _enqueue(self, job: Job) -> None:
        raise NotImplementedError

    def _pick(self) -> Job | None:
        raise NotImplementedError

    def _preempts(self, job: Job) -> bool:
        return False

    def set_step_profile(self, model_id: str, device: str, profile, now: float | None = None) -> list:
        """A baseline runs one job at a time: step times at larger batches change nothing."""
        return []

    # -- the API ---------------------------------------------------------------------------
    def submit(self, job: Job, now: float) -> list:
        self._advance(now)
        if job.id in self._jobs:
            raise ValueError(f"duplicate job id {job.id!r}")
        self._order[job.id] = self._submitted
        self._submitted += 1
        self._jobs[job.id] = job
        self._enqueue(job)
        if self._running is None:
            return self._dispatch()
        if not self._revoked and self._preempts(job):
            self._revoked = True
            return [Revoke(self._running.id, RevokeCause.ARRIVAL)]
        return []

    def finish(self, job_id: str, now: float, outcome: str) -> list:
        self._advance(now)
        job = self._running
        if job is None or job.id != job_id:
            raise ValueError(f"finish({job_id!r}): the job is not running")
        if outcome == "revoked" and not self._revoked:
            raise ValueError(f"finish({job_id!r}, 'revoked'): the job was never revoked")
        self._running, self._revoked = None, False
        if outcome == "revoked" and job.kind is not Kind.CHAT and job_id not in self._cancelled:
            self._enqueue(job)
            return [Requeued(job_id), *self._dispatch()]
        self._forget(job_id)
        return self._dispatch()

    def cancel(self, job_id: str, now: float, cause: RevokeCause = RevokeCause.CANCEL) -> list:
        self._advance(now)
        job = self._jobs.get(job_id)
        if job is None:
            raise ValueError(f"cancel({job_id!r}): unknown job")
        if job is self._running:
            self._cancelled.add(job_id)
            if self._revoked:
                return []
            self._revoked = True
            return [Revoke(job_id, cause)]
        for queue in self._queues():
            if queue.discard(job):
                break
        self._forget(job_id)
        return []

    def set_foreground(self, kind, now: float, subject: str | None = None) -> list:
        self._advance(now)
        self._foreground = Foreground(None if kind is None else Kind.parse(kind), subject)
        return self._dispatch() if self._running is None else []

    def tick(self, now: float) -> list:
        self._advance(now)
        return []

    def next_wakeup(self) -> float | None:
        return None

    def snapshot(self) -> dict:
        return {
            "policy": self.name, "now": self._now, "loaded_model": self._loaded,
            "running": self._running.id if self._running else None,
            "queued": sum(len(q) for q in self._queues()),
        }

    # -- shared mechanics ------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        if self._now is not None and now < self._now:
            raise ValueError(f"time went backwards: now={now} is before {self._now}")
        self._now = now

    def _forget(self, job_id: str) -> None:
        del self._jobs[job_id]
        del self._order[job_id]
        self._cancelled.discard(job_id)

    def _dispatch(self) -> list:
        if self._running is not None:
            return []
        job = self._pick()
        if job is None:
            return []
        swap = job.model_id != self._loaded
        self._loaded = job.model_id
        self._running = job
        return [Dispatch(job.id, job.model_id, swap, tier_of(job, self._foreground, self._now))]


class TwoLaneQueue(_Baseline):
    """The old queue (issue #118): `runHigh` and `runLow` lanes, each FIFO, high before
    low, never preempting. While the chat page is in front, the low lane is paused
    (``pauseLowPriority``), even if that leaves the device idle. Chat and, because of the
    bug, Nataraj (``highPriority: true``, to dodge that pause) use the high lane; extract
    and Gana use the low lane."""

    name = "two-lane"
    HIGH_KINDS = (Kind.CHAT, Kind.NATARAJ)

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._high = _Queue(self._order)
        self._low = _Queue(self._order)

    def _queues(self) -> list[_Queue]:
        return [self._high, self._low]

    def _enqueue(self, job: Job) -> None:
        (self._high if job.kind in self.HIGH_KINDS else self._low).add(job)

    def _pick(self) -> Job | None:
        lanes = [self._high] if self._foreground.kind is Kind.CHAT else [self._high, self._low]
        for lane in lanes:
            job = lane.first()
            if job is not None:
                lane.discard(job)
                return job
        return None


class Fifo(_Baseline):
    """One queue in submit order; the running job always finishes."""

    name = "fifo"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._queue = _Queue(self._order)

    def _queues(self) -> list[_Queue]:
        return [self._queue]

    def _enqueue(self, job: Job) -> None:
        self._queue.add(job)

    def _pick(self) -> Job | None:
        job = self._queue.first()
        if job is not None:
            self._queue.discard(job)
        return job


class StrictPriority(_Baseline):
    """vLLM's ``priority`` policy, shaped for these kinds: chat (0) > the foreground's
    jobs (1, the same hoisting rule as R1) > extract (2) > everything else (3); FIFO within
    a level; an arrival at a better level revokes the running job, which is re-queued at
    its place. A pick scans the queue (baselines need not be O(log n))."""

    name = "strict-priority"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._queue = _Queue(self._order)

    def _level(self, job: Job) -> int:
        # R1's tiers without deadlines (T3 and T4 merge): no deadline is ever "passed".
        return min(int(tier_of(job, self._foreground, float("-inf"))), 3)

    def _queues(self) -> list[_Queue]:
        return [self._queue]

    def _enqueue(self, job: Job) -> None:
        self._queue.add(job)

    def _pick(self) -> Job | None:
        best, best_level = None, 4
        for job in self._queue:
            level = self._level(job)
            if level < best_level:
                best, best_level = job, level
                if level == 0:
                    break
        if best is not None:
            self._queue.discard(best)
        return best

    def _preempts(self, job: Job) -> bool:
        return self._level(job) < self._level(self._running)


#: Every baseline by its name.
BASELINES = {cls.name: cls for cls in (TwoLaneQueue, Fifo, StrictPriority)}
