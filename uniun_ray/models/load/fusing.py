"""A Llama-family decoder layer's sibling projections read as one matrix, on the CPU.

A CPU decode step of a small model is its weights' reads plus many small ops around them, each
paying the dispatcher: per layer, transformers calls three linear kernels for q, k and v (k and
v of a few hundred outputs), two for gate and up, rotates q and k apart (a dozen elementwise
ops) and normalizes in seven. Here q|k|v and gate|up are each one matrix (one kernel call, its
weights read in one stream), q and k are rotated together as one tensor, with the sign of
``rotate_half`` folded into the sine once per forward pass, and RMSNorm is ``torch.rms_norm``.
Every output is the same sum of the same products as transformers' layers compute it: the
logits came out the same bits in float32 and bf16 where measured, and ``tests/test_fusing.py``
holds them within rounding (a CPU's kernels may sum a wider matrix in another order). What it
saves per step is in BENCHMARKS.md ("Slots", ``fusing_bench``).

Only layers whose classes are transformers' Llama ones are fused (SmolLM2, Llama, the test
fixture): another family's attention may pass more to its attention function (a sliding window,
norms of q and k) and keeps its own. GPUs are left as they are: there the step replays as a
CUDA graph and the dispatcher's cost is not paid per op.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm


def _llama() -> Any:
    """transformers' Llama module where a Llama model was loaded, else None: importing it takes
    seconds that a process loading no Llama model need not pay, and no layer can be Llama's then."""
    return sys.modules.get("transformers.models.llama.modeling_llama")


def fuse(model: Any) -> int:
    """Fuse every Llama decoder layer of ``model`` in place; how many layers were fused (0 where
    accelerate's hooks place its modules: they move the weights the fused layers replace)."""
    layers, llama = getattr(getattr(model, "model", None), "layers", None), _llama()
    if layers is None or llama is None or any(hasattr(module, "_hf_hook") for module in model.modules()):
        return 0
    rotation = _Rotation()
    fused = 0
    for layer in layers:
        if not _fusable(layer, llama):
            continue
        layer.self_attn = FusedAttention(layer.self_attn, rotation)
        layer.mlp = FusedMLP(layer.mlp)
        layer.input_layernorm = FusedRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm)
        fused += 1
    norm = getattr(model.model, "norm", None)
    if fused and type(norm) is llama.LlamaRMSNorm:
        model.model.norm = FusedRMSNorm(norm)
    return fused


def fused(model: Any) -> bool:
    return any(isinstance(module, FusedAttention) for module in model.modules())


def _fusable(layer: Any, llama: Any) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (type(attention) is llama.LlamaAttention and type(mlp) is llama.LlamaMLP
            and mlp.config.hidden_act == "silu"
            and all(type(getattr(layer, name, None)) is llama.LlamaRMSNorm
                    for name in ("input_layernorm", "post_attention_layernorm"))
            and all(type(getattr(module, name)) is nn.Linear
                    for module, names in ((attention, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                          (mlp, ("gate_proj", "up_proj", "down_proj")))
                    for name in names))


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose outputs are ``linears``' outputs, one after another."""
    first = linears[0]
    stacked = nn.Linear(first.in_features, sum(linear.out_features for linear in linears),
                        bias=first.bias is not None, device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([linear.weight for linear in linears]))
        if first.bias is not None:
            stacked.bias.copy_(torch.cat([linear.bias for linear in linears]))
    return stacked.requires_grad_(False)


class _Rotation:
    """The sine with ``rotate_half``'s sign folded in (its first half negated), made once per
    forward pass: every layer of a pass gets the same ``sin`` tensor."""

    def __init__(self) -> None:
        self._last: tuple[Any, Any] = (None, None)   # one tuple: a pass in another thread sees a pair

    def signed(self, sin: torch.Tensor) -> torch.Tensor:
        last_sin, signed = self._last
        if sin is not last_sin:
            half = sin.shape[-1] // 2
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            self._last = (sin, signed)
        return signed


class FusedAttention(nn.Module):
    """``LlamaAttention`` with q, k and v read as one matrix and q and k rotated together.
    ``rotate_half(x) * sin`` is ``x.roll(half) * signed``: the same products, the same sum."""

    def __init__(self, attention: LlamaAttention, rotation: _Rotation) -> None:
        super().__init__()
        config = attention.config
        self.config, self.layer_idx, self.head_dim = config, attention.layer_idx, attention.head_dim
        self.num_key_value_groups, self.scaling = attention.num_key_value_groups, attention.scaling
        self.attention_dropout, self.is_causal = attention.attention_dropout, attention.is_causal
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv = _stacked([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = attention.o_proj
        self._rotation = rotation
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self._functions, self._eager = ALL_ATTENTION_FUNCTIONS, _llama().eager_attention_forward

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        batch, tokens = hidden_states.shape[:2]
        rotated = (self.heads + self.kv_heads) * self.head_dim
        qkv = self.qkv(hidden_states)
        qk = qkv[..., :rotated].view(batch, tokens, -1, self.head_dim).transpose(1, 2)
        values = qkv[..., rotated:].view(batch, tokens, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        signed = self._rotation.signed(sin).unsqueeze(1)
        qk = qk * cos.unsqueeze(1) + qk.roll(self.head_dim // 2, -1) * signed
        query, keys = qk[:, : self.heads], qk[:, self.heads :]
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx, kwargs=kwargs)
        attend = self._functions.get_interface(self.config._attn_implementation, self._eager)
        output, weights = attend(self, query, keys, values, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **kwargs)
        return self.o_proj(output.reshape(batch, tokens, -1).contiguous()), weights


class FusedMLP(nn.Module):
    """``LlamaMLP`` with gate and up read as one matrix."""

    def __init__(self, mlp: LlamaMLP) -> None:
        super().__init__()
        self.gate_up = _stacked([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class FusedRMSNorm(nn.Module):
    """``LlamaRMSNorm`` in fewer ops: normalized in float32, rounded to the input's dtype, then
    scaled, as transformers does."""

    def __init__(self, norm: LlamaRMSNorm) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normalized = torch.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), eps=self.variance_epsilon)
        return self.weight * normalized.to(hidden_states.dtype)
