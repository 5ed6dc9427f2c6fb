"""transformers' SDPA attention, without copying grouped K/V heads in a CPU prefill over a cache.

A model with grouped-query attention keeps fewer K/V heads than query heads (SmolLM2: 9 query
heads over 3, Gemma-3-270M: 4 over 1). When a forward pass reads several new tokens over a
cached prefix (a conversation's next turn, a chunk of a long prompt), transformers has a mask to
pass and, except on XPU and MPS, copies every K/V head once per query head (`repeat_kv`) before
torch's SDPA: the whole cached K and V, in every layer, each pass. torch's SDPA reads grouped
heads as they are (`enable_gqa`), and on the CPU it does so with a mask as fast as without;
transformers keeps the copy for CUDA, whose fast kernels want no mask with it. So on the CPU
this implementation passes the heads as they are; everywhere else it is transformers' own. The
result is the same to the bit (tests/test_models.py). Measured on SmolLM2 in float32, one
thread, 18 new tokens over 1,177 cached: 230 → 184 ms CPU a pass (the copy was 27 ms of it).
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The name models are loaded with (`attn_implementation`): masks are made as for "sdpa".
NAME = "uniun_sdpa"


def grouped_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """(batch, heads, tokens, dim) query over (batch, K/V heads, cached + tokens, dim) keys and
    values; returns (batch, tokens, heads, dim), as every transformers attention function does."""
    if (attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or getattr(module, "num_key_value_groups", 1) == 1
            or any(kwargs.get(name) for name in ("position_bias", "softcap", "dropout", "output_attentions"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                              scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


def prefer_grouped(model: Any) -> None:
    """Run a model that transformers gave SDPA attention with `grouped_sdpa` instead; a model
    on another implementation (eager, flash), or one that cannot switch, keeps its own."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError, AttributeError):
        pass
