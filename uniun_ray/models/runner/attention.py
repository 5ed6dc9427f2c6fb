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

With ``UNIUN_DETERMINISTIC=1`` a CPU decode step of several left-padded rows attends each row
over its own keys, as alone (``row_invariant_sdpa``): a greedy answer then does not depend on the
rows beside it, at a cost (``benchmarks/invariance_bench.py``).

The same setting makes a CPU prefill pass of several tokens exact (``aligned_sdpa``): each token's
result depends on the tokens before it and nothing else. torch's CPU flash attention sums a
query's keys per block of 512 and runs queries per block of 32, 64 or 256 (by how many there
are), and a short last block, or a key block cut short where the pass ends, rounds otherwise: in
bfloat16 a prompt got other KV, and another greedy answer, when the prefix cache left another
suffix to read. So keys and values are padded with masked zeros to whole key blocks,
the queries with spare rows to whole query blocks, and the first pass gets an explicit causal mask
(which gives up the kernel's skipping of the masked half: the cost is in BENCHMARKS.md).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The name models are loaded with (`attn_implementation`): masks are made as for "sdpa".
NAME = "uniun_sdpa"
#: The same, exact on the CPU (``UNIUN_DETERMINISTIC``): a decode step's padded rows each attend
#: alone, a prefill pass runs in whole blocks.
ROW_INVARIANT = "uniun_sdpa_rows"


#: torch's CPU flash attention: keys per block of this many; queries per block of 32, 64 or 256,
#: by how many there are (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp).
KEY_BLOCK = 512
QUERY_BLOCKS = ((0, 32), (192, 64), (768, 256))


def grouped_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """(batch, heads, tokens, dim) query over (batch, K/V heads, cached + tokens, dim) keys and
    values; returns (batch, tokens, heads, dim), as every transformers attention function does."""
    if (attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or getattr(module, "num_key_value_groups", 1) == 1 or _special(kwargs)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _special(kwargs: dict) -> bool:
    return any(kwargs.get(name) for name in ("position_bias", "softcap", "dropout", "output_attentions"))


def aligned_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                 scaling: float | None, grouped: bool) -> torch.Tensor:
    """A causal pass of several queries (the last of the keys) in whole key and query blocks:
    the padding keys are masked out, the spare query rows dropped."""
    tokens, keys = query.shape[2], key.shape[2]
    if attention_mask is None:
        positions = torch.arange(keys, device=query.device)
        attention_mask = (positions[None, :] <= positions[keys - tokens :, None])[None, None]
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    pad_keys, pad_rows = -keys % KEY_BLOCK, _query_rows(tokens) - tokens
    key, value = (F.pad(tensor, (0, 0, 0, pad_keys)) for tensor in (key, value))
    attention_mask = F.pad(F.pad(attention_mask, (0, pad_keys), value=False), (0, 0, 0, pad_rows), value=True)
    output = F.scaled_dot_product_attention(F.pad(query, (0, 0, 0, pad_rows)), key, value,
                                            attn_mask=attention_mask, scale=scaling, enable_gqa=grouped)
    return output[:, :, :tokens].transpose(1, 2).contiguous()


def _query_rows(tokens: int) -> int:
    """``tokens`` rounded up to whole query blocks of the size torch picks for the rounded count."""
    rows = tokens
    for least, block in QUERY_BLOCKS:
        if rows >= least:
            rows = -(-tokens // block) * block
    return rows


def row_invariant_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """``grouped_sdpa``, but exact on the CPU: a decode step of several left-padded rows attends
    each row over its own keys alone, unmasked, as the row would be decoded by itself
    (``_left_padding``), and a causal pass of several tokens runs in whole blocks (``aligned_sdpa``)."""
    starts = _left_padding(query, attention_mask)
    if starts is not None:
        return torch.cat([sdpa_attention_forward(module, query[row : row + 1], key[row : row + 1, :, start:],
                                                 value[row : row + 1, :, start:], None, scaling=scaling, **kwargs)[0]
                          for row, start in enumerate(starts)]), None
    if query.shape[2] > 1 and query.device.type == "cpu" and getattr(module, "is_causal", True) and not _special(kwargs):
        grouped = getattr(module, "num_key_value_groups", 1) > 1
        return aligned_sdpa(query, key, value, attention_mask, scaling, grouped), None
    return grouped_sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _left_padding(query: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int] | None:
    """Where each row's real keys start, for a CPU decode step of several left-padded rows (one
    query token each, a mask that hides each row's leading keys and nothing else); None for any
    other pass. SDPA sums a padded row's keys in other groups than the same keys unpadded, and
    in bf16 that flipped near-tie tokens with the rows beside."""
    if query.shape[2] != 1 or query.shape[0] == 1 or attention_mask is None or query.device.type != "cpu":
        return None
    keep = attention_mask[:, 0, -1]
    keep = keep if keep.dtype == torch.bool else keep == 0
    starts = (~keep).sum(-1)
    if not torch.equal(keep, torch.arange(keep.shape[-1], device=keep.device) >= starts[:, None]):
        return None
    return starts.tolist()


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(ROW_INVARIANT, row_invariant_sdpa)
AttentionMaskInterface.register(ROW_INVARIANT, sdpa_mask)


def prefer_grouped(model: Any, row_invariant: bool = False) -> None:
    """Run a model that transformers gave SDPA attention with `grouped_sdpa` instead (or
    `row_invariant_sdpa`); a model on another implementation (eager, flash), or one that cannot
    switch, keeps its own."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    try:
        model.set_attn_implementation(ROW_INVARIANT if row_invariant else NAME)
    except (ValueError, ImportError, AttributeError):
        pass
