"""Linear layers in int8 on a CPU: weights per output channel, activations per row.

A decode step on a CPU reads every weight once, so its time is the bytes of the weights over
the memory's bandwidth: int8 weights are a quarter of float32's. Each row of the activations is
scaled to int8 on its own (its largest magnitude to 127), the product is exact in int32
(``torch._int_mm``: VNNI-class instructions where the CPU has them), then scaled back by the
row's and the channel's scales. So a row's result never depends on the rows beside it (no batch
statistic, no rounding of sums that other rows change), which ``UNIUN_DETERMINISTIC`` needs
and float32's oneDNN kernels do not give for one row against two.

What it costs is accuracy: tokens differ from float32's within a few dozen, and perplexity
grows by a few percent on a small model (``benchmarks/int8_quality.py`` measures it;
BENCHMARKS.md, "int8"). Dynamic quantization with one scale for the whole batch's activations,
7 bits wide (``torch.ao.quantization.quantize_dynamic``'s default), tripled SmolLM2-135M's
perplexity; weights in int8 with float activations (``_weight_int8pack_mm``) kept it but
ran slower than float32 on this CPU. It is the user's choice (``UNIUN_DTYPE=int8``), never "auto"'s.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .packing import swap_linears


def available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch, "_int_mm")


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (per output channel) and int8 activations (per row)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().float()
            scale = weight.abs().amax(1).clamp(min=1e-12) / 127
            # buffers, so the memory plan counts them (``parked.weight_bytes``)
            self.register_buffer("weight_t", torch.round(weight / scale[:, None]).to(torch.int8).t().contiguous(),
                                 persistent=False)   # [in, out]
            self.register_buffer("scale", scale, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        row_scale = rows.abs().amax(1, keepdim=True).clamp_(min=1e-12) / 127
        product = torch._int_mm(torch.round(rows / row_scale).to(torch.int8), self.weight_t)
        out = (product * row_scale * self.scale).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize(model: Any) -> int:
    """Swap every ``nn.Linear`` of ``model`` for an ``Int8Linear``; how many were swapped (0 when
    accelerate's hooks place its modules). A head tied to the embeddings gets int8 weights of its
    own; the embeddings keep theirs."""
    return swap_linears(model, Int8Linear)
