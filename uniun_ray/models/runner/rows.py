"""The KV rows of a batch: where the decoding jobs' keys and values live between steps.

``Batch`` decides the order of things (who joins, who leaves, when); a ``Rows`` keeps the KV of
the jobs decoding together, one row each in the order they step (join order, until a leave
reorders them), and runs one decode step of them. Implementations differ by device: ``PaddedRows`` holds one ``DynamicCache`` whose rows are
left-padded to the longest, an attention mask hiding the padding and per-row position ids;
``StaticRows`` keeps a row per job in KV tensors allocated once at load, so a step has
fixed shapes and a GPU can replay it as a CUDA graph. ``RowChoice.of`` is the one place that
chooses (the settings' ``kv_rows`` and ``kv_steps``; by default static on a GPU, padded on a CPU).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..kv.prefix import fork
from .forward import Inputs, Runner
from .static import STORE_ROWS, RowStore, store_shape


def batchable(model: Any) -> bool:
    """Whether every layer of the cache the model builds is a plain full-attention DynamicLayer,
    which can be left-padded, stacked and cut out again."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


@dataclass(frozen=True)
class RowChoice:
    """How a device's batches keep their KV rows: ``kind`` "padded" or "static", and how
    static rows step (``steps``, one of ``settings.STEP_MODES``)."""

    kind: str = "padded"
    steps: str = "exact"

    @classmethod
    def of(cls, device: torch.device, kind: str | None = None, steps: str | None = None) -> "RowChoice":
        """The settings' choice (None: the device's): static rows stepped by CUDA graphs on a GPU
        (fixed shapes), padded rows on a CPU (``benchmarks/kv_rows_bench.py`` measures the two
        there), whose static rows step at exact shapes (no graphs to replay)."""
        gpu = device.type == "cuda"
        return cls(kind or ("static" if gpu else "padded"), steps or ("graphs" if gpu else "exact"))

    def static(self, runner: Runner) -> bool:
        """The one choice of padded against static rows: static where chosen and the model's
        cache can be batched at all."""
        return self.kind == "static" and batchable(runner.model)


def store_for(runner: Runner, device: torch.device, context_length: int, choice: RowChoice,
              budget_bytes: int) -> RowStore | None:
    """The static rows of a model just loaded (its dtype final), sized to ``budget_bytes``
    (the device's memory plan); None where its batches use padded rows (``choice``, a budget
    too small)."""
    if not choice.static(runner):
        return None
    dtype = next(runner.model.parameters()).dtype
    rows, context = store_shape(runner.model, dtype, budget_bytes, STORE_ROWS.get(device.type, STORE_ROWS["cpu"]),
                                context_length)
    if not rows:
        return None
    return RowStore(runner, device, rows, context, choice.steps)


def rows_for(runner: Runner, device: torch.device, slots: int, store: RowStore | None = None,
             context: int | None = None, choice: RowChoice = RowChoice()) -> Rows:
    """The rows a batch of up to ``slots`` rows keeps its KV in: static rows in ``store`` (the
    loaded model's, ``store_for``), or, static rows being chosen and no store given, a store of
    their own of ``slots`` rows of ``context`` tokens (a probe's); else padded rows."""
    if store is None and (context is None or not choice.static(runner)):
        return PaddedRows(device, runner)
    mode = store.mode if store is not None else choice.steps
    mode = "exact" if mode == "graphs" else mode      # a store of its own captures no graphs
    if store is None:
        store = RowStore(runner, device, slots, context, mode)
    return StaticRows(store, slots, lambda rows: RowStore(runner, device, rows, store.context, mode))


class Rows(ABC):
    """The KV of a batch's decoding rows, in the order they step: join order, until a leave
    reorders them (``leave``)."""

    #: The most rows it can hold (None: no bound of its own).
    capacity: int | None = None
    #: Where its KV and a step's inputs live.
    device: torch.device

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def join(self, cache: Any, tokens: int) -> None:
        """Add a row holding a prefill's batch-1 ``cache`` of ``tokens`` tokens (the cache is the
        row's from now on)."""

    @abstractmethod
    def decode(self, inputs: Inputs) -> torch.Tensor:
        """One decode step of every row, row i feeding ``inputs.tokens[i]`` at
        ``inputs.positions[i]``: the logits [rows, vocabulary] on the device, in the order the
        rows step."""

    @abstractmethod
    def leave(self, rows: list[int]) -> tuple[list[Any], list[int]]:
        """Drop ``rows`` (indices in the order the rows step) at once; return each one's KV as a
        batch-1 cache of its own, for the prefix cache (a revoked job's resume), and the order the
        rows left step in from now on (indices among them, in the order they stepped before)."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every row, keeping nothing (the model failed: the KV may be half written)."""


class PaddedRows(Rows):
    """Rows left-padded to the longest in one ``DynamicCache``; a mask [rows, cached tokens]
    hides the padding (0), so a padded position gets exactly zero attention weight. A join pads
    and concatenates, a leave cuts the batch once (and the padding no row needs any more).

    The batch's cache is a fork of the first row's (``prefix.fork``): its layers grow in place,
    so a step writes each row's new token into room after the batch's keys and values instead of
    copying all of them, in every layer, as transformers' ``DynamicLayer`` does (a cache a
    prefill started from nothing has plain layers). The copy grew with rows and context and was
    the step's largest cost after the weights (``benchmarks/step_cost.py``). The mask grows in
    room after it too (``_columns``, ones: a step widens its view instead of copying it)."""

    def __init__(self, device: torch.device, runner: Runner) -> None:
        self.device, self._runner = device, runner
        self._cache: Any = None
        self._columns: torch.Tensor | None = None     # the mask, then room for the next steps' columns
        self._width = 0                               # the mask's columns

    @property
    def _mask(self) -> torch.Tensor:
        return self._columns[:, : self._width]

    @_mask.setter
    def _mask(self, mask: torch.Tensor) -> None:
        self._columns, self._width = mask, mask.shape[1]

    def __len__(self) -> int:
        return 0 if self._columns is None else self._columns.shape[0]

    def join(self, cache: Any, tokens: int) -> None:
        if self._columns is None:
            self._cache, self._mask = fork(cache), torch.ones((1, tokens), dtype=torch.long, device=self.device)
            return
        length = max(self._width, tokens)
        for layer, joining in zip(self._cache.layers, cache.layers):
            layer.keys = torch.cat([_left_padded(layer.keys, length), _left_padded(joining.keys, length)])
            layer.values = torch.cat([_left_padded(layer.values, length), _left_padded(joining.values, length)])
        row = torch.ones((1, tokens), dtype=torch.long, device=self.device)
        self._mask = torch.cat([_left_padded(self._mask, length), _left_padded(row, length)])

    def decode(self, inputs: Inputs) -> torch.Tensor:
        rows, runner = len(self), self._runner
        if self._width == self._columns.shape[1]:    # room for the next steps' tokens: all real
            self._columns = torch.cat([self._columns, self._columns.new_ones((rows, _ROOM))], dim=1)
        self._width += 1
        mask, position_ids = self._mask, inputs.positions[:, None]   # built alike at any rows
        shaping = {} if rows == 1 else {   # one row is never padded: it runs exactly as a lone run does
            "attention_mask": mask, "position_ids": position_ids}
        with torch.inference_mode():
            output = runner.model(input_ids=inputs.tokens[:, None], use_cache=True,
                                  **{runner.cache_arg: self._cache}, **shaping, **runner.kwargs)
        self._cache = getattr(output, runner.cache_arg)
        return output.logits[:, -1]

    def leave(self, rows: list[int]) -> tuple[list[Any], list[int]]:
        """Each leaving row's KV is cut out before the batch is cut, in one cut for all of them:
        a chat that revokes ten companions (R23) costs one copy of the batch, not ten. The
        others keep their order."""
        caches = [self._row_cache(row) for row in rows]
        keep = [index for index in range(len(self)) if index not in rows]
        if not keep:
            self.clear()
            return caches, []
        self._mask = self._mask[keep]
        start = int(self._mask.any(dim=0).int().argmax())     # the first column a row uses
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys, layer.values = layer.keys[keep, :, start:], layer.values[keep, :, start:]
        return caches, list(range(len(keep)))

    def clear(self) -> None:
        self._cache = self._columns = None
        self._width = 0

    def _row_cache(self, row: int) -> Any:
        """A batch-1 cache of one row's tokens, without its padding, in storage of its own (a
        view would keep the whole batch's tensors alive in the prefix cache)."""
        if len(self) == 1:
            return self._cache
        padding = int((self._mask[row] == 0).sum())
        cache = fork(self._cache)
        for layer in cache.layers:
            layer.keys = layer.keys[row : row + 1, :, padding:].clone()
            layer.values = layer.values[row : row + 1, :, padding:].clone()
        return cache


class StaticRows(Rows):
    """The rows of one batch in a ``RowStore``: the store handed in while no other batch holds
    it, else one of its own for ``rows`` rows (a second batch on the same model at once, as a
    lone run beside the device's loop: correct, without graphs). Row i lives in store row i:
    the live rows are the store's first ones, in the order they step, so a step's logits are in
    the batch's order as they come (no gather)."""

    def __init__(self, store: RowStore, rows: int, private: Callable[[int], RowStore]) -> None:
        self._shared, self._private = store, private
        self.device = store.device
        self.capacity = min(rows, store.rows)
        self._store: RowStore | None = None
        self._rows = 0
        self._steps = 0                      # decode steps taken: every live row grows by one a step
        self._joined: list[int] = []         # per store row: tokens it holds less ``_steps``

    def __len__(self) -> int:
        return self._rows

    def join(self, cache: Any, tokens: int) -> None:
        if self._store is None:
            self._store = self._shared if self._shared.claim() else self._private(self.capacity)
            self._joined = [0] * self._store.rows
        row = self._rows
        for keys, values, layer in zip(self._store.keys, self._store.values, cache.layers):
            keys[row, :, :tokens] = layer.keys[0, :, :tokens]
            values[row, :, :tokens] = layer.values[0, :, :tokens]
        self._rows += 1
        self._joined[row] = tokens - self._steps

    def decode(self, inputs: Inputs) -> torch.Tensor:
        """Logits [rows, vocabulary] of one step, row i feeding ``inputs.tokens[i]``."""
        self._steps += 1
        return self._store.graphs.run(inputs)

    def leave(self, rows: list[int]) -> tuple[list[Any], list[int]]:
        """Each leaving row copied out; then the last live rows move into the holes they left,
        and step there from now on (the order returned): a copy of those rows, never a gather
        of the batch in every step after."""
        caches = [self._row_cache(row) for row in rows]
        at = [row for row in range(self._rows) if row not in rows]     # store row of each row kept
        live = len(at)
        holes = iter(row for row in sorted(rows) if row < live)
        for index in range(live - 1, -1, -1):
            if at[index] >= live:
                hole = next(holes)
                self._move(at[index], hole)
                at[index] = hole
        self._rows = live
        if not live:
            self.clear()
        return caches, sorted(range(live), key=at.__getitem__)

    def clear(self) -> None:
        if self._store is self._shared:
            self._shared.release()
        self._store, self._rows = None, 0

    def _row_cache(self, slot: int) -> Any:
        """A batch-1 ``DynamicCache`` of the row's tokens, in storage of its own."""
        cache, length = DynamicCache(), self._length(slot)
        for index, (keys, values) in enumerate(zip(self._store.keys, self._store.values)):
            cache.update(keys[slot : slot + 1, :, :length], values[slot : slot + 1, :, :length], index)
        return cache

    def _length(self, slot: int) -> int:
        return self._joined[slot] + self._steps

    def _move(self, source: int, target: int) -> None:
        length = self._length(source)
        for keys, values in zip(self._store.keys, self._store.values):
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]
        self._joined[target] = self._joined[source]


#: Columns the mask grows by when a step finds no room after it.
_ROOM = 64


def _left_padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` with zeros before its sequence dimension (dim -2 of KV, -1 of a mask) up to ``length``."""
    if tensor.dim() == 2:
        return torch.nn.functional.pad(tensor, (length - tensor.shape[-1], 0))
    return torch.nn.functional.pad(tensor, (0, 0, length - tensor.shape[-2], 0))
