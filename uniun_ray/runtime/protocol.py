"""What crosses actor boundaries: job specs, leases and the errors clients see.

Plain dataclasses, validated where they are built (in the caller's process), so a bad
argument fails before anything is queued and before any actor is called.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import asdict, dataclass

from ..policy import Job, Kind

#: Ray namespace and actor names (what the dashboard shows).
NAMESPACE = "uniun"
SCHEDULER_NAME = "scheduler"
EMBEDDER_NAME = "embedder"


#: Deadlines before this (2001-09-09) are not epoch seconds but a relative delay or a typo.
MIN_EPOCH_S = 1e9


def model_actor_name(device: str) -> str:
    return f"model:{device}"


class UniunError(RuntimeError):
    """Base of the runtime's own errors."""


class Preempted(UniunError):
    """A chat job was stopped by the scheduler. Chat is never preempted by other work, so
    this only happens when the job was cancelled or its lease was reclaimed."""


class JobDropped(UniunError):
    """The scheduler ended a job that its caller did not finish: the caller stopped polling
    (it died), its lease sat idle past the timeout, or it was cancelled."""


class LeaseRevoked(UniunError):
    """A model call was made with a lease that is no longer the current one (revoked,
    reclaimed, or superseded by a newer grant). The device refuses stale leases."""


class QueueFull(UniunError):
    """The per-kind queue bound was reached; nothing was queued."""


class UnknownJob(JobDropped):
    """The scheduler holds no record of the job: it restarted since the job was submitted
    (its queue lives in memory), or the id was never submitted. The client resubmits its
    own in-flight jobs when it sees this."""


class DeviceLost(UniunError):
    """The ModelActor died (or restarted) under a job: the job is re-queued, and the device
    reloads its model before the next grant."""


class SchedulerUnavailable(UniunError):
    """The scheduler died and did not come back in time; the job was not completed and is
    not queued anywhere: retry it once the runtime is up again (`uniun-ray up`)."""


@dataclass(frozen=True)
class JobSpec:
    """A job as a client submits it. `deadline` is epoch seconds (time.time())."""

    id: str
    kind: str
    model_id: str
    producer: str | None = None
    deadline: float | None = None
    foreground_hint: bool = False
    subject: str | None = None

    @classmethod
    def build(cls, kind, model_id: str, *, producer=None, deadline=None, foreground_hint=False,
              subject=None, job_id: str | None = None) -> "JobSpec":
        """Validate every field the way the policy will (by building its Job), so errors
        surface in the caller with the policy's own messages."""
        kind = Kind.parse(kind).value
        job_id = job_id or f"{kind}-{uuid.uuid4().hex[:12]}"
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not math.isfinite(deadline)):
            raise ValueError(f"deadline must be finite epoch seconds (time.time()), got {deadline!r}")
        if deadline is not None and deadline < MIN_EPOCH_S:
            raise ValueError(f"deadline must be epoch seconds (time.time() + delay), got {deadline!r}: "
                             f"a negative or relative value is a mistake")
        spec = cls(job_id, kind, model_id, producer, None if deadline is None else float(deadline),
                   foreground_hint, subject)
        spec.to_job()
        return spec

    def to_job(self) -> Job:
        return Job(self.id, self.kind, self.model_id, self.producer, self.deadline,
                   self.foreground_hint, self.subject)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Lease:
    """The right to use the device for one job. `epoch` fences it: the ModelActor only
    serves the newest epoch it was told about, and never one that was revoked."""

    job_id: str
    epoch: int
    model_id: str
    kind: str
    swap_s: float = 0.0
    renew_every_s: float = 10.0
