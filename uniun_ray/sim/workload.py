"""What a simulation is fed: jobs that arrive on their own, producers that keep work
queued, and the pages the user opens. Plain data, saved and loaded as JSON so a workload
is a file that can be diffed, shared and replayed.

Two ways jobs arrive, because producers behave in two ways:

* `Arrival` (open loop): a job submitted at a fixed time whatever happens, e.g. a backfill
  loop that submits one note per second, or a cron tick.
* `Flow` (closed loop): a producer that keeps up to `depth` jobs outstanding and submits
  its next step `think_s` after one of its jobs ends, e.g. Nataraj keeping N cards queued,
  a Gana agent loop (depth 1), or a chat conversation (depth 1, think = the user reading
  and typing). Its job ids are ``f"{producer}#{n}"`` for its n-th job. A backlogged
  producer `cycle`s through its steps until `stop`, so a day of it stays a small file.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..policy import Job


@dataclass(frozen=True)
class SimJob:
    """A job of a workload: the policy's own `Job` (the one job record; its deadline on the
    simulation's clock) and the work it carries, which only the simulator needs."""

    job: Job
    prompt_tokens: int
    output_tokens: int

    @classmethod
    def from_dict(cls, d: dict) -> "SimJob":
        return cls(Job(**d["job"]), d["prompt_tokens"], d["output_tokens"])


@dataclass(frozen=True)
class Arrival:
    t: float
    job: SimJob


@dataclass(frozen=True)
class FlowStep:
    """One job of a flow. `think_s` is the delay before it is submitted, counted from the
    moment a slot frees (the flow's start for the first `depth` steps). Even at 0 the job
    arrives after the policy has handled the finish that freed the slot (a producer hears
    of the end first), so the pick made at that finish does not see it. `deadline_in_s`,
    when set, makes the deadline `submit time + deadline_in_s`."""

    prompt_tokens: int
    output_tokens: int
    think_s: float = 0.0
    deadline_in_s: float | None = None


@dataclass(frozen=True)
class Flow:
    producer: str
    kind: str
    model: str
    start: float
    steps: tuple[FlowStep, ...]
    depth: int = 1
    stop: float | None = None  # no submission after this time
    foreground_hint: bool = False
    subject: str | None = None
    cycle: bool = False  # after the last step, start again from the first
    conversation: bool = False  # each step's prompt starts with the previous step's prompt + output

    def __post_init__(self) -> None:
        if self.cycle and self.stop is None:
            raise ValueError(f"flow {self.producer!r}: a cycling flow needs a stop time")

    def has_step(self, n: int) -> bool:
        return self.cycle or n < len(self.steps)

    def job(self, n: int, now: float) -> SimJob:
        step = self.steps[n % len(self.steps)]
        deadline = None if step.deadline_in_s is None else now + step.deadline_in_s
        return SimJob(Job(f"{self.producer}#{n}", self.kind, self.model, self.producer, deadline,
                          self.foreground_hint, self.subject), step.prompt_tokens, step.output_tokens)


@dataclass(frozen=True)
class ForegroundChange:
    t: float
    kind: str | None
    subject: str | None = None


@dataclass(frozen=True)
class Workload:
    """`equal_flows` names groups of producers that are identical by construction (same
    model, same job sizes, backlogged over the same span): the fairness goal is checked
    on them."""

    name: str
    seed: int
    description: str
    arrivals: tuple[Arrival, ...] = ()
    flows: tuple[Flow, ...] = ()
    foreground: tuple[ForegroundChange, ...] = ()
    equal_flows: tuple[tuple[str, ...], ...] = field(default=())

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Workload":
        d = json.loads(text)
        return cls(
            name=d["name"], seed=d["seed"], description=d["description"],
            arrivals=tuple(Arrival(a["t"], SimJob.from_dict(a["job"])) for a in d["arrivals"]),
            flows=tuple(Flow(**{**f, "steps": tuple(FlowStep(**s) for s in f["steps"])}) for f in d["flows"]),
            foreground=tuple(ForegroundChange(**c) for c in d["foreground"]),
            equal_flows=tuple(tuple(g) for g in d["equal_flows"]),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        return cls.from_json(Path(path).read_text())
