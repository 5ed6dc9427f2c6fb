"""The device driver: the one accelerator as the scheduler drives it.

It owns what the scheduler knows of the device: the model it holds (None when unknown:
after a failed load, or a device that died), each model's measured swap time, and the
lease epochs. Every grant is a new epoch announced to the device, which then serves only
that epoch; a revoke withdraws one. A (re)started scheduler first reads the newest epoch
the device saw, so its own epochs fence every older lease.
"""
from __future__ import annotations

from typing import Protocol


class Device(Protocol):
    """`load`, `grant` and `revoke` raise DeviceLost when the device died under the call.
    Optional: `async current_epoch() -> int`, the newest epoch the device was granted, which
    a (restarted) scheduler reads once so that its epochs fence every older lease."""

    async def load(self, model_id: str) -> float: ...
    async def grant(self, epoch: int) -> None: ...
    async def revoke(self, epoch: int) -> None: ...


class DeviceDriver:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.model: str | None = None          # what the device holds, as far as we know
        self.swap_s: dict[str, float] = {}     # the last measured load time per model
        self._epoch = 0
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
            self._epoch = max(self._epoch, await current() if current else 0)
            self._synced = True
        self._epoch += 1
        epoch = self._epoch
        await self.device.grant(epoch)
        return epoch

    async def revoke(self, epoch: int) -> None:
        await self.device.revoke(epoch)

    def lost(self) -> None:
        """The device died or a load failed: it holds no known model."""
        self.model = None
