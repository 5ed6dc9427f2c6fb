"""The scheduling policy: pure Python, explicit time, no Ray and no torch (SPEC §1).

The SchedulerActor, the simulator and users' own what-if studies all drive this one core.
"""
from .scheduler import SchedulerPolicy
from .tiers import Foreground, Tier, tier_of
from .types import (POOL_KINDS, Action, Dispatch, Job, Kind, Outcome, PolicyConfig, Requeued, Revoke,
                    RevokeCause)

__all__ = [
    "Action", "Dispatch", "Foreground", "Job", "Kind", "Outcome", "POOL_KINDS", "PolicyConfig",
    "Requeued", "Revoke", "RevokeCause", "SchedulerPolicy", "Tier", "tier_of",
]
