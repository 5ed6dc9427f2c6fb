"""The engine's host choices (issue 9): forced settings are checked, the probe's results are
cached per host and model, and prefill chunks follow the step times measured on this host."""
from __future__ import annotations

import threading

import pytest

from uniun_ray.models.settings import EngineSettings
from uniun_ray.models.tuning import (MAX_CHUNK, MIN_CHUNK, ProbeCache, Speed, StepClock, fastest, measure,
                                     thread_options)


def test_settings_come_from_the_environment_with_clear_errors():
    assert EngineSettings.from_env({}) == EngineSettings("auto", None, None)
    assert EngineSettings.from_env({"UNIUN_DTYPE": "float32", "UNIUN_THREADS": "3", "UNIUN_KV_CACHE_MB": "0"}) \
        == EngineSettings("float32", 3, 0)
    assert EngineSettings.from_env({"UNIUN_KV_OFFLOAD_MB": "0"}).kv_offload_mb == 0
    for name in ("UNIUN_KV_CACHE_MB", "UNIUN_KV_OFFLOAD_MB"):
        for bad in ("-1", "1e3", "lots"):
            with pytest.raises(ValueError, match=rf"{name}='{bad}' is not a size in MB"):
                EngineSettings.from_env({name: bad})
    with pytest.raises(ValueError, match="kv_offload_mb must be an int >= 0"):
        EngineSettings(kv_offload_mb=-5)
    with pytest.raises(ValueError, match=r"UNIUN_DTYPE='fp8' is not a dtype; use one of auto, bfloat16"):
        EngineSettings.from_env({"UNIUN_DTYPE": "fp8"})
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match=rf"UNIUN_THREADS='{bad}' is not a thread count"):
            EngineSettings.from_env({"UNIUN_THREADS": bad})
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        EngineSettings(threads=True)


def test_unset_threads_mean_every_core_this_process_may_use():
    import os
    assert EngineSettings().resolved_threads() == len(os.sched_getaffinity(0))
    assert EngineSettings(threads=5).resolved_threads() == 5


def test_the_faster_dtype_is_the_one_with_the_faster_typical_chat_turn():
    # bf16 decodes faster, float32 prefills much faster (an AVX2 host): the turn decides
    bf16, fp32 = Speed("bfloat16", 15e-3, 45e-3, 2), Speed("float32", 2.3e-3, 80e-3, 2)
    assert fastest([bf16, fp32]) is fp32
    avx512_bf16 = Speed("bfloat16", 1.4e-3, 40e-3, 2)
    assert fastest([avx512_bf16, fp32]) is avx512_bf16


def test_threads_measured_are_the_whole_budget_and_half_of_it():
    assert thread_options(2) == [2, 1] and thread_options(16) == [16, 8] and thread_options(1) == [1]
    fewer = Speed("float32", 1.5e-4, 2.3e-3, 1)      # a small model inside Ray on 2 cores
    assert fastest([Speed("float32", 1e-4, 4.0e-3, 2), fewer]) is fewer


def test_measure_times_a_prefill_and_decode_steps_of_the_given_step():
    calls = []

    def step(ids, cache):
        calls.append(len(ids))
        return None, (cache or 0) + len(ids)
    speed = measure(step, vocab_size=100, dtype="float32", threads=3)
    assert calls[:2] == [8, 64] and calls[2:] == [1] * 6       # warm-up, prefill, decode steps
    assert speed.dtype == "float32" and speed.threads == 3 and speed.prefill_s_per_token >= 0 and speed.decode_s >= 0


def test_chunks_converge_to_two_decode_steps_whatever_the_cost_model():
    decode = 80e-3
    clock = StepClock(Speed("float32", prefill_s_per_token=5e-3, decode_s=decode, threads=1))
    assert clock.chunk == int(64 * 2 * decode / (64 * 5e-3))           # seeded from the probe: 32
    costs = {"fixed + per token": (lambda n: decode + 3e-3 * n, 26),    # additive: 80 + 3n = 160 ms
             "roofline": (lambda n: max(decode, 3e-3 * n), 53),         # memory- or compute-bound
             "prefill 3x slower": (lambda n: 3 * (decode + 3e-3 * n), MIN_CHUNK)}
    for name, (cost, expected) in costs.items():
        clock = StepClock(Speed("float32", 5e-3, decode, 1))
        for _ in range(60):
            clock.observe(clock.chunk, cost(clock.chunk))
        assert abs(clock.chunk - expected) <= 2, (name, clock.chunk)
    assert StepClock(Speed("x", 1.0, 1e-3, 1)).chunk == MIN_CHUNK
    assert StepClock(Speed("x", 0.0, 1e-3, 1)).chunk == MAX_CHUNK


def test_decode_steps_move_the_target_and_a_short_tail_is_ignored():
    clock = StepClock(Speed("float32", 2e-3, 80e-3, 1))
    before = clock.chunk
    clock.observe(3, 100.0)                       # a short tail chunk: ignored
    assert clock.chunk == before
    for _ in range(40):
        clock.observe(1, 160e-3)                  # decoding got twice as slow
    assert abs(clock.decode_s - 160e-3) < 1e-3 and abs(clock.target_s - 320e-3) < 2e-3


def test_probe_cache_survives_restarts_and_ignores_a_corrupt_file(tmp_path):
    path = tmp_path / "tuning.json"
    speeds = [Speed("bfloat16", 1e-3, 2e-2, 2), Speed("float32", 5e-4, 3e-2, 1)]
    ProbeCache(path).put("host|model", speeds)
    assert ProbeCache(path).get("host|model") == speeds and ProbeCache(path).get("other") is None
    path.write_text("{not json")
    assert ProbeCache(path).get("host|model") is None
    ProbeCache(path).put("host|model", speeds)   # rewritten whole
    assert ProbeCache(path).get("host|model") == speeds


def test_concurrent_writers_leave_a_readable_cache(tmp_path):
    path = tmp_path / "tuning.json"
    writers = [threading.Thread(target=ProbeCache(path).put, args=(f"k{i}", [Speed("float32", 1e-3, 1e-2, 1)]))
               for i in range(8)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert ProbeCache(path).get("k0") in (None, [Speed("float32", 1e-3, 1e-2, 1)])
    assert isinstance(ProbeCache(path)._read(), dict) and ProbeCache(path)._read()


def test_max_memory_comes_from_the_environment_as_device_size_pairs():
    settings = EngineSettings.from_env({"UNIUN_MAX_MEMORY": "0=6GiB, cpu=20GiB"})
    assert settings.max_memory == {"0": "6GiB", "cpu": "20GiB"}
    with pytest.raises(ValueError, match="write DEVICE=SIZE pairs"):
        EngineSettings.from_env({"UNIUN_MAX_MEMORY": "6GiB"})
    with pytest.raises(ValueError, match=r"UNIUN_MAX_MEMORY='cpu=huge': max_memory: size 'huge'"):
        EngineSettings.from_env({"UNIUN_MAX_MEMORY": "cpu=huge"})
