"""Issue 37 on real models, no Ray: a model swapped out stays warm (``models.load.parked``), so the
swap back is a switch (co-resident) or a copy from host memory, never a file read; the warm
budget holds and evicts the least recently used; a warm swap that fails loads cold.

Two small models: `tiny`, and `tiny` with its weights perturbed, saved as a local folder (its
own id and its own outputs)."""
from __future__ import annotations

import threading

import pytest
import torch

from uniun_ray.models import Engine, GenerateRequest, generate
from uniun_ray.settings import EngineSettings
from uniun_ray.models.decode import engine as engine_module
from uniun_ray.models.load import weights as weights_module
from uniun_ray.models.load.parked import Parked, ParkedStore
from uniun_ray.models.swap import COLD, HOST, NONE, RESIDENT, SWITCH, WARM, SwapAbandoned

from test_models import tiny_cache  # noqa: F401 (fixture)

REQUEST = GenerateRequest(prompt="def fibonacci(n):", max_new_tokens=12)


@pytest.fixture(scope="module")
def other(tiny_cache, tmp_path_factory):  # noqa: F811
    """A second model: tiny's weights scaled and shifted, in a folder of its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("other-model")
    model = AutoModelForCausalLM.from_pretrained(tiny_cache["tiny"], dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.3).add_(0.01)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_cache["tiny"]).save_pretrained(folder)
    return str(folder)


def tokens(engine: Engine) -> list[int]:
    generation = generate(engine, REQUEST, threading.Event())
    list(generation)
    return generation.result.token_ids


@pytest.fixture(scope="module")
def cold(other):
    """Each model's output after a cold load, and the engine that made them."""
    engine = Engine(settings=EngineSettings(dtype="float32", coresident=False))
    outputs = {}
    for model_id in ("tiny", other):
        assert engine.load(model_id).kind == COLD
        outputs[model_id] = tokens(engine)
    assert outputs["tiny"] != outputs[other], "the second model must answer differently"
    return engine, outputs


@pytest.fixture
def tiny_warm(cold, other):
    """The module's engine with the other model active and `tiny` warm beside it, whatever the
    tests before left (one leaves nothing warm)."""
    engine, outputs = cold
    engine.load("tiny")
    engine.load(other)
    return engine, outputs


@pytest.fixture
def no_files(monkeypatch):
    """Every way back to a model's files fails: resolving, converting, from_pretrained, probing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("read the model's files")
    for target, name in ((engine_module, "materialize"), (engine_module, "resolve"),
                         (AutoModelForCausalLM, "from_pretrained"), (AutoTokenizer, "from_pretrained"),
                         (weights_module.Weights, "_tune")):
        monkeypatch.setattr(target, name, refuse)


def test_a_warm_swap_back_reads_no_file_and_answers_as_a_cold_load(tiny_warm, other, no_files):
    engine, outputs = tiny_warm
    back = engine.load("tiny")
    assert (back.kind, back.previous, back.kept) == (WARM, other, {other: HOST})
    assert tokens(engine) == outputs["tiny"]
    assert engine.load(other).kind == WARM and tokens(engine) == outputs[other]
    assert engine.load(other).kind == NONE


def test_a_coresident_switch_keeps_both_models_outputs(cold, other):
    _, outputs = cold
    engine = Engine(settings=EngineSettings(dtype="float32"))   # co-resident by default
    for model_id in ("tiny", other):
        engine.load(model_id)
    for model_id in ("tiny", other, "tiny"):
        swap = engine.load(model_id)
        assert swap.kind == SWITCH and set(swap.kept.values()) == {RESIDENT}
        assert tokens(engine) == outputs[model_id]


def test_a_warm_copy_that_does_not_come_back_loads_cold(tiny_warm, other, monkeypatch):
    engine, outputs = tiny_warm

    def lost(parked, device):
        raise RuntimeError("the copy was lost")
    monkeypatch.setattr(engine_module, "unpark", lost)
    back = engine.load("tiny")
    assert back.kind == COLD and "lost" in back.note
    assert tokens(engine) == outputs["tiny"]


def test_a_cold_load_short_of_memory_drops_the_warm_models_and_loads(cold, other, monkeypatch):
    engine, outputs = cold
    engine.load("tiny")
    engine.unload()   # nothing warm: tiny and the other model load cold below
    engine.load("tiny")
    real, failures = weights_module.Weights.load, []

    def short_once(self, *args):
        if not failures:
            failures.append(True)
            raise MemoryError("no room")
        return real(self, *args)
    monkeypatch.setattr(weights_module.Weights, "load", short_once)
    swap = engine.load(other)
    assert swap.kind == COLD and "memory short" in swap.note and swap.kept == {}
    assert tokens(engine) == outputs[other]


def test_no_warm_budget_means_every_swap_is_cold(cold, other):
    engine = Engine(settings=EngineSettings(dtype="float32", warm_mb=0))
    kinds = [engine.load(model_id).kind for model_id in ("tiny", other, "tiny")]
    assert kinds == [COLD, COLD, COLD] and engine.warm["models"] == {}


def test_the_warm_budget_is_never_exceeded_and_evicts_the_least_recently_used():
    store = ParkedStore(budget_bytes=100)
    kept = []
    for model_id, nbytes in (("a", 40), ("b", 40), ("c", 40), ("b", 40), ("d", 70), ("huge", 101)):
        evicted = store.keep(model_id, Parked(None, HOST, nbytes))
        assert store.held_bytes <= store.budget_bytes
        kept.append((list(store.kept()), evicted))
    assert kept == [(["a"], []), (["a", "b"], []), (["b", "c"], ["a"]), (["c", "b"], []),
                    (["d"], ["c", "b"]), (["d"], ["huge"])]
    assert store.pop("d").nbytes == 70 and store.pop("d") is None and len(store) == 0


def test_an_abandoned_load_leaves_nothing_active_and_the_old_model_warm(cold, other):
    """R13: a cold load whose abandon flag is set stops (SwapAbandoned); the model it replaced
    comes back as a switch."""
    _, outputs = cold
    engine = Engine(settings=EngineSettings(dtype="float32"))
    engine.load("tiny")
    abandon = threading.Event()
    abandon.set()
    with pytest.raises(SwapAbandoned):
        engine.load(other, abandon)
    assert engine.loaded is None and list(engine.warm["models"]) == ["tiny"]
    assert engine.load("tiny").kind == SWITCH and tokens(engine) == outputs["tiny"]


def test_static_rows_go_with_a_model_set_aside_and_come_back_with_it(cold, other):
    """Issue 36's static KV rows are freed when a model is set aside (on a GPU they take the
    free memory the next model needs) and made again, sized then, when it is back."""
    outputs = cold[1]
    engine = Engine(settings=EngineSettings(dtype="float32", coresident=False, kv_rows="static"))
    engine.load("tiny")
    rows = engine.resident.rows
    assert rows is not None
    for model_id in (other, "tiny"):
        engine.load(model_id)
        assert rows.keys == [] and engine.resident.rows is not None and engine.resident.rows is not rows
        assert tokens(engine) == outputs[model_id]
        rows = engine.resident.rows


def test_a_gpus_room_for_a_parked_model_is_measured_after_the_allocator_gives_its_cache_back(monkeypatch):
    """The static rows freed at a swap stay in torch's allocator cache, which the device counts as
    used: measured before it is handed back, co-residency was almost never chosen."""
    from types import SimpleNamespace

    from uniun_ray.models.load import parked

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: calls.append("mem_get_info") or (10**12, 10**12))
    monkeypatch.setattr(parked, "weight_bytes", lambda loaded: 1)
    assert parked._room_beside(SimpleNamespace(prefix=SimpleNamespace(budget_bytes=0)), torch.device("cuda", 0))
    assert calls == ["empty_cache", "mem_get_info"]
