"""The devices (SPEC §5): each holds at most one model and runs at most one job.

A device is named by the runtime ("dev0", "model:gpu1", ...); the pool keeps them in the
order they were added, which is the order every tie between devices goes by, so that a
decision never depends on a hash order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .queues import Entry


@dataclass(eq=False, slots=True)
class Device:
    name: str
    loaded: str | None = None
    running: Entry | None = None
    dispatch_no: int = -1  # when its running job was dispatched, in dispatch order


class Pool:
    def __init__(self, names: tuple[str, ...] | list[str]) -> None:
        self._devices: dict[str, Device] = {}
        self._by_job: dict[str, Device] = {}
        for name in names:
            self.add(name)

    def __iter__(self) -> Iterator[Device]:
        return iter(self._devices.values())

    def __len__(self) -> int:
        return len(self._devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._devices)

    def check_new(self, name: object) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a device name must be a non-empty string, got {name!r}")
        if name in self._devices:
            raise ValueError(f"device {name!r} is already in the pool")

    def add(self, name: str) -> Device:
        self.check_new(name)
        device = self._devices[name] = Device(name)
        return device

    def remove(self, name: str) -> Device:
        device = self.get(name)
        del self._devices[name]
        if device.running is not None:
            del self._by_job[device.running.job.id]
        return device

    def get(self, name: str) -> Device:
        try:
            return self._devices[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown device {name!r}; the pool has: {', '.join(self._devices) or 'none'}") from None

    def holder(self, job_id: str) -> Device | None:
        """The device running `job_id`, if any."""
        return self._by_job.get(job_id)

    def start(self, device: Device, entry: Entry, dispatch_no: int) -> None:
        device.running, device.loaded, device.dispatch_no = entry, entry.job.model_id, dispatch_no
        self._by_job[entry.job.id] = device

    def stop(self, device: Device) -> Entry:
        entry, device.running = device.running, None
        del self._by_job[entry.job.id]
        return entry

    def free(self) -> list[Device]:
        return [d for d in self._devices.values() if d.running is None]

    def busy(self) -> list[Device]:
        return [d for d in self._devices.values() if d.running is not None]


def swap_target(free: list[Device], queued_on: Callable[[str], int]) -> Device:
    """R17: a swap goes to an empty device first, else to the free device whose model has
    the least queued work (it loses the least affinity); ties go by pool order."""
    return min(free, key=lambda d: (d.loaded is not None, queued_on(d.loaded) if d.loaded else 0))


def device_for(entry: Entry, free: list[Device], queued_on: Callable[[str], int]) -> Device:
    """R17: a free device already holding the job's model whenever there is one."""
    for device in free:
        if device.loaded == entry.job.model_id:
            return device
    return swap_target(free, queued_on)
