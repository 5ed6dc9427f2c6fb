"""Fused Llama layers (``models/load/fusing.py``) compute the same bits as transformers' own.

Two copies of a model, one fused, read the same prompt and then decode the same tokens as padded
rows of different lengths (a mask and left padding, as a batch keeps them), in float32 and
bf16, plain and packed for oneDNN: every logit equal. SmolLM2 has grouped K/V heads (9 over 3),
the `tiny` fixture not.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from uniun_ray.models.kv.prefix import crop_layers
from uniun_ray.models.load import fusing, packing
from uniun_ray.models.registry import DEFAULT_CHAT_MODEL, materialize, resolve
from uniun_ray.models.runner.attention import prefer_grouped
from uniun_ray.models.runner.forward import Runner
from uniun_ray.models.runner.rows import PaddedRows

CPU = torch.device("cpu")
PROMPT = [(7919 * i) % 30000 + 5 for i in range(40)]
LENGTHS = (40, 33, 27)


def loaded(model_id: str, dtype: str, packed: bool, fused: bool):
    model = AutoModelForCausalLM.from_pretrained(materialize(resolve(model_id)), dtype=getattr(torch, dtype),
                                                 device_map="cpu", use_kernels=False).eval()
    prefer_grouped(model)
    if fused:
        assert fusing.fuse(model) == model.config.num_hidden_layers
    if packed:
        packing.pack(model)
    return Runner(model, "cache", {"logits_to_keep": 1})


def logits_of(runner: Runner, steps: int = 4) -> list[torch.Tensor]:
    """The prompt's last logits, then each decode step's of three rows cut to ``LENGTHS``."""
    last, cache = runner.prefill(PROMPT, None, CPU)
    seen, rows = [last], PaddedRows(CPU, runner)
    for length in LENGTHS:
        row = copy.deepcopy(cache)
        crop_layers(row, length)
        rows.join(row, length)
    tokens = [PROMPT[length - 1] for length in LENGTHS]
    for step in range(steps):
        logits = rows.decode(tokens, [length + step for length in LENGTHS])
        seen.append(logits)
        tokens = logits.argmax(-1).tolist()
    return seen


@pytest.mark.parametrize("model_id", ["tiny", DEFAULT_CHAT_MODEL])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_fused_layers_give_transformers_logits_to_the_bit(model_id, dtype, packed):
    if packed and not packing.available(CPU):
        pytest.skip("no oneDNN packing in this torch build")
    own, fused = (logits_of(loaded(model_id, dtype, packed, fused)) for fused in (False, True))
    for step, (expected, got) in enumerate(zip(own, fused)):
        assert torch.equal(expected, got), f"pass {step}: largest difference {(expected - got).abs().max()}"


def test_only_transformers_own_llama_layers_are_fused():
    runner = loaded("tiny", "float32", packed=False, fused=False)
    layers = runner.model.model.layers
    kind = type(layers[0].self_attn)
    layers[0].self_attn.__class__ = type("Changed", (kind,), {})   # a subclass may compute otherwise
    assert fusing.fuse(runner.model) == len(layers) - 1
    assert type(layers[0].self_attn).__name__ == "Changed"
    assert isinstance(layers[1].self_attn, fusing.FusedAttention)
