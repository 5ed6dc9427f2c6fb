"""Idle models kept warm: a model swapped out keeps its ``Loaded`` so that a swap back is a
copy (or nothing at all), not a load.

A ``Loaded`` is everything a cold load builds: the weights as tuned (dtype) and packed for
oneDNN, the tokenizer with its chat template, the vocabulary, the probe that chose dtype and
threads, the step clock, and the model's prefix-cache entries. Keeping the object keeps them
all: no file is read again, no ``from_pretrained`` runs, no probe is measured again.

Where it is kept (``Swap.kept``):

* ``RESIDENT``: on the device beside the active model, where the device has room for both
  (co-residency, on by default): the swap back is a switch of the active model, no copy. On a
  CPU the device's memory is the host's, so this costs nothing more than keeping the object.
  The policy still decodes one model per device at a time (R21); only the swap's cost changes.
* ``HOST``: in host memory (co-residency off, or no room on the device): on a GPU the tensors
  are moved to pinned host memory and copied back with ``non_blocking=True`` at the bus's
  speed; on a CPU they never leave it, so the copy back is empty. NOTE: the GPU path is
  written, not yet run on a GPU (no GPU was lent when it was written); a re-capture of CUDA
  graphs, where an engine has them, would count in the swap's time.

Every idle model of an engine counts against one budget (``UNIUN_WARM_MB``, else the warm part
of the device's memory plan, ``uniun_ray.memory``), least recently used
first out. The active model does not count. A model larger than the budget is not kept.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .packing import PackedLinear
from ..tune.tuning import fastest
from .weights import Loaded
from ..swap import HOST, RESIDENT, SWITCH, WARM


@dataclass
class Parked:
    """An idle model, where it is kept, and the bytes it counts for."""

    loaded: Loaded
    where: str
    nbytes: int

    @property
    def kind_back(self) -> str:
        """The kind of the swap that makes it active again."""
        return SWITCH if self.where == RESIDENT else WARM


class ParkedStore:
    """Idle models by id, least recently used first, within ``budget_bytes`` (0: none kept)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._parked: OrderedDict[str, Parked] = OrderedDict()

    @property
    def held_bytes(self) -> int:
        return sum(parked.nbytes for parked in self._parked.values())

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._parked

    def __len__(self) -> int:
        return len(self._parked)

    def keep(self, model_id: str, parked: Parked) -> list[str]:
        """Keep ``parked`` as the most recently used; return the ids evicted to make room (the
        model itself when it alone exceeds the budget: then nothing else is evicted)."""
        self._parked.pop(model_id, None)
        if parked.nbytes > self.budget_bytes:
            return [model_id]
        evicted = []
        while self._parked and self.held_bytes + parked.nbytes > self.budget_bytes:
            evicted.append(self._parked.popitem(last=False)[0])
        self._parked[model_id] = parked
        return evicted

    def pop(self, model_id: str) -> Parked | None:
        """The idle model, out of the store (it becomes the active one), or None."""
        return self._parked.pop(model_id, None)

    def clear(self) -> None:
        self._parked.clear()

    def kept(self) -> dict[str, str]:
        """Model id -> where it is kept (RESIDENT or HOST), least recently used first."""
        return {model_id: parked.where for model_id, parked in self._parked.items()}

    def sizes(self) -> dict[str, int]:
        """Model id -> the bytes it counts for (what a copy back moves, where it is HOST)."""
        return {model_id: parked.nbytes for model_id, parked in self._parked.items()}

    def describe(self) -> dict:
        return {"budget_mb": round(self.budget_bytes / 2**20), "held_mb": round(self.held_bytes / 2**20, 1),
                "models": {model_id: {"where": parked.where, "mb": round(parked.nbytes / 2**20, 1)}
                           for model_id, parked in self._parked.items()}}


def park(loaded: Loaded, device: torch.device, coresident: bool) -> Parked:
    """Set the active model aside: resident on the device where ``coresident`` and it has room,
    else in host memory (pinned, on a GPU; its prefix entries, device tensors, are dropped)."""
    where = RESIDENT if coresident and _room_beside(loaded, device) else HOST
    if where == HOST and device.type != "cpu":
        loaded.prefix.clear()
        _move(loaded, device, to_host=True)
    return Parked(loaded, where, weight_bytes(loaded) + loaded.prefix.held_bytes + loaded.prefix.offloaded_bytes)


def unpark(parked: Parked, device: torch.device) -> Loaded:
    """Make a parked model the active one again: copied back to the device from host memory
    (a GPU; non-blocking from pinned buffers, then one synchronize), and torch's threads set to
    the count its probe chose."""
    loaded = parked.loaded
    if parked.where == HOST and device.type != "cpu":
        _move(loaded, device, to_host=False)
    if loaded.probe is not None:
        torch.set_num_threads(fastest(loaded.probe.speeds).threads)
    return loaded


def weight_bytes(loaded: Loaded) -> int:
    """The bytes of the model's parameters and buffers, packed linears included (their packed
    weight is no parameter: ``packing``)."""
    tensors = itertools.chain(loaded.model.parameters(), loaded.model.buffers())
    plain = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    packed = sum(module.in_features * module.out_features * module.dtype.itemsize
                 for module in loaded.model.modules() if isinstance(module, PackedLinear))
    return plain + packed


def _room_beside(loaded: Loaded, device: torch.device) -> bool:
    """Whether the device may keep this model beside the next one. A CPU: yes (its memory is the
    host's, which the budget bounds). A GPU: while its free memory would still hold another
    model this size and its prefix cache's budget (a guess: the next model's size is not known
    yet; a load that then runs short of memory drops the warm models and loads cold). What torch's
    allocator keeps cached (the static rows just freed, the step's activations) is handed back
    first: the device counts it as used, and it is free to the next model."""
    if device.type == "cpu":
        return True
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return free >= 2 * weight_bytes(loaded) + loaded.prefix.budget_bytes


def _move(loaded: Loaded, device: torch.device, to_host: bool) -> None:
    """Every parameter and buffer to pinned host memory, or back to ``device`` without blocking
    on each copy (pinned sources make them asynchronous), then one wait for them all."""
    for tensor in itertools.chain(loaded.model.parameters(), loaded.model.buffers()):
        if to_host:
            tensor.data = tensor.data.to("cpu").pin_memory()
        else:
            tensor.data = tensor.data.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
