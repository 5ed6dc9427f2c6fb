"""A faithful Python port of the design notes' InferenceScheduler picker (scan and sort),
kept only as the baseline that `pick_cost.py` measures against. Its bugs are kept too
(a T2 budget that can stall, vruntime per kind only, every pick re-scans the queue)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(eq=False)
class NotesJob:
    id: str
    kind: str
    model_id: str
    deadline: float | None = None
    foreground_hint: bool = False


class NotesScheduler:
    def __init__(self) -> None:
        self.q: list[NotesJob] = []
        self.vruntime: dict[str, float] = {}
        self.t2_samples: deque = deque()  # (at, t2_seconds, total_seconds)
        self.foreground: str | None = None
        self.loaded_model_id: str | None = None
        self.running: NotesJob | None = None
        self.started = 0.0

    def _tier(self, j: NotesJob, now: float) -> int:
        if j.kind == "chat":
            return 0
        if self.foreground == j.kind or (j.foreground_hint and self.foreground == j.kind):
            return 1
        if j.kind == "extract":
            return 2
        if j.deadline is not None and now > j.deadline:
            return 3
        return 4

    def _t2_budget_exceeded(self, now: float) -> bool:
        while self.t2_samples and self.t2_samples[0][0] < now - 300:
            self.t2_samples.popleft()
        t2 = sum(s[1] for s in self.t2_samples)
        total = sum(s[2] for s in self.t2_samples)
        return total > 0 and t2 / total > 0.60

    def _pick_best(self, now: float) -> NotesJob | None:
        blown = self._t2_budget_exceeded(now)
        for tier in range(5):
            if tier == 2 and blown:
                continue
            in_tier = [j for j in self.q if self._tier(j, now) == tier]
            if not in_tier:
                continue
            same = [j for j in in_tier if j.model_id == self.loaded_model_id]
            return self._resolve(same or in_tier, tier)
        return None

    def _resolve(self, jobs: list[NotesJob], tier: int) -> NotesJob:
        if tier == 4:
            jobs.sort(key=lambda j: self.vruntime.get(j.kind, 0.0))
        return jobs[0]

    def run(self, job: NotesJob, now: float) -> None:
        self.q.append(job)
        if self.running is None:
            self._pump(now)

    def _pump(self, now: float) -> None:
        if self.running is not None:
            return
        nxt = self._pick_best(now)
        if nxt is None:
            return
        self.q.remove(nxt)
        self.running = nxt
        self.started = now
        self.loaded_model_id = nxt.model_id

    def finish_running(self, now: float) -> None:
        j, secs = self.running, now - self.started
        self.vruntime[j.kind] = self.vruntime.get(j.kind, 0.0) + secs
        self.t2_samples.append((now, secs if self._tier(j, now) == 2 else 0.0, secs))
        self.running = None
        self._pump(now)
