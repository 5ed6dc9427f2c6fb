"""The policy's vocabulary: job kinds, jobs, configuration and the actions it emits.

Everything here is plain data. A `Job` validates itself on construction so that bad
input is rejected before it can touch any scheduler state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from numbers import Real
from typing import Mapping


class Kind(str, Enum):
    """Who produced a job. The kind decides the job's tier (R1)."""

    CHAT = "chat"
    NATARAJ = "nataraj"
    GANA = "gana"
    EXTRACT = "extract"

    @classmethod
    def parse(cls, value: "Kind | str") -> "Kind":
        """Accept a Kind or its string value; anything else is a ValueError naming the choices."""
        if isinstance(value, Kind):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown kind {value!r}; expected one of: {choices}") from None


class Tier(IntEnum):
    """Strict order (R2): a lower number always runs first. It lives here, beside the
    actions, because a `Dispatch` carries the tier its job was dispatched at."""

    CHAT = 0
    FOREGROUND = 1
    EXTRACT = 2
    DEADLINE = 3
    FAIR = 4

    @property
    def label(self) -> str:
        return f"T{int(self)}"


#: Kinds that live in the fair pool (T4) unless hoisted or past a deadline. Only these
#: kinds carry vruntime: chat and extract are strict tiers with no fair share.
POOL_KINDS = (Kind.NATARAJ, Kind.GANA)


class Outcome(str, Enum):
    """How a dispatched job ended, as reported by the runtime to `finish`."""

    DONE = "done"
    FAILED = "failed"
    REVOKED = "revoked"

    @classmethod
    def parse(cls, value: "Outcome | str") -> "Outcome":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(o.value for o in cls)
            raise ValueError(f"unknown outcome {value!r}; expected one of: {choices}") from None


def check_time(value: object, what: str) -> float:
    """A time is a finite real number (bools are not times)."""
    if type(value) is float and math.isfinite(value):
        return value  # the hot path: every policy call checks its `now`
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of seconds, got {value!r}")
    return float(value)


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Job:
    """One unit of model work, as submitted by a producer.

    `producer` is the fair-share flow inside the kind ("gana:42"); it defaults to the kind's
    name so that a kind with a single producer needs no extra bookkeeping. `deadline` is an
    absolute time on the same clock as the policy's `now`.
    """

    id: str
    kind: Kind
    model_id: str
    producer: str | None = None
    deadline: float | None = None
    foreground_hint: bool = False
    subject: str | None = None

    def __post_init__(self) -> None:
        _check_name(self.id, "job id")
        object.__setattr__(self, "kind", Kind.parse(self.kind))
        _check_name(self.model_id, f"job {self.id!r}: model_id")
        producer = self.kind.value if self.producer is None else self.producer
        object.__setattr__(self, "producer", _check_name(producer, f"job {self.id!r}: producer"))
        if self.deadline is not None:
            object.__setattr__(self, "deadline", check_time(self.deadline, f"job {self.id!r}: deadline"))
        if not isinstance(self.foreground_hint, bool):
            raise ValueError(f"job {self.id!r}: foreground_hint must be a bool, got {self.foreground_hint!r}")
        if self.subject is not None:
            _check_name(self.subject, f"job {self.id!r}: subject")


@dataclass(frozen=True)
class PolicyConfig:
    """Tunables of R14. `weights` maps a kind's value or a producer id to a fair-share
    weight (default 1.0); a flow's vruntime grows by held time / weight (R8)."""

    window_s: float = 300.0
    t2_share: float = 0.6
    decay_period_s: float = 300.0
    absence_s: float = 300.0
    max_affinity_wait_s: float = 60.0
    weights: Mapping[str, float] = field(default_factory=dict)
    chat_step_slack: float = 1.25  # R23: a chat's step beside others <= this x its step alone ...
    chat_step_floor_s: float = 0.075  # ... or <= this, whichever is larger (faster than one reads)
    #: R12: the swap cost that earns the whole `max_affinity_wait_s` (the costliest swap, a cold
    #: load); a cheaper measured swap's bound shrinks in proportion (`picker.affinity_bound`).
    affinity_full_swap_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("window_s", "decay_period_s", "affinity_full_swap_s"):
            if check_time(getattr(self, name), name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("absence_s", "max_affinity_wait_s", "chat_step_floor_s"):
            if check_time(getattr(self, name), name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if check_time(self.chat_step_slack, "chat_step_slack") < 1.0:
            raise ValueError(f"chat_step_slack must be >= 1, got {self.chat_step_slack!r}")
        if not 0.0 <= check_time(self.t2_share, "t2_share") <= 1.0:
            raise ValueError(f"t2_share must be within [0, 1], got {self.t2_share!r}")
        if not isinstance(self.weights, Mapping):
            raise ValueError(f"weights must map kinds or producer ids to weights > 0, got {self.weights!r}")
        for flow, weight in dict(self.weights).items():
            if not isinstance(flow, str) or not flow:
                raise ValueError(f"weights: a key must be a kind or a producer id (a non-empty string), got {flow!r}")
            if check_time(weight, f"weight of {flow!r}") <= 0:
                raise ValueError(f"weight of {flow!r} must be > 0, got {weight!r}")

    def weight(self, flow: str) -> float:
        return float(self.weights.get(flow, 1.0))


class RevokeCause(str, Enum):
    """Why the policy revoked a running job, so that no caller parses it back out of text.

    The first four are the R4 events; CANCEL and RECLAIM are the caller's own withdrawal
    (`cancel`), RECLAIM when the runtime takes back the lease of a holder that died. STEP:
    a running chat's step would exceed its bound with the job beside it (R23)."""

    ARRIVAL = "arrival"
    FOREGROUND = "foreground"
    DEADLINE = "deadline"
    AFFINITY = "affinity"  # an outranking queued job's affinity wait ended (R4, R12)
    CANCEL = "cancel"
    RECLAIM = "reclaim"
    STEP = "step"  # R23: a running chat's step beside it would exceed its bound


#: The causes a caller may give to `cancel`.
WITHDRAWALS = (RevokeCause.CANCEL, RevokeCause.RECLAIM)


@dataclass(frozen=True)
class Dispatch:
    """Run `job_id` now on `device`, with `model_id`; when `swap` is true, load that model
    there first (only ever on an empty device). `tier` is the job's tier at this dispatch:
    what the T2 budget counts it as (R11). `device` defaults to the name of a one-device
    pool's device; `slot` is the device's slot it takes (R21; 0 with one slot)."""

    job_id: str
    model_id: str
    swap: bool
    tier: Tier
    device: str = "dev0"
    slot: int = 0


@dataclass(frozen=True)
class Revoke:
    """Stop the running job `job_id` at its next token boundary, then report `finish`."""

    job_id: str
    cause: RevokeCause


@dataclass(frozen=True)
class Requeued:
    """The revoked job `job_id` went back into its queue at its original place (R6); it
    will be dispatched again. `finish` returns it, before any Dispatch, so that no caller
    re-derives which jobs are re-queued (a chat never is, a cancelled job never is)."""

    job_id: str


Action = Dispatch | Revoke | Requeued
