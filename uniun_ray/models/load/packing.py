"""Linear weights packed once, at load, into oneDNN's layout for the CPU's matmul kernels.

A decode step on a CPU multiplies a few rows by every weight matrix, so its time goes to
reading the weights. ``nn.Linear`` hands oneDNN the weights in their plain layout on every
call, which reorders them (bf16) or runs a generic kernel (float32). Packing them once into the
kernel's own blocked layout (``mkldnn._reorder_linear_weight``, the op torch.compile's CPU
weight freezing uses) and calling ``mkldnn._linear_pointwise`` cut SmolLM2-135M's decode step
at batch 4 on 2 AVX-512 cores from 42 to 36 ms in bf16 and from 57 to 50 ms in float32, though
float32 at one row went from 34 to 41 ms, which is why the probe times each dtype packed
(``benchmarks/packing_bench.py``); bf16 logits came out bit-identical to the plain layer's. The packed weight replaces the plain one, so memory does not grow (a head tied to the
embeddings keeps the shared weight for them). GPUs and weights placed by accelerate
(offloaded, hooked) are left as they are.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def available(device: torch.device) -> bool:
    """Packing needs a CPU, oneDNN in this torch build, and its two ops."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a weight packed for oneDNN. Only the bias stays a parameter:
    the packed weight is an opaque tensor that ``Module.to`` must not try to cast, so a packed
    model keeps its dtype for good."""

    def __init__(self, linear: nn.Linear, keep_plain: bool = False, one_row_as_two: bool = False) -> None:
        super().__init__()
        self.one_row_as_two = one_row_as_two
        # For ``unpack`` (a probe packs each dtype it tries); not a submodule: the model has one layer here.
        object.__setattr__(self, "plain", linear if keep_plain else None)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """With ``one_row_as_two`` (``UNIUN_DETERMINISTIC``) one row runs as two: oneDNN takes
        another kernel for a single row, whose sums round differently (bf16 and float32), while
        for two rows or more each row's result is the same bits whatever the other rows are
        (``tests/test_models.py``). So a row decoded alone gets the same logits as beside others,
        and a one-token prefill as that token in a longer one."""
        if self.one_row_as_two and x.numel() == x.shape[-1]:
            row = x.reshape(1, -1)
            out = torch.ops.mkldnn._linear_pointwise(torch.cat([row, row]), self.packed, self.bias, "none", [], "")
            return out[:1].reshape(*x.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed {self.dtype}"


def pack(model: Any, keep_plain: bool = False, one_row_as_two: bool = False) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear``; how many were swapped (0 when
    accelerate's hooks place its modules: they would move weights the packed layer no longer has).
    ``keep_plain`` keeps the plain layers beside the packed ones, for ``unpack``."""
    return swap_linears(model, lambda linear: PackedLinear(linear, keep_plain, one_row_as_two))


def swap_linears(model: Any, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` by ``make(linear)``; how many were replaced
    (none when accelerate's hooks place its modules: they would move weights the new layer no
    longer has)."""
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


def unpack(model: Any) -> None:
    """Put back the plain layers that ``pack(keep_plain=True)`` kept."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                assert child.plain is not None, "packed for good: the plain weights are gone"
                setattr(parent, name, child.plain)


def packed(model: Any) -> bool:
    return any(isinstance(module, PackedLinear) for module in model.modules())
