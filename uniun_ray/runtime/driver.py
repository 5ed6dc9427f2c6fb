"""The device driver: one device of the pool as the scheduler drives it.

It owns what the scheduler knows of its device: the model it holds (None when unknown:
after a failed load, or a device that died), each model's measured swap time, and the
epochs of the leases that hold its slots (SPEC §6). Every grant is a new epoch announced to
the device together with the epochs still live beside it: the device serves those and
fences every other (a slot's job revoked, released or lost, and every lease of an earlier
scheduler). A revoke withdraws one. The epochs come from one `EpochClock` shared by every
driver of the pool, so a lease's (job, epoch) names one grant even when its job moves
between devices. A (re)started scheduler first reads the newest epoch each device saw, so
its own epochs fence every older lease there.

A job joining a device whose model is still loading (the policy fills the other slots of a
device as soon as it dispatches the swap) waits for the load before its epoch is granted:
its lease never reaches a device that holds another model, or none.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from .protocol import DeviceLost

log = logging.getLogger(__name__)

class Device(Protocol):
    """`load`, `grant` and `revoke` raise DeviceLost when the device died under the call
    (DeviceGone when it will not come back). Optional: `async slots(setting) -> {"slots": S,
    "step_profile": {batch: seconds}}`, what the device chose for the model it just loaded
    (R23, R25; without it a device keeps the slots it was added with, and no profile);
    `async current_epoch() -> int`, the
    newest epoch the device was granted, which a (restarted) scheduler reads once so that
    its epochs fence every older lease; `async alive() -> bool`, False once the device is
    gone for good (answered at once: a restarting device is alive)."""

    async def load(self, model_id: str) -> float: ...
    async def grant(self, epoch: int, live: tuple[int, ...] = (), model: str | None = None) -> None: ...
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
    def __init__(self, device: Device, epochs: EpochClock | None = None, slots: int | None = None) -> None:
        """`slots`: the setting the device is asked to honour after each load (None: auto)."""
        self.device = device
        self.slots = slots
        self.model: str | None = None          # what the device holds, as far as we know
        self.swap_s: dict[str, float] = {}     # the last measured load time per model
        self.plan: dict | None = None           # what the device chose for its model: slots, step profile
        self.live: set[int] = set()           # epochs granted and not yet ended or revoked
        self._epochs = epochs or EpochClock()
        self._synced = False
        self._loaded = asyncio.Event()          # cleared while a load runs
        self._loaded.set()

    async def load(self, model_id: str) -> float:
        """Swap `model_id` in; its measured seconds. The device holds nothing known until
        it succeeds."""
        self.model, self.plan = None, None
        self._loaded.clear()
        try:
            seconds = await self.device.load(model_id)
            planned = getattr(self.device, "slots", None)
            self.plan = await planned(self.slots) if planned else None
            self.model = model_id
        finally:
            self._loaded.set()
        self.swap_s[model_id] = seconds
        return seconds

    async def fence(self, model_id: str | None = None, confirm: bool = False) -> int:
        """A new epoch for one slot, announced to the device with the live ones beside it:
        every other lease is refused from now on. Waits for a load in flight first; raises
        DeviceLost when the device then does not hold `model_id` (that load failed).

        The device's answer is awaited only when `confirm`, or on the first grant since this
        driver started: otherwise the lease goes out at once and the holder's first call may
        reach the device before its grant does (the device admits an epoch newer than all it
        saw). A grant that fails then fails the holder's call too, which reports the device."""
        await self._loaded.wait()
        if model_id is not None and self.model != model_id:
            raise DeviceLost(f"the device holds {self.model or 'no model'}, not {model_id}: its load failed")
        if not self._synced:  # (re)started: fence above every lease the device saw
            current = getattr(self.device, "current_epoch", None)
            self._epochs.above(await current() if current else 0)
            self._synced = confirm = True
        epoch = self._epochs.next()
        self.live.add(epoch)   # in the same step as the epoch: a newer grant names every older live one
        granting = asyncio.ensure_future(self.device.grant(epoch, tuple(sorted(self.live)), self.model))
        if confirm:
            await granting
        else:
            granting.add_done_callback(_unconfirmed)
        return epoch

    async def revoke(self, epoch: int) -> None:
        self.live.discard(epoch)
        await self.device.revoke(epoch)

    def ended(self, epoch: int) -> None:
        """A lease of this device ended (released, failed): the next grant fences it."""
        self.live.discard(epoch)

    async def gone(self) -> bool:
        """Whether the device is gone for good (its actor killed without restart), as opposed
        to restarting. Answered at once, without waiting for a restart: a holder waiting for
        this answer does not renew its lease."""
        alive = getattr(self.device, "alive", None)
        return alive is not None and not await alive()

    def lost(self) -> None:
        """The device died or a load failed: it holds no known model, and no live lease."""
        self.model = None
        self.live.clear()


def _unconfirmed(granting: asyncio.Future) -> None:
    """An unconfirmed grant's failure: its holder's call to the device fails as well, and
    reports it (`device_lost`); only logged here."""
    if not granting.cancelled() and granting.exception() is not None:
        log.info("an unconfirmed grant failed: %s", granting.exception())
