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

Grant notices are coalesced: one call to the device costs both processes about a bare actor
call's CPU, as much as the rest of a job's control path. The first grant after a quiet spell
is announced at once; one within `notice_period_s` of the last notice waits for the next,
which names the newest epoch and every live one (what each grant in between would have
said). The device admits a newer epoch than any it was told meanwhile, as it does a holder's
call that overtakes its grant; a revoke sends the notice still waiting first, so the device
knows an epoch before it fences it.

A job joining a device whose model is still loading (the policy fills the other slots of a
device as soon as it dispatches the swap) waits for the load before its epoch is granted:
its lease never reaches a device that holds another model, or none.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ..models.swap import COLD, SWITCH, WARM, Swap
from .protocol import DeviceLost

log = logging.getLogger(__name__)

#: What the first switch to a co-resident model is priced at before any switch was measured on
#: the device: only the active model changes (1-2 ms measured on a 2-core CPU, BENCHMARKS.md
#: "Swaps"); a conservative 10 ms.
FIRST_SWITCH_S = 0.01
#: Host-to-device bytes per second a first warm copy is priced at before any copy of known size
#: was measured on the device: a pinned copy over PCIe 3 x16 runs ~12 GB/s, a CPU's copy is empty;
#: a conservative 2 GB/s.
COPY_BYTES_PER_S = 2e9

class Device(Protocol):
    """`load`, `grant` and `revoke` raise DeviceLost when the device died under the call
    (DeviceGone when it will not come back). Optional: `async slots(setting) -> {"slots": S,
    "step_profile": {batch: seconds}}`, what the device chose for the model it just loaded
    (R23, R25; without it a device keeps the slots it was added with, and no profile);
    `async steps() -> {"model": model_id, "step_profile": {batch: seconds}}`, the step times it
    serves now (R23); `async current_epoch() -> int`, the
    newest epoch the device was granted, which a (restarted) scheduler reads once so that
    its epochs fence every older lease; `async alive() -> bool`, False once the device is
    gone for good (answered at once: a restarting device is alive); `async abandon(model_id)`,
    which stops a load of that model in flight (its `load` raises SwapAbandoned)."""

    async def load(self, model_id: str) -> Swap: ...
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
    def __init__(self, device: Device, epochs: EpochClock | None = None, slots: int | None = None,
                 notice_period_s: float = 0.0) -> None:
        """`slots`: the setting the device is asked to honour after each load (None: auto);
        `notice_period_s`: the least time between two unconfirmed grant notices (0: one per grant)."""
        self.device = device
        self.slots = slots
        self.notice_period_s = notice_period_s
        self.model: str | None = None          # what the device holds, as far as we know
        self.swap_s: dict[str, float] = {}     # the last measured load time per model
        self.measured: dict[tuple[str, str], float] = {}   # (model, swap kind) -> the last seconds
        self.last_swap: Swap | None = None      # what the device kept warm after it (`Swap.kept`)
        self.copy_bytes_per_s: float | None = None   # measured by a warm copy of known size
        self.plan: dict | None = None           # what the device chose for its model: slots, step profile
        self._steps_asked: float | None = None  # when the device was last asked for its steps ...
        self._steps_asking = False              # ... and whether that answer is still on its way
        self.live: set[int] = set()           # epochs granted and not yet ended or revoked
        self._epochs = epochs or EpochClock()
        self._synced = False
        self._loaded = asyncio.Event()          # cleared while a load runs ...
        self._loaded.set()
        self.loading: str | None = None         # ... of this model
        self.abandoned: str | None = None       # the model whose load was given up, until the next load
        self._newest = 0                        # the newest epoch granted here ...
        self._told = 0                          # ... and the newest the device was sent
        self._next_notice = 0.0                 # loop time before which a notice waits
        self._waiting: asyncio.TimerHandle | None = None   # the notice that waits

    async def load(self, model_id: str) -> Swap:
        """Swap `model_id` in; what the swap was (its kind and measured seconds). The device
        holds nothing known until it succeeds."""
        self.model, self.plan = None, None
        self._drop_notice()   # it names ended leases only: the grant after the load fences them
        self._loaded.clear()
        self.loading, self.abandoned = model_id, None
        try:
            swap = await self.device.load(model_id)
            planned = getattr(self.device, "slots", None)
            self.plan = await planned(self.slots) if planned else None
            self.model = model_id
        finally:
            self._loaded.set()
            self.loading = None
        copied = self.last_swap.kept_bytes.get(model_id) if self.last_swap else None
        if swap.kind == WARM and copied and swap.seconds > 0:
            self.copy_bytes_per_s = copied / swap.seconds
        self.swap_s[model_id], self.last_swap = swap.seconds, swap
        self.measured[(model_id, swap.kind)] = swap.seconds
        return swap

    async def served_steps(self, now: float, period_s: float) -> dict[int, float] | None:
        """The step profile the device serves now for the model it holds (R23), asked at most
        once per `period_s` (on the `now` of a monotonic clock) and one answer at a time; None
        when not asked (a device without `steps`, or with no plan), or when the answer is no
        news: the same profile, or one of another model (a load came between)."""
        steps, model = getattr(self.device, "steps", None), self.model
        if steps is None or self.plan is None or model is None or self._steps_asking \
                or (self._steps_asked is not None and now - self._steps_asked < period_s):
            return None
        self._steps_asked, self._steps_asking = now, True
        try:
            answer = await steps()
        finally:
            self._steps_asking = False
        profile = {int(batch): seconds for batch, seconds in (answer.get("step_profile") or {}).items()}
        if not profile or answer.get("model") != model or self.model != model or self.plan is None \
                or profile == self.plan.get("step_profile"):
            return None
        self.plan = self.plan | {"step_profile": profile}
        return profile

    def swap_costs(self) -> dict[str, float]:
        """What a swap to each model measured here would cost now (R12: given to the policy):
        the kind it would be after the last swap (a switch or a warm copy for a model the
        device kept, else a cold load), at that model's last time of that kind, else (the
        first swap back) as `_first` estimates that kind."""
        if self.last_swap is None:
            return {}
        costs = {}
        for model in {m for m, _ in self.measured} - {self.model}:
            kind = self.last_swap.next_kind(model)
            cost = self.measured.get((model, kind), self._first(model, kind))
            if cost is not None:
                costs[model] = cost
        return costs

    def _first(self, model: str, kind: str) -> float | None:
        """A swap of `kind` to `model` before one was measured: a warm copy at its bytes over
        the copy rate measured here (else COPY_BYTES_PER_S); a switch, or a copy of unknown
        size, at the dearest of that kind measured here for any model (else FIRST_SWITCH_S for a
        switch); never above the model's cold load, which is the cost of anything else."""
        cold = self.measured.get((model, COLD))
        size = self.last_swap.kept_bytes.get(model) if kind == WARM else None
        seen = [s for (_, k), s in self.measured.items() if k == kind]
        if size:
            cost = size / (self.copy_bytes_per_s or COPY_BYTES_PER_S)
        elif seen:
            cost = max(seen)
        else:
            cost = FIRST_SWITCH_S if kind == SWITCH else None
        return cold if cost is None else cost if cold is None else min(cost, cold)

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
        epoch = self._newest = self._epochs.next()
        self.live.add(epoch)   # in the same step as the epoch: a newer grant names every older live one
        if confirm:
            await self._notify()
        else:
            self._announce()
        return epoch

    def _announce(self) -> None:
        """Tell the device of the new epoch now, or with the next notice when one went out
        within `notice_period_s` (then it is scheduled already, or scheduled here)."""
        if self._waiting is not None:
            return
        loop = asyncio.get_running_loop()
        delay = self._next_notice - loop.time()
        if delay > 0:
            self._waiting = loop.call_later(delay, self._send_waiting)
        else:
            self._notify().add_done_callback(_unconfirmed)

    def _send_waiting(self) -> None:
        self._waiting = None
        if self._told < self._newest and self.model is not None:
            self._notify().add_done_callback(_unconfirmed)

    def _notify(self) -> asyncio.Future:
        """Send the grant of the newest epoch, naming every live one (and itself: a grant
        always names its own epoch). Its call reaches the device before any call issued after
        this one returns (Ray keeps one caller's calls to an actor in order)."""
        self._drop_notice()
        self._told = self._newest
        self._next_notice = asyncio.get_running_loop().time() + self.notice_period_s
        return asyncio.ensure_future(self.device.grant(self._newest, tuple(sorted(self.live | {self._newest})),
                                                       self.model))

    def _drop_notice(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None

    async def revoke(self, epoch: int) -> None:
        self.live.discard(epoch)
        if self._waiting is not None:   # the device hears of the epoch before its revoke
            self._notify().add_done_callback(_unconfirmed)
        await asyncio.ensure_future(self.device.revoke(epoch))   # after the notice's call

    def ended(self, epoch: int) -> None:
        """A lease of this device ended (released, failed): the next grant fences it."""
        self.live.discard(epoch)

    async def gone(self) -> bool:
        """Whether the device is gone for good (its actor killed without restart), as opposed
        to restarting. Answered at once, without waiting for a restart: a holder waiting for
        this answer does not renew its lease."""
        alive = getattr(self.device, "alive", None)
        return alive is not None and not await alive()

    async def abandon(self, model_id: str) -> None:
        """Stop the load of `model_id` in flight, if that is what the device is loading and it
        can (R13: a chat must not wait for another model's swap)."""
        abandon = getattr(self.device, "abandon", None)
        if abandon is not None and self.loading == model_id:
            self.abandoned = model_id
            await abandon(model_id)

    def describe_swaps(self) -> dict:
        """For status: the last swap (its kind, time and what the device kept warm) and the last
        seconds measured per model and kind."""
        measured: dict[str, dict[str, float]] = {}
        for (model, kind), seconds in sorted(self.measured.items()):
            measured.setdefault(model, {})[kind] = seconds
        return {"last": self.last_swap.describe() if self.last_swap else None, "measured": measured}

    def lost(self) -> None:
        """The device died or a load failed: it holds no known model, no live lease, and
        nothing warm that we know of."""
        self.model, self.last_swap = None, None
        self.live.clear()
        self._drop_notice()


def _unconfirmed(granting: asyncio.Future) -> None:
    """An unconfirmed grant's failure: its holder's call to the device fails as well, and
    reports it (`device_lost`); only logged here."""
    if not granting.cancelled() and granting.exception() is not None:
        log.info("an unconfirmed grant failed: %s", granting.exception())
