"""Fused Llama layers (``models/load/fusing.py``) compute what transformers' own compute.

Two copies of a model, one fused, read the same prompt and then decode the same tokens (the
plain copy's choices) as padded rows of different lengths (a mask and left padding, as a batch
keeps them), in float32 and bf16, plain and packed for oneDNN: every logit within rounding. Each
fused output is the same sum of the same products; a CPU's kernels may still sum a wider matrix
in another order, so the test holds rounding, not bits (they were the same bits where measured:
BENCHMARKS.md, ``fusing_bench``). SmolLM2 has grouped K/V heads (9 over 3), the `tiny` fixture not.
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
from uniun_ray.models.runner.forward import Inputs, Runner
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


#: How far a fused copy's logits may be from the plain copy's, as a share of their largest: a
#: few units of each dtype's rounding (a wrong sign in the rotation moves them by tens of percent).
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.02}


def logits_of(runner: Runner, fed: list[list[int]] | None = None, steps: int = 4) -> tuple[list, list]:
    """The prompt's last logits, then each decode step's of three rows cut to ``LENGTHS``, the
    rows fed ``fed`` (each step's tokens; None: their own greedy choices); and what was fed."""
    last, cache = runner.prefill(PROMPT, None, CPU)
    seen, rows = [last], PaddedRows(CPU, runner)
    for length in LENGTHS:
        row = copy.deepcopy(cache)
        crop_layers(row, length)
        rows.join(row, length)
    tokens, feeding = [PROMPT[length - 1] for length in LENGTHS], []
    for step in range(steps):
        tokens = fed[step] if fed is not None else tokens
        feeding.append(tokens)
        logits = rows.decode(Inputs.of(tokens, [length + step for length in LENGTHS], CPU))
        seen.append(logits)
        tokens = logits.argmax(-1).tolist()
    return seen, feeding


@pytest.mark.parametrize("model_id", ["tiny", DEFAULT_CHAT_MODEL])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_fused_layers_give_transformers_logits(model_id, dtype, packed):
    if packed and not packing.available(CPU):
        pytest.skip("no oneDNN packing in this torch build")
    own, fed = logits_of(loaded(model_id, dtype, packed, fused=False))
    fused, _ = logits_of(loaded(model_id, dtype, packed, fused=True), fed)
    for step, (expected, got) in enumerate(zip(own, fused)):
        largest = float(expected.abs().max())
        torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype] * largest, rtol=0,
                                   msg=lambda text: f"pass {step}: {text}")


def test_only_transformers_own_llama_layers_are_fused():
    runner = loaded("tiny", "float32", packed=False, fused=False)
    layers = runner.model.model.layers
    kind = type(layers[0].self_attn)
    layers[0].self_attn.__class__ = type("Changed", (kind,), {})   # a subclass may compute otherwise
    assert fusing.fuse(runner.model) == len(layers) - 1
    assert type(layers[0].self_attn).__name__ == "Changed"
    assert isinstance(layers[1].self_attn, fusing.FusedAttention)
