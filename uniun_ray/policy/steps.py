"""R23: how many other jobs may decode beside a device's chats.

The runtime measures, per model and device, the time of one decode step at several batch
sizes (as it measures swap cost) and gives it to the policy. A chat's tokens must come no
slower than the larger of `slack` x its step alone and `floor` seconds (a step faster than the
floor is faster than anyone reads, so it need not be kept fast at the background's cost), so
beside c chats running with n other jobs the policy keeps the largest k <= n with
step(c + k) <= max(slack x step(c), floor), and lets one more join only while step(c + n + 1)
keeps it too.
Between measured sizes the step time is interpolated linearly; past the largest it is
extrapolated from the last two (a step grows at least as fast as it did). Without a profile
nothing runs beside a chat (k = 0): chat's latency is the product, and an unmeasured device
cannot promise it.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping


def check_profile(profile: object) -> dict[int, float]:
    if not isinstance(profile, Mapping) or not profile:
        raise ValueError(f"a step profile maps batch sizes to seconds per step, got {profile!r}")
    checked = {}
    for batch, seconds in profile.items():
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"step profile: a batch size must be an int >= 1, got {batch!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds <= 0:
            raise ValueError(f"step profile: batch {batch}: seconds must be a finite number > 0, got {seconds!r}")
        checked[batch] = float(seconds)
    return dict(sorted(checked.items()))


def step_time(profile: dict[int, float], batch: int) -> float:
    """Seconds per step at `batch`, from the measured sizes (sorted)."""
    sizes = list(profile)
    if batch in profile:
        return profile[batch]
    if batch < sizes[0] or len(sizes) == 1:
        return profile[sizes[0]] * max(1.0, batch / sizes[0])
    i = bisect.bisect_left(sizes, batch)
    lo, hi = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])
    slope = max(0.0, (profile[hi] - profile[lo]) / (hi - lo))
    return profile[lo] + slope * (batch - lo)


class StepProfiles:
    def __init__(self, slack: float, floor: float) -> None:
        self._slack = slack
        self._floor = floor
        self._profiles: dict[tuple[str, str], dict[int, float]] = {}

    def set(self, model_id: str, device: str, profile: Mapping[int, float]) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
        self._profiles[(model_id, device)] = check_profile(profile)

    def get(self, model_id: str | None, device: str) -> dict[int, float] | None:
        return self._profiles.get((model_id, device)) if model_id is not None else None

    def bound(self, model_id: str | None, device: str, chats: int) -> float | None:
        """Seconds a step beside `chats` chats may take: max(slack x step(chats), floor); None
        without a profile."""
        profile = self.get(model_id, device)
        return None if profile is None else max(self._slack * step_time(profile, chats), self._floor)

    def companions(self, model_id: str | None, device: str, chats: int, slots: int, others: int) -> int:
        """How many of `others` other jobs may decode beside `chats` chats: the most, m, whose
        step(chats + m) keeps the bound. Not the first m past which the next would break it:
        a measured profile need not grow with the rows (oneDNN runs 3 rows slower than 4 on
        some CPUs; a size served rarely has a noisy median), and a chat that found four jobs
        running keeps three of them where step(4) keeps the bound, whatever step(2) says."""
        keeps = self._keeps(model_id, device, chats)
        if keeps is None:
            return 0
        return max(m for m in range(min(others, slots - chats) + 1) if m == 0 or keeps(chats + m))

    def room_beside(self, model_id: str | None, device: str, chats: int, slots: int, others: int) -> bool:
        """Whether one more job may join `others` beside `chats` chats within the bound."""
        keeps = self._keeps(model_id, device, chats)
        return keeps is not None and chats + others < slots and keeps(chats + others + 1)

    def _keeps(self, model_id: str | None, device: str, chats: int) -> Callable[[int], bool] | None:
        """Whether a step of so many rows keeps the bound beside `chats` chats; None without a profile."""
        profile, bound = self.get(model_id, device), self.bound(model_id, device, chats)
        if profile is None or bound is None:
            return None
        return lambda rows: step_time(profile, rows) <= bound * (1 + 1e-12)
