"""int8 linear layers (``UNIUN_DTYPE=int8``, ``models/load/int8.py``): close to float32, a row's
result its own whatever the rows beside it, and an engine that serves with them."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from test_models import PROMPT, tiny_cache  # noqa: F401 (fixture)
from uniun_ray.models import GenerateRequest
from uniun_ray.models.decode.batch import Batch
from uniun_ray.models.decode.engine import Engine
from uniun_ray.models.load.int8 import Int8Linear, quantize
from uniun_ray.settings import EngineSettings


def test_an_int8_linear_is_close_to_its_float_layer_and_each_rows_result_is_its_own():
    """Relative error of a few tenths of a percent; a row alone gives exactly what it gives
    beside 7 others of another scale (each row is scaled on its own, the product is exact)."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=True)
    layer = Int8Linear(linear)
    x = torch.randn(8, 576) * torch.logspace(-2, 2, 8)[:, None]
    with torch.no_grad():
        exact, approx = linear(x), layer(x)
    error = ((approx - exact).norm(dim=1) / exact.norm(dim=1)).max()
    assert error < 0.02, error
    assert torch.equal(layer(x[3:4]), approx[3:4])
    assert layer(x[None]).shape == (1, 8, 1536)


def test_quantize_swaps_every_linear_and_unties_a_tied_head():
    embed = nn.Embedding(100, 16)
    model = nn.Module()
    model.embed, model.inner, model.head = embed, nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 100)
    model.head.weight = embed.weight
    assert quantize(model) == 2
    assert isinstance(model.head, Int8Linear) and isinstance(model.inner[0], Int8Linear)
    assert model.embed.weight.dtype == torch.float32     # the embeddings keep their weights


def test_an_engine_with_int8_serves_its_rows_as_each_would_alone(tiny_cache):  # noqa: F811
    """``UNIUN_DTYPE=int8``: the status says so; a greedy row's tokens are the same alone and
    beside three others (deterministic mode: the rest of the step is row-invariant too)."""
    engine = Engine("cpu", EngineSettings(dtype="int8", threads=1, deterministic=True))
    engine.load("tiny")
    described = engine.describe()
    assert described["dtype"] == "int8" and described["int8_linears"] > 0 and described["packed_linears"] == 0
    request = GenerateRequest(prompt=PROMPT, max_new_tokens=12)

    def tokens(beside: int) -> tuple[int, ...]:
        batch = Batch(engine, slots=1 + beside)
        jobs = [batch.add(request, threading.Event())] + [
            batch.add(GenerateRequest(prompt=PROMPT * (2 + n), max_new_tokens=12), threading.Event())
            for n in range(beside)]
        batch.run()
        return jobs[0].result.token_ids
    assert tokens(0) == tokens(3) and len(tokens(0)) == 12


def test_int8_is_a_dtype_setting():
    assert EngineSettings(dtype="int8").dtype == "int8"
    with pytest.raises(ValueError, match="int8"):
        EngineSettings(dtype="int4")


def test_the_vllm_engine_refuses_int8_by_name():
    from uniun_ray.engines import create
    with pytest.raises(ValueError, match="UNIUN_DTYPE=int8 is the transformers engine's"):
        create(EngineSettings(dtype="int8", engine="vllm"), "cpu", lambda: None)
