"""One memory plan per device: how its budget is divided, decided in one place.

A device's budget (``UNIUN_MEMORY``: a share of the device or a size; by default a GPU's whole
memory, or on a CPU its share of the host's available memory) holds the active model's weights,
the idle models kept on it (co-resident), the static KV rows and the prefix cache; a CPU's
budget, being host memory, holds the warm host copies of idle models too. A GPU's warm copies
and the prefix cache's second tier live in host memory, beside the budget.

Each part is what its setting says; where a setting is unset, the plan gives today's defaults:
the prefix cache 1 GiB on a CPU and 4 GiB on a GPU; the static rows 1 GiB on a CPU and on a GPU
what is left after the weights, the idle models on it and the prefix cache, less a headroom
(15%, at least 2 GiB: prefill activations, the graphs' pool, the allocator); the idle models
half the host's share, within what the other parts leave on a CPU. Settings that together ask
for more than the budget are refused with what each asks (``MemoryShort``). Pure: no torch;
the engine measures the device and the weights and asks the plan (``plan``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .settings import ENV, EngineSettings

MB = 2**20
#: The prefix cache's budget where UNIUN_KV_CACHE_MB is unset: about 22k tokens of SmolLM2 in
#: float32 on a CPU.
DEFAULT_KV_CACHE_MB = {"cpu": 1024, "cuda": 4096}
#: CPU memory for the KV a GPU's cache pushes out, per GPU: a node with eight takes 32 GiB.
DEFAULT_KV_OFFLOAD_MB = 4096
#: The static rows' store on a CPU where UNIUN_KV_ROWS_MB is unset.
CPU_ROWS_MB = 1024
#: A GPU keeps this share of what the rows could take, and at least HEADROOM_MB, out of them.
HEADROOM_SHARE, HEADROOM_MB = 0.15, 2048
#: The share of the budget (a CPU's) or of the host's share (a GPU's) that idle models may keep.
WARM_SHARE = 0.5
#: The parts of a plan, in the order ``status`` shows them.
PARTS = ("weights", "coresident", "warm", "kv_rows", "prefix_cache", "headroom", "offload")


class MemoryShort(ValueError):
    """The settings ask for more memory than the device's budget."""


@dataclass(frozen=True)
class Device:
    """What a plan is made for: ``kind`` "cpu" or "cuda", ``memory`` its bytes (a GPU's total;
    a CPU device's share of the host's available memory) and ``host`` its share of the host's
    available memory (where a GPU keeps warm copies and offloaded KV)."""

    kind: str
    memory: int
    host: int


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part (``PARTS``) within ``budget``; ``warm`` and ``offload`` are host memory on
    a GPU, ``warm`` is in the budget on a CPU."""

    budget: int
    weights: int
    coresident: int
    warm: int
    kv_rows: int
    prefix_cache: int
    headroom: int
    offload: int

    def describe(self, used: Mapping[str, int | None] | None = None) -> dict:
        """For ``status``: the budget and each part's planned and used MB (None: not measured)."""
        used = used or {}
        return {"budget_mb": _mb(self.budget),
                "parts": {part: {"planned_mb": _mb(getattr(self, part)),
                                 "used_mb": None if used.get(part) is None else _mb(used[part])}
                          for part in PARTS}}


def budget_of(device: Device, memory: float | int | None) -> int:
    """The device's budget: ``memory`` as a share of it, as bytes, or (None) all of it."""
    if memory is None:
        return device.memory
    return int(device.memory * memory) if isinstance(memory, float) else int(memory)


def plan(device: Device, settings: EngineSettings, weights: int = 0, coresident: int = 0,
         static_rows: bool = False, check: bool = True) -> MemoryPlan:
    """The plan for ``device`` with ``weights`` bytes of active model and ``coresident`` bytes
    of idle models on it (0 before the first load), its batches keeping ``static_rows`` or not.
    MemoryShort where what the settings fix does not fit the budget (unless not ``check``: a
    model loaded is served as before, and ``status`` shows its plan overdrawn). A default is
    never refused: on a small host it is what it was, and the plan shows no headroom."""
    budget, gpu = budget_of(device, settings.memory), device.kind != "cpu"
    prefix = _mb_or(settings.kv_cache_mb, DEFAULT_KV_CACHE_MB["cuda" if gpu else "cpu"] * MB)
    offload = 0 if not gpu or prefix == 0 else _mb_or(settings.kv_offload_mb, DEFAULT_KV_OFFLOAD_MB * MB)
    if check:
        _check(budget, settings, weights + coresident, ("kv_cache_mb", "kv_rows_mb") + (() if gpu else ("warm_mb",)))
    if gpu:
        spare = max(0, budget - weights - coresident - prefix)
        rows = _mb_or(settings.kv_rows_mb, max(0, int(min(spare * (1 - HEADROOM_SHARE), spare - HEADROOM_MB * MB))))
        rows = rows if static_rows else 0
        warm = _mb_or(settings.warm_mb, int(device.host * WARM_SHARE))
        return MemoryPlan(budget, weights, coresident, warm, rows, prefix, max(0, spare - rows), offload)
    rows = _mb_or(settings.kv_rows_mb, CPU_ROWS_MB * MB) if static_rows else 0
    left = max(0, budget - weights - rows - prefix)
    warm = _mb_or(settings.warm_mb, min(int(budget * WARM_SHARE), left))
    return MemoryPlan(budget, weights, coresident, warm, rows, prefix, max(0, left - warm), offload)


def _check(budget: int, settings: EngineSettings, held: int, budgets: tuple[str, ...]) -> None:
    """MemoryShort naming each setting among ``budgets`` (in MB, in the device's budget) that
    is set, when they and ``held`` bytes (the weights and idle models on the device) exceed
    ``budget``."""
    asked = {name: getattr(settings, name) * MB for name in budgets if getattr(settings, name) is not None}
    if not asked or held + sum(asked.values()) <= budget:
        return
    parts = ", ".join([f"{ENV[name]}={getattr(settings, name)}" for name in asked]
                      + ([f"{_mb(held)} MB of models"] if held else []))
    raise MemoryShort(f"the device's memory plan does not fit: {parts} come to {_mb(held + sum(asked.values()))} MB, "
                      f"more than its budget of {_mb(budget)} MB ({ENV['memory']}={settings.memory or 'unset'}); "
                      f"lower them, or raise {ENV['memory']} where the device has more")


def _mb_or(value_mb: int | None, default: int) -> int:
    """A setting in MB as bytes, else the ``default`` bytes."""
    return value_mb * MB if value_mb is not None else default


def _mb(size: int) -> float:
    return round(size / MB, 1)
