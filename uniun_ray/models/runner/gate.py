"""Where a run looks at its cancel flag inside a forward pass: before every decoder layer.

Apart from the decode loop because loading installs it (its hooks go on the model's layers, and
whether a model has it sizes the prefill chunks) while the decode loop arms it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Protocol

import torch


class CancelFlag(Protocol):
    """What ``generate`` polls; a ``threading.Event`` is one."""

    def is_set(self) -> bool: ...


class Interrupted(Exception):
    """The layer gate found the cancel flag set in the middle of a forward pass."""


class LayerGate:
    """A cancel check before every decoder layer, armed only while a prefill chunk runs: a long
    chunk then stops within one layer of a revoke, so chunks need not be short (each short chunk
    pays for reading all the weights once). The chunk cut short leaves some layers extended and
    some not; the decode loop crops the cache back to the chunks that completed."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.flag: CancelFlag | None = None
        for layer in layers:
            layer.register_forward_pre_hook(self._check)

    def _check(self, module: Any, args: Any) -> None:
        if self.flag is not None and self.flag.is_set():
            raise Interrupted

    @contextmanager
    def armed(self, flag: CancelFlag) -> Iterator[None]:
        self.flag = flag
        try:
            yield
        finally:
            self.flag = None


def layer_gate(model: Any) -> LayerGate | None:
    """The gate over a decoder-only model's layers (`model.model.layers`, as Llama, Gemma and
    most causal LMs of transformers have them); None for another layout (chunks stay short)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return LayerGate(layers) if isinstance(layers, torch.nn.ModuleList) and len(layers) else None
