"""What crosses actor boundaries: jobs (the policy's `Job`), leases and the errors clients see.

Plain dataclasses, validated where they are built (in the caller's process), so a bad
argument fails before anything is queued and before any actor is called.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

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


class DeviceGone(DeviceLost):
    """The ModelActor is gone for good (killed without restart, or its node left the
    cluster): the scheduler removes its device from the pool and the job runs on another
    (R20)."""


class ModelUnavailable(UniunError):
    """The device could not load the job's model: its engine cannot run on that host (no vLLM
    environment), or the weights do not load. The job fails with the cause and what to do; a
    server answers 503, never 500: the request was fine, the deployment is not."""


class SchedulerUnavailable(UniunError):
    """The scheduler died and did not come back in time; the job was not completed and is
    not queued anywhere: retry it once the runtime is up again (`uniun-ray up`)."""


def new_job(kind, model_id: str, *, producer=None, deadline=None, foreground_hint=False, subject=None,
            job_id: str | None = None) -> Job:
    """The job a client submits: the policy's own `Job` (which validates every field, with
    the policy's messages), given a fresh id, with the runtime's one rule on top: a deadline
    is epoch seconds (time.time()). The `Job` is what crosses Ray to the scheduler; there is
    no second job record."""
    kind = Kind.parse(kind)
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not math.isfinite(deadline)):
        raise ValueError(f"deadline must be finite epoch seconds (time.time()), got {deadline!r}")
    if deadline is not None and deadline < MIN_EPOCH_S:
        raise ValueError(f"deadline must be epoch seconds (time.time() + delay), got {deadline!r}: "
                         f"a negative or relative value is a mistake")
    return Job(job_id or f"{kind.value}-{uuid.uuid4().hex[:12]}", kind, model_id, producer,
               None if deadline is None else float(deadline), foreground_hint, subject)


@dataclass(frozen=True)
class Lease:
    """The right to use one device of the pool for one job: the ModelActor named
    `model_actor_name(device)`. `epoch` fences it: that ModelActor only serves the newest
    epoch it was told about, and never one that was revoked."""

    job_id: str
    epoch: int
    model_id: str
    kind: str
    swap_s: float = 0.0
    renew_every_s: float = 10.0
    tier: int | None = None         # the tier the policy dispatched the job at (Dispatch.tier)
    device: str = "dev0"            # the device it holds (Dispatch.device)
