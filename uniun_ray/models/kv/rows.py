"""The KV rows of a batch: where the decoding jobs' keys and values live between steps.

``Batch`` decides the order of things (who joins, who leaves, when); a ``Rows`` keeps the KV of
the jobs decoding together, one row each in the order they joined, and says what one decode step
of them passes the model. Implementations differ by device: ``PaddedRows`` (a CPU's) holds one
``DynamicCache`` whose rows are left-padded to the longest, an attention mask hiding the padding
and per-row position ids; a GPU's keeps a static row per slot so a step has fixed shapes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .prefix import fork


def batchable(model: Any) -> bool:
    """Whether every layer of the cache the model builds is a plain full-attention DynamicLayer,
    which can be left-padded, stacked and cut out again."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def rows_for(device: torch.device) -> "Rows":
    """The rows a batch on ``device`` keeps its KV in; the load's step profile times the same
    (``host.steps``), so the slot count is read off the path the batch runs."""
    return PaddedRows(device)


class Rows(ABC):
    """The KV of a batch's decoding rows, in the order they joined."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def join(self, cache: Any, tokens: int) -> None:
        """Add a row holding a prefill's batch-1 ``cache`` of ``tokens`` tokens (the cache is the
        row's from now on)."""

    @abstractmethod
    def inputs(self, positions: list[int]) -> tuple[Any, dict]:
        """The cache and the shaping keywords (mask, position ids) of one decode step of every
        row, one new token each at ``positions`` (a row's tokens so far)."""

    @abstractmethod
    def stepped(self, cache: Any) -> None:
        """Keep the cache the step's forward pass returned."""

    @abstractmethod
    def leave(self, rows: list[int]) -> list[Any]:
        """Drop ``rows`` (indices in join order) at once; return each one's KV as a batch-1
        cache of its own, for the prefix cache (a revoked job's resume)."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every row, keeping nothing (the model failed: the KV may be half written)."""


class PaddedRows(Rows):
    """Rows left-padded to the longest in one ``DynamicCache``; a mask [rows, cached tokens]
    hides the padding (0), so a padded position gets exactly zero attention weight. A join pads
    and concatenates, a leave cuts the batch once (and the padding no row needs any more)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cache: Any = None
        self._mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self._mask is None else self._mask.shape[0]

    def join(self, cache: Any, tokens: int) -> None:
        if self._mask is None:
            self._cache, self._mask = cache, torch.ones((1, tokens), dtype=torch.long, device=self._device)
            return
        length = max(self._mask.shape[1], tokens)
        for layer, joining in zip(self._cache.layers, cache.layers):
            layer.keys = torch.cat([_left_padded(layer.keys, length), _left_padded(joining.keys, length)])
            layer.values = torch.cat([_left_padded(layer.values, length), _left_padded(joining.values, length)])
        row = torch.ones((1, tokens), dtype=torch.long, device=self._mask.device)
        self._mask = torch.cat([_left_padded(self._mask, length), _left_padded(row, length)])

    def inputs(self, positions: list[int]) -> tuple[Any, dict]:
        rows = len(self)
        self._mask = torch.cat([self._mask, torch.ones((rows, 1), dtype=torch.long, device=self._device)], dim=1)
        if rows == 1:   # one row is never padded: it runs exactly as a lone run does
            return self._cache, {}
        return self._cache, {"attention_mask": self._mask,
                             "position_ids": torch.tensor([[position] for position in positions], device=self._device)}

    def stepped(self, cache: Any) -> None:
        self._cache = cache

    def leave(self, rows: list[int]) -> list[Any]:
        """Each leaving row's KV is cut out before the batch is cut, in one cut for all of them:
        a chat that revokes ten companions (R23) costs one copy of the batch, not ten."""
        caches = [self._row_cache(row) for row in rows]
        keep = [index for index in range(len(self)) if index not in rows]
        if not keep:
            self.clear()
            return caches
        self._mask = self._mask[keep]
        start = int(self._mask.any(dim=0).int().argmax())     # the first column a row uses
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys, layer.values = layer.keys[keep, :, start:], layer.values[keep, :, start:]
        return caches

    def clear(self) -> None:
        self._cache = self._mask = None

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


def _left_padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` with zeros before its sequence dimension (dim -2 of KV, -1 of a mask) up to ``length``."""
    if tensor.dim() == 2:
        return torch.nn.functional.pad(tensor, (length - tensor.shape[-1], 0))
    return torch.nn.functional.pad(tensor, (0, 0, length - tensor.shape[-2], 0))
