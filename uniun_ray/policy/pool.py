"""The devices (SPEC §5, §6): each holds at most one model and runs up to `slots` jobs on it.

A device is named by the runtime ("dev0", "model:gpu1", ...); the pool keeps them in the
order they were added, which is the order every tie between devices goes by, so that a
decision never depends on a hash order. A device's jobs are kept in dispatch order; each
has a slot number (0..slots-1), the lowest free one at its dispatch, so that one slot's runs
never overlap (the T2 window sums runs per slot).

With several slots a revoked job hands its slot over (R22): it stops at the next step, and
the job that takes its slot joins at that same step, so its slot counts as free at once
and the taker needs no release round trip first. Its run ends at the handover. With one
slot a revoked job keeps its slot until it ends (§1 exactly: R1–R20).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from .queues import Entry


def check_slots(slots: object, device: object) -> int:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"device {device!r}: slots must be an int >= 1, got {slots!r}")
    return slots


@dataclass(eq=False, slots=True)
class Device:
    name: str
    loaded: str | None = None
    jobs: dict[str, Entry] = field(default_factory=dict)  # job id -> entry, in dispatch order
    slots: int = 1
    drain_for: str | None = None  # R21: a waiting job will take this device once it is empty
    counts: dict[str, int] = field(default_factory=dict)  # model -> the slots it got here (R25)

    @property
    def running(self) -> Entry | None:
        """The first running job (with one slot: the running job)."""
        return next(iter(self.jobs.values()), None)

    @property
    def has_free_slot(self) -> bool:
        return len(self.holders()) < self.slots

    def live(self) -> list[Entry]:
        """Running jobs not yet revoked: those that still decode after the next step."""
        return [e for e in self.jobs.values() if not e.revoke_sent]

    def holders(self) -> list[Entry]:
        """The jobs that hold a slot: all but those whose slots were handed over, and with
        several slots, but those revoked (theirs is handed to the next job that takes it)."""
        if self.slots == 1:
            return list(self.jobs.values())
        return self.live()

    def free_slot(self) -> tuple[int, Entry | None]:
        """The slot the next dispatch takes: the lowest unused one, else a revoked job's, which
        it is handed over (returned with it)."""
        used = {e.slot for e in self.jobs.values() if not e.handed}
        unused = next((i for i in range(self.slots) if i not in used), None)
        if unused is not None:
            return unused, None
        handed = next(e for e in self.jobs.values() if e.revoke_sent and not e.handed)
        return handed.slot, handed


class Pool:
    def __init__(self, slots: list[tuple[str, int]]) -> None:
        """`slots`: (device name, slot count) in pool order."""
        self._devices: dict[str, Device] = {}
        self._by_job: dict[str, Device] = {}
        for name, count in slots:
            self.add(name, count)

    def __iter__(self) -> Iterator[Device]:
        return iter(self._devices.values())

    def __len__(self) -> int:
        return len(self._devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._devices)

    def check_new(self, name: object, slots: object = 1) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a device name must be a non-empty string, got {name!r}")
        if name in self._devices:
            raise ValueError(f"device {name!r} is already in the pool")
        check_slots(slots, name)

    def add(self, name: str, slots: int = 1) -> Device:
        self.check_new(name, slots)
        device = self._devices[name] = Device(name, slots=slots)
        return device

    def remove(self, name: str) -> Device:
        device = self.get(name)
        del self._devices[name]
        for job_id in device.jobs:
            del self._by_job[job_id]
        return device

    def get(self, name: str) -> Device:
        try:
            return self._devices[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown device {name!r}; the pool has: {', '.join(self._devices) or 'none'}") from None

    def holder(self, job_id: str) -> Device | None:
        """The device running `job_id`, if any."""
        return self._by_job.get(job_id)

    def start(self, device: Device, entry: Entry, dispatch_no: int) -> Entry | None:
        """Give `entry` a slot on `device`; returns the revoked job it took the slot of, if any."""
        if device.loaded != entry.job.model_id:   # a swap: the model's own count from now on
            device.slots = device.counts.get(entry.job.model_id, device.slots)
        entry.slot, handed = device.free_slot()
        if handed is not None:
            handed.handed = True
        entry.dispatch_no = dispatch_no
        device.jobs[entry.job.id] = entry
        if len(device.jobs) == 1:
            device.drain_for = None  # it was empty: drained and taken (by its drainer or a better job)
        device.loaded = entry.job.model_id
        self._by_job[entry.job.id] = device
        return handed

    def stop(self, device: Device, entry: Entry) -> Entry:
        del device.jobs[entry.job.id]
        del self._by_job[entry.job.id]
        return entry

    def running(self) -> Iterator[tuple[Device, Entry]]:
        for device in self._devices.values():
            for entry in device.jobs.values():
                yield device, entry

    def free(self) -> list[Device]:
        return [d for d in self._devices.values() if d.has_free_slot]

    def busy(self) -> list[Device]:
        return [d for d in self._devices.values() if d.jobs]


def swap_target(free: list[Device], queued_on: Callable[[str], int]) -> Device:
    """R17: a swap goes to an empty device first, else to the free device whose model has
    the least queued work (it loses the least affinity); ties go by pool order."""
    return min(free, key=lambda d: (d.loaded is not None, queued_on(d.loaded) if d.loaded else 0))


def slot_for(entry: Entry, free: list[Device], queued_on: Callable[[str], int]) -> Device | None:
    """R17, R21: a device already holding the job's model with a free slot whenever there is
    one, else an empty device (a swap), else None: the job waits."""
    for device in free:
        if device.loaded == entry.job.model_id:
            return device
    empty = [d for d in free if not d.jobs]
    return swap_target(empty, queued_on) if empty else None
