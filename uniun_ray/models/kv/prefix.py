"""Never prefill the same tokens twice: the KV of recent runs, kept for the next request.

Two costs dominate prefill here. A chat turn resends the whole conversation, and a revoked job
(SPEC R6) resumes from prompt + what it produced. Both start with tokens whose keys and values
were already computed. ``PrefixCache`` keeps each finished or revoked run's transformers
``DynamicCache`` with the token ids it covers; a new run takes the longest cached prefix of its
context and prefills only the rest (vLLM's automatic prefix caching and SGLang's radix cache do
this per block; one engine here runs one sequence, so whole sequences are the unit).

* Sharing is free: what an entry holds is never changed. A run works on a *fork* (new layer
  objects over the same tensors; ``crop`` re-slices) and the entry stays valid for the next hit.
  A fork's layers grow in place (``GrowingLayer``): their keys and values are views of a buffer
  with room after them, and a fork whose view ends where the buffer's written part ends writes
  its new tokens there, past everything an entry holds; any other fork copies, as transformers'
  ``DynamicLayer`` copies on every update. A decode step over a long history no longer copies
  the whole history in every layer (SmolLM2 in float32, one thread, 1,177 cached tokens: 72–90 ->
  66–70 ms CPU; `benchmarks/turn_cost.py`).
* Memory is bounded (``UNIUN_KV_CACHE_MB``): least recently used entries go first, and a
  revoked job's entry only after every other one, since its resume is the one hit that is
  certain. Its resume (a hit that covers the revoked run's whole prompt) takes it out of the
  cache: the run stores its own entry when it ends. Any other hit on it, such as the chat that
  revoked it sharing the chat template's first tokens, forks it and leaves it for the resume.
* Two tiers where the device is not the CPU (``UNIUN_KV_OFFLOAD_MB``): an entry pushed out of
  device memory moves to CPU memory (transformers' own ``offload``/``prefetch`` of each cache
  layer) instead of being dropped, and moves back on a hit: copying KV over PCIe costs far
  less than prefilling it again. The CPU tier has its own budget, evicted in the same order.
  On a CPU device there is one tier: offloading would copy host memory to host memory.
* A cache that cannot be cropped back to a prefix (sliding-window layers that already dropped
  their oldest tokens) is reused only whole.
* An ``exact`` cache (``UNIUN_DETERMINISTIC``) changes no greedy answer by a hit: a
  run takes only tokens whose KV its own prefill would have computed to the bit, those the
  entry's run read in passes of several tokens (``read``; ``runner.attention`` makes a token's KV
  the same whatever such pass it is in), not the last prompt token read alone nor the decoded
  ones, computed one row at a time, which rounds otherwise. And it leaves what a fresh read leaves: the last token to read alone, never a lone
  token before it. A revoked run's resume alone takes all it shares: it goes on from its own KV.
  By default a hit takes all it shares but the last token (a whole conversation, its replies
  included), or all of it where it is a finished run's own prompt, whose logits after it the
  entry keeps (a whole hit): the same request asked again reads nothing and gets its answer
  (``Batch._chunk``); another prompt over a shared prefix may round otherwise below float32
  (docs/tuning.md).
* The cache belongs to the loaded model: a swap drops it (``Engine`` makes a new one), rather
  than holding another model's KV in memory it needs for the new model's weights.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from transformers.cache_utils import DynamicLayer

#: A growing layer's buffer has room for this share more tokens than it holds (at least
#: ``MIN_ROOM``): a conversation's next turns, or a run's next decode steps, are written in place
#: until it is full, then one copy moves the layer to a larger buffer; the budget counts the room.
ROOM_SHARE, MIN_ROOM = 1 / 8, 16


def fork(cache: Any) -> Any:
    """A cache object of its own over the same tensors: cropping or extending it leaves
    ``cache`` as it was. Its plain layers grow in place from then on (``GrowingLayer``)."""
    twin = copy.copy(cache)
    twin.layers = [_growing(layer) for layer in cache.layers]
    return twin


def _growing(layer: Any) -> Any:
    """A plain layer as a growing one (an empty one too: a fork of a new cache grows from its
    first token); any other kind of layer (sliding windows) as it is, copied."""
    if type(layer) is DynamicLayer:
        twin = GrowingLayer.__new__(GrowingLayer)
        state = dict(layer.__dict__)
        keys = state.pop("keys", None)
        twin.__dict__.update(state)
        twin.keys = keys
        return twin
    return copy.copy(layer)


class _Room:
    """A layer's keys and values with room after them, and how far they are written: the one
    view that ends there may write on (``claim``); every other view of it only reads. Made for
    a layer about to write up to ``end``: its tokens are copied in, and the room to ``end`` is
    its own."""

    def __init__(self, keys: Any, values: Any, end: int) -> None:
        held, capacity = keys.shape[-2], end + max(MIN_ROOM, int(end * ROOM_SHARE))
        self.keys = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        self.values = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        self.keys[..., :held, :], self.values[..., :held, :] = keys, values
        self.written = end
        self._lock = threading.Lock()

    def claim(self, keys: Any, end: int) -> bool:
        """Whether ``keys`` (a view of this room, or not) may write on to ``end``; if so, the
        room is written that far from now on, and no other view may write there."""
        with self._lock:
            if keys.data_ptr() != self.keys.data_ptr() or keys.shape[-2] != self.written \
                    or end > self.keys.shape[-2]:
                return False
            self.written = end
            return True


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer``, but an update writes into room after the layer's tokens
    when it may (``_Room.claim``) instead of concatenating a copy of all of them. Keys set to
    anything but a view of its room (offloaded, stacked into a batch, cut out of one, copied)
    let the room go, so that a kept layer never holds memory its keys do not use."""

    _room: _Room | None = None

    @property
    def keys(self) -> Any:
        return self.__dict__.get("_keys")

    @keys.setter
    def keys(self, keys: Any) -> None:
        self.__dict__["_keys"] = keys
        if self._room is not None and (keys is None or keys.data_ptr() != self._room.keys.data_ptr()):
            self._room = None

    def update(self, key_states: Any, value_states: Any, *args, **kwargs) -> tuple[Any, Any]:
        if not self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        held = self.keys.shape[-2]
        end = held + key_states.shape[-2]
        if self._room is None or not self._room.claim(self.keys, end):
            self._room = _Room(self.keys, self.values, end)
        room = self._room
        room.keys[..., held:end, :], room.values[..., held:end, :] = key_states, value_states
        self.keys, self.values = room.keys[..., :end, :], room.values[..., :end, :]
        return self.keys, self.values


def croppable(cache: Any, tokens: int) -> bool:
    """Whether every layer of ``cache`` can be cut back to its first ``tokens``. transformers'
    own ``is_croppable`` says yes for a sliding-window layer that has already dropped its oldest
    tokens (``DynamicSlidingWindowLayer`` inherits it from ``DynamicLayer``), and that layer's
    ``crop`` then raises: a revoke during a Gemma prefill past its 512-token window did."""
    return getattr(cache, "is_croppable", True) and not any(
        layer.get_seq_length() > tokens and getattr(layer, "is_sliding", False)
        and not getattr(layer, "record_past", False) and layer.get_seq_length() >= layer.sliding_window
        for layer in cache.layers)


def crop_layers(cache: Any, tokens: int) -> bool:
    """Cut every layer back to its first ``tokens`` (after a forward pass stopped between two
    layers, the engine's layer gate, the layers before the stop hold more than the others).
    False, leaving ``cache`` as it was, where a layer cannot be cut back (``croppable``)."""
    if not croppable(cache, tokens):
        return False
    for layer in cache.layers:
        extra = layer.get_seq_length() - tokens
        if extra > 0:
            layer.crop(-extra)
    return True


def cache_bytes(cache: Any) -> int:
    """Bytes of the tensors a cache holds (their storage: a cropped view still holds all of it)."""
    seen, total = set(), 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is None or not hasattr(tensor, "untyped_storage"):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def offloaded(cache: Any) -> Any:
    """A fork of ``cache`` whose tensors are in CPU memory; ``cache`` keeps its own."""
    twin = fork(cache)
    for layer in twin.layers:
        layer.offload()
    return twin


def restored(cache: Any) -> Any:
    """A fork of an offloaded ``cache`` with every layer back on the device it was computed on
    (each layer remembers its own: accelerate may have spread the model over several)."""
    twin = fork(cache)
    for layer in twin.layers:
        layer.prefetch()
    return twin


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: Any
    nbytes: int
    preempted: bool
    prompt: int                 # of ``tokens``, the run's prompt: a hit that covers it is a resume
    read: int                   # of ``tokens``, the first read as any prefill reads them
    logits: Any = None          # after ``tokens[:prompt]``, where its run kept them (``whole``)
    offloaded: bool = False


@dataclass(frozen=True)
class Hit:
    """What a run starts from: a cache holding the KV of ``context[:tokens]`` (None: nothing), the
    first ``read`` of them as any prefill computes them (fewer only in a revoked run's resume),
    and, where it holds the whole context, the ``logits`` after it (the run reads nothing)."""

    cache: Any
    tokens: int
    read: int = 0
    logits: Any = None


class PrefixCache:
    """The KV of recent sequences of one loaded model: ``budget_bytes`` where the model computes
    it (0: off) and ``offload_bytes`` of CPU memory for what the device tier pushes out (0: one
    tier, what is pushed out is dropped)."""

    def __init__(self, budget_bytes: int, offload_bytes: int = 0, exact: bool = False) -> None:
        self.budget_bytes, self.exact = budget_bytes, exact
        self.offload_bytes = offload_bytes if budget_bytes > 0 else 0
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # least recent first
        self._lock = threading.Lock()
        self.held_bytes = self.offloaded_bytes = 0      # per tier: device, CPU memory
        self.hits = self.misses = self.evictions = self.offloads = self.restores = 0
        self.reused_tokens = self.prefilled_tokens = 0

    def lookup(self, context: list[int]) -> Hit:
        """The longest cached prefix of ``context`` a run may start from (``_usable``)."""
        with self._lock:
            best, length = None, 0
            for entry in self._entries.values():
                usable = _usable(entry, _common_prefix(entry.tokens, context), len(context), self.exact)
                if usable > length:
                    best, length = entry, usable
            hit = self._reuse(best, length, len(context)) if best is not None and length > 0 else None
            if hit is None:
                self.misses += 1
                self.prefilled_tokens += len(context)
                return Hit(None, 0)
            self.hits += 1
            self.reused_tokens += length
            self.prefilled_tokens += len(context) - length
            return hit

    def _reuse(self, entry: _Entry, length: int, total: int) -> Hit | None:
        surplus = len(entry.tokens) - length
        if surplus and not croppable(entry.cache, length):
            return None
        if entry.offloaded:
            self._restore(entry)
        if entry.preempted and length >= entry.prompt:   # the revoked job's resume takes it over
            self._drop(entry)
            cache = entry.cache
        else:
            self._entries.move_to_end(entry.tokens)
            cache = fork(entry.cache)
            self._fit()
        if surplus:
            cache.crop(-surplus)
        return Hit(cache, length, min(length, entry.read), entry.logits if length == total else None)

    def put(self, tokens: list[int], cache: Any, preempted: bool, prompt: int | None = None,
            read: int | None = None, logits: Any = None) -> None:
        """Keep ``cache``, which holds the KV of exactly ``tokens``; ``preempted``: its run was
        revoked and will resume from ``prompt`` tokens (None: all of ``tokens``) and what it
        produced; ``read``: how many of the first tokens it read in passes of several tokens
        (None: all); ``logits``: those after the ``prompt`` tokens (None: not kept). An entry
        larger than the device budget is not kept."""
        if not tokens or cache is None or self.budget_bytes <= 0:
            return
        key = tuple(tokens)
        nbytes = _entry_bytes(cache, logits)
        with self._lock:
            if key in self._entries:
                self._drop(self._entries[key])
            if nbytes > self.budget_bytes:
                self.evictions += 1
                return
            self._entries[key] = _Entry(key, cache, nbytes, preempted, min(len(key), prompt or len(key)),
                                        len(key) if read is None else min(len(key), read), logits)
            self.held_bytes += nbytes
            self._fit()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.held_bytes = self.offloaded_bytes = 0

    def _fit(self) -> None:
        """Bring each tier within its budget: the device tier's victims move to CPU memory
        while they fit there, and the CPU tier's are dropped."""
        while self.held_bytes > self.budget_bytes:
            victim = self._victim(offloaded=False)
            if victim.nbytes <= self.offload_bytes:
                self._offload(victim)
            else:
                self._drop(victim)
                self.evictions += 1
        while self.offloaded_bytes > self.offload_bytes:
            self._drop(self._victim(offloaded=True))
            self.evictions += 1

    def _victim(self, offloaded: bool) -> _Entry:
        """The tier's least recently used entry, a revoked job's only when no other is left."""
        tier = [e for e in self._entries.values() if e.offloaded == offloaded]
        return next((e for e in tier if not e.preempted), tier[0])

    def _offload(self, entry: _Entry) -> None:
        self.held_bytes -= entry.nbytes
        entry.cache, entry.offloaded = offloaded(entry.cache), True
        entry.logits = None if entry.logits is None else entry.logits.cpu()
        entry.nbytes = _entry_bytes(entry.cache, entry.logits)    # a cropped view's copy holds only the view
        self.offloaded_bytes += entry.nbytes
        self.offloads += 1

    def _restore(self, entry: _Entry) -> None:
        self.offloaded_bytes -= entry.nbytes
        entry.cache, entry.offloaded = restored(entry.cache), False
        if entry.logits is not None:     # where the layers went back to
            entry.logits = entry.logits.to(entry.cache.layers[0].keys.device)
        entry.nbytes = _entry_bytes(entry.cache, entry.logits)
        self.held_bytes += entry.nbytes
        self.restores += 1

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.tokens]
        if entry.offloaded:
            self.offloaded_bytes -= entry.nbytes
        else:
            self.held_bytes -= entry.nbytes

    def describe(self) -> dict:
        with self._lock:
            lookups = self.hits + self.misses
            return {"budget_mb": _mb(self.budget_bytes), "held_mb": _mb(self.held_bytes, 2),
                    "offload_budget_mb": _mb(self.offload_bytes), "offloaded_mb": _mb(self.offloaded_bytes, 2),
                    "entries": len(self._entries),
                    "offloaded_entries": sum(e.offloaded for e in self._entries.values()),
                    "preempted_entries": sum(e.preempted for e in self._entries.values()),
                    "hits": self.hits, "misses": self.misses,
                    "hit_rate": round(self.hits / lookups, 3) if lookups else None,
                    "reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens,
                    "offloads": self.offloads, "restores": self.restores, "evictions": self.evictions}


def _entry_bytes(cache: Any, logits: Any) -> int:
    """An entry's bytes: its cache's and its logits'."""
    return cache_bytes(cache) + (0 if logits is None else logits.numel() * logits.element_size())


def _mb(nbytes: int, digits: int = 1) -> float:
    return round(nbytes / 2**20, digits)


def _usable(entry: _Entry, common: int, total: int, exact: bool) -> int:
    """Of the ``common`` first tokens a context of ``total`` shares with ``entry``, how many its run
    may take:

    * all of it where the context is the entry's run's prompt and the run kept the logits after
      it (a whole hit): the same request asked again reads nothing and gets the first token its
      first run got, to the bit, in any dtype (a prompt's last token read in the prompt's pass
      rounds otherwise than read alone over its cache). Not a revoked run's entry (left to its
      resume), nor in an ``exact`` cache (it leaves the last token to read, below);
    * else all but the last (the run needs the logits after it), when not ``exact`` and for the
      revoked run's resume;
    * else only tokens the entry read as a prefill reads them, leaving what a fresh read of the
      context leaves (``Batch._chunk``): the last token alone after passes of two or more
      (nothing taken from a context of two)."""
    if entry.logits is not None and common == total == entry.prompt and not entry.preempted and not exact:
        return total
    common = min(common, total - 1)
    if not exact or (entry.preempted and common >= entry.prompt):
        return common
    common = min(common, entry.read)
    if total <= 2:
        return 0
    return common - 1 if total - common == 2 else common


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == tuple(b[:n]):
        return n
    low, high = 0, n   # binary search on "the first `mid` tokens agree"
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == tuple(b[:mid]):
            low = mid
        else:
            high = mid - 1
    return low
