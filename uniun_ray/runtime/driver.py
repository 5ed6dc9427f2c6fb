"""The device driver: one device of the pool as the scheduler drives it.

It owns what the scheduler knows of its device: the model it holds (None when unknown:
after a failed load, or a device that died) and each model's measured swap time. Every
grant is a new epoch announced to the device, which then serves only that epoch; a revoke
withdraws one. The epochs come from one `EpochClock` shared by every driver of the pool,
so a lease's (job, epoch) names one grant even when its job moves between devices. A
(re)started scheduler first reads the newest epoch each device saw, so its own epochs
fence every older lease there.
"""
from __future__ import annotations

from typing import Protocol



class Device(Protocol):
    """`load`, `grant` and `revoke` raise DeviceLost when the device died under the call
    (DeviceGone when it will not come back). Optional: `async current_epoch() -> int`, the
    newest epoch the device was granted, which a (restarted) scheduler reads once so that
    its epochs fence every older lease; `async alive() -> bool`, False once the device is
    gone for good (answered at once: a restarting device is alive)."""

    async def load(self, model_id: str) -> float: ...
    async def grant(self, epoch: int) -> None: ...
    async def revoke(self, epoch: int) -> None: ...


class EpochClock:
    """The pool's lease epochs: one increasing counter, raised above what any device saw."""

    def __init__(self) -> None:
        self.last = 0

    def above(self, seen: int) -> None:
        self.last = max(self.last, seen)

    def next(self) -> int:
        self.last += 1
        return self.last


class DeviceDriver:
    def __init__(self, device: Device, epochs: EpochClock | None = None) -> None:
        self.device = device
        self.model: str | None = None          # what the device holds, as far as we know
        self.swap_s: dict[str, float] = {}     # the last measured load time per model
        self._epochs = epochs or EpochClock()
        self._synced = False

    async def load(self, model_id: str) -> float:
        """Swap `model_id` in; its measured seconds. The device holds nothing known until
        it succeeds."""
        self.model = None
        seconds = await self.device.load(model_id)
        self.model = model_id
        self.swap_s[model_id] = seconds
        return seconds

    async def fence(self) -> int:
        """A new epoch, announced to the device: every older lease is refused from now on."""
        if not self._synced:  # (re)started: fence above every lease the device saw
            current = getattr(self.device, "current_epoch", None)
            self._epochs.above(await current() if current else 0)
            self._synced = True
        epoch = self._epochs.next()
        await self.device.grant(epoch)
        return epoch

    async def revoke(self, epoch: int) -> None:
        await self.device.revoke(epoch)

    async def gone(self) -> bool:
        """Whether the device is gone for good (its actor killed without restart), as opposed
        to restarting. Answered at once, without waiting for a restart: a holder waiting for
        this answer does not renew its lease."""
        alive = getattr(self.device, "alive", None)
        return alive is not None and not await alive()

    def lost(self) -> None:
        """The device died or a load failed: it holds no known model."""
        self.model = None
