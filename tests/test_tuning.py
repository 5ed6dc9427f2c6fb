"""The engine's host choices (issue 9): forced settings are checked, the probe's results are
cached per host and model, and prefill chunks follow the step times measured on this host.
Issue 25: the slot count a step profile implies, how much of the probe's cores others took,
and a probe that later decode steps beat."""
from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest

from uniun_ray.models.tune.contention import Taken, others_share
from uniun_ray.settings import EngineSettings
from uniun_ray.models.runner.profile import CPU_BATCHES, auto_slots
from uniun_ray.models.tune.tuning import (BEATEN_AFTER, MAX_CHUNK, MIN_CHUNK, Probe, ProbeCache, Speed, StepClock,
                                     fastest, measure, revised, thread_options)

QUIET = Taken("2026-12-03T10:00:00+00:00", 1.5, 0.02, (0.1, 0.2), False)


def probe(speeds=(), steps=None, taken=QUIET) -> Probe:
    return Probe(list(speeds), steps or {1: 0.05, 2: 0.06}, taken)


def test_settings_come_from_the_environment_with_clear_errors():
    assert EngineSettings.from_env({}) == EngineSettings("auto", None, None)
    assert EngineSettings.from_env({"UNIUN_DTYPE": "float32", "UNIUN_THREADS": "3", "UNIUN_KV_CACHE_MB": "0"}) \
        == EngineSettings("float32", 3, 0)
    assert EngineSettings.from_env({"UNIUN_KV_OFFLOAD_MB": "0"}).kv_offload_mb == 0
    for name in ("UNIUN_KV_CACHE_MB", "UNIUN_KV_OFFLOAD_MB"):
        for bad in ("-1", "1e3", "lots"):
            with pytest.raises(ValueError, match=rf"{name}='{bad}' is not allowed: use megabytes: an integer >= 0"):
                EngineSettings.from_env({name: bad})
    with pytest.raises(ValueError, match=r"kv_offload_mb \(UNIUN_KV_OFFLOAD_MB\) must be megabytes: an integer >= 0"):
        EngineSettings(kv_offload_mb=-5)
    with pytest.raises(ValueError, match=r"UNIUN_DTYPE='fp8' is not allowed: use one of auto, bfloat16"):
        EngineSettings.from_env({"UNIUN_DTYPE": "fp8"})
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match=rf"UNIUN_THREADS='{bad}' is not allowed: use a thread count"):
            EngineSettings.from_env({"UNIUN_THREADS": bad})
    with pytest.raises(ValueError, match=r"threads \(UNIUN_THREADS\) must be a thread count: an integer >= 1"):
        EngineSettings(threads=True)


@pytest.mark.parametrize("name, field, what", [("UNIUN_HUB_KERNELS", "hub_kernels", "let transformers fetch"),
                                               ("UNIUN_DETERMINISTIC", "deterministic", "get one greedy answer")])
def test_opt_in_switches_are_off_unless_the_user_sets_them_by_name(name, field, what):
    assert getattr(EngineSettings.from_env({}), field) is False is getattr(EngineSettings(), field)
    assert getattr(EngineSettings.from_env({name: "0"}), field) is False
    assert getattr(EngineSettings.from_env({name: "1"}), field) is True
    for bad in ("yes", "2", "true"):
        with pytest.raises(ValueError, match=rf"{name}='{bad}' is not allowed: use 1 to {what}"):
            EngineSettings.from_env({name: bad})


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


def test_the_dtype_is_the_faster_over_every_thread_count_the_loop_may_serve_with():
    """A 2-core AVX-512 host without bf16 arithmetic (SmolLM2's probe): bf16 wins the turn at 2
    threads by 3%, loses it by 50% at 1, where the loop serves when the host is busy: float32,
    at 2 threads."""
    bf16_2, bf16_1 = Speed("bfloat16", 5.75e-3, 57.8e-3, 2), Speed("bfloat16", 12.4e-3, 87.7e-3, 1)
    fp32_2, fp32_1 = Speed("float32", 2.80e-3, 84.1e-3, 2), Speed("float32", 4.01e-3, 91.4e-3, 1)
    assert bf16_2.score < fp32_2.score
    assert fastest([bf16_2, bf16_1, fp32_2, fp32_1]) is fp32_2
    assert fastest([bf16_2, fp32_2]) is bf16_2      # one thread count: the turn alone decides


def test_a_dtype_fastest_at_the_fewest_threads_is_chosen_there():
    """A 2-core AMD host with native bf16 (SmolLM2's probe): bf16 loses the turn at 2 threads and
    wins it by a third at 1, where the loop served beside an HTTP front end: bf16, at 1 thread
    (the mean over the counts chose float32: its 4-row step served at 1 thread took 48 ms, bf16's 41)."""
    bf16_2, bf16_1 = Speed("bfloat16", 4.43e-3, 61.4e-3, 2), Speed("bfloat16", 1.66e-3, 37.0e-3, 1)
    fp32_2, fp32_1 = Speed("float32", 2.03e-3, 41.3e-3, 2), Speed("float32", 2.90e-3, 50.8e-3, 1)
    assert fastest([bf16_2, bf16_1, fp32_2, fp32_1]) is bf16_1


def test_a_step_profile_taken_at_a_pair_no_longer_kept_is_not_current():
    """A probe cached before ``fastest`` changed its choice holds the profile of another dtype or
    thread count (R23's companions read it): the load measures it anew."""
    speeds = [Speed("bfloat16", 1.66e-3, 37.0e-3, 1), Speed("float32", 2.03e-3, 41.3e-3, 2)]
    assert replace(probe(speeds), at=("bfloat16", 1)).current
    assert not replace(probe(speeds), at=("float32", 2)).current
    assert not probe(speeds).current                                  # cached before the pair was kept


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


def test_probe_cache_survives_restarts_and_ignores_a_corrupt_file_or_an_older_shape(tmp_path):
    path = tmp_path / "tuning.json"
    kept = replace(probe([Speed("bfloat16", 1e-3, 2e-2, 2), Speed("float32", 5e-4, 3e-2, 1)],
                         {1: 0.05, 16: 0.07, 2: 0.06}), at=("float32", 1))
    ProbeCache(path).put("host|model", kept)
    assert ProbeCache(path).get("host|model") == kept and ProbeCache(path).get("other") is None
    assert list(ProbeCache(path).get("host|model").steps) == [1, 2, 16]      # in batch order, as ints
    path.write_text("{not json")
    assert ProbeCache(path).get("host|model") is None
    path.write_text('{"host|model": [{"dtype": "float32", "prefill_s_per_token": 1, "decode_s": 1, "threads": 1}]}')
    assert ProbeCache(path).get("host|model") is None                       # before issue 25: measured anew
    ProbeCache(path).put("host|model", kept)   # rewritten whole
    assert ProbeCache(path).get("host|model") == kept


def test_concurrent_writers_leave_a_readable_cache(tmp_path):
    path = tmp_path / "tuning.json"
    one = probe([Speed("float32", 1e-3, 1e-2, 1)])
    writers = [threading.Thread(target=ProbeCache(path).put, args=(f"k{i}", one)) for i in range(8)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert ProbeCache(path).get("k0") in (None, one)
    assert isinstance(ProbeCache(path)._read(), dict) and ProbeCache(path)._read()


def test_auto_slots_take_the_knee_of_the_whole_curve():
    sizes = (1, 2, 4, 8, 16, 32, 64)
    gpu = {b: 0.010 * (1 + 0.01 * b) for b in sizes}               # a step costs about the same at any batch
    cpu = {b: 0.050 * b for b in sizes}                               # a step costs B steps of one
    knee = {1: 0.050, 2: 0.055, 4: 0.060, 8: 0.115, 16: 0.230}      # flat to 4 rows, then about linear
    assert auto_slots(gpu) == 64 and auto_slots(cpu) == 1 and auto_slots(knee) == 4
    assert auto_slots(gpu, limit=12) == 12 and auto_slots(knee, limit=64) == 4 and auto_slots(cpu, limit=8) == 1
    assert auto_slots({1: 0.05}) == 1 and auto_slots({}) == 1       # a model that cannot be batched
    # flat steps: the bar is SLOT_MARGIN under the best; 3 rows reach 3/4 of 4 rows' rate, 3.4 clear it
    assert auto_slots({1: 1.0, 3: 1.0, 4: 1.0}) == 4 and auto_slots({1: 1.0, 3: 3 / 3.4, 4: 1.0}) == 3


#: The engine's probe on an H200, 8B Llama shape, bf16 (2026-12-04, ../shared/gpu/runs/
#: 2026-12-04-engine-probe.json: its 1-row step was timed without the mask the others had).
H200_8B = {1: 0.06521293999998079, 2: 0.11562372400004506, 4: 0.11989589099999876, 8: 0.11244917400000531,
           16: 0.11105244700002004, 32: 0.11485937100002275, 64: 0.11267089999995505}


def jittered(profile: dict[int, float], seed: int, share: float = 0.10) -> dict[int, float]:
    rng = random.Random(seed)
    return {batch: seconds * rng.uniform(1 - share, 1 + share) for batch, seconds in profile.items()}


def test_auto_slots_read_the_h200_profile_as_dozens_of_slots_whatever_the_jitter():
    """Issue 35: the old rule chose 1 slot for this profile, though Batch decoded 64 rows 63x
    faster than 1 there."""
    assert auto_slots(H200_8B) == 64
    assert min(auto_slots(jittered(H200_8B, seed)) for seed in range(200)) >= 32


def test_auto_slots_keep_a_cpu_like_curve_small_whatever_the_jitter():
    """A CPU's step grows about linearly with its rows (here: one row's fixed cost again per row)."""
    cpu = {b: 0.010 * (1 + b) for b in CPU_BATCHES}
    assert auto_slots(cpu) == 4
    assert {auto_slots(jittered(cpu, seed)) for seed in range(200)} <= {2, 4, 8}


def test_others_count_only_on_the_cores_the_probe_uses():
    # 2 cores, a probe with 2 threads: a burner taking one core for the whole window took half of them
    assert others_share(others_s=1.0, wall_s=1.0, cpus=2, threads=2) == 0.5
    # 16 cores, a probe with 8 threads: others may use the 8 it leaves idle at no cost to it
    assert others_share(others_s=8.0, wall_s=1.0, cpus=16, threads=8) == 0.0
    assert others_share(others_s=12.0, wall_s=1.0, cpus=16, threads=8) == 0.5
    assert others_share(others_s=99.0, wall_s=1.0, cpus=2, threads=2) == 1.0
    assert others_share(others_s=-0.01, wall_s=1.0, cpus=2, threads=2) == 0.0   # tick rounding
    assert others_share(others_s=1.0, wall_s=0.0, cpus=2, threads=2) == 0.0


def test_decode_steps_that_clearly_beat_the_probe_revise_it_and_mark_it_provisional():
    stretched = probe([Speed("float32", 2e-3, 0.1, 2)], {1: 0.100, 4: 0.200})
    clock = StepClock(Speed("float32", 2e-3, 0.1, 2))
    for _ in range(BEATEN_AFTER - 1):
        clock.observe(1, 0.040)
    assert revised(stretched, clock) is None                          # too few steps seen yet
    clock.observe(1, 0.040)
    revision = revised(stretched, clock)
    ratio = clock.decode_s / 0.100
    assert 0.4 < ratio < 0.45 and revision.steps == {1: 0.100 * ratio, 4: 0.200 * ratio}
    assert revision.provisional and "beat the probe" in revision.taken.note and revision.speeds == stretched.speeds
    assert revision.taken.at == QUIET.at and revision.taken.others_cpu == QUIET.others_cpu
    assert revised(revision, clock) is None                           # revised once: it no longer beats it
    steady = StepClock(Speed("float32", 2e-3, 0.1, 2))
    for _ in range(100):
        steady.observe(1, 0.080)                                      # within the probe's noise and batches
    assert revised(stretched, steady) is None


def test_max_memory_comes_from_the_environment_as_device_size_pairs():
    settings = EngineSettings.from_env({"UNIUN_MAX_MEMORY": "0=6GiB, cpu=20GiB"})
    assert settings.max_memory == {"0": "6GiB", "cpu": "20GiB"}
    for bad in ("6GiB", "cpu=huge", "gpu=1GiB"):
        with pytest.raises(ValueError, match=rf"UNIUN_MAX_MEMORY='{bad}' is not allowed: use DEVICE=SIZE pairs"):
            EngineSettings.from_env({"UNIUN_MAX_MEMORY": bad})


# -- the decode loop's threads while it serves (cores) -------------------------------------------


def test_the_loop_leaves_a_core_for_each_core_the_others_keep_busy():
    from uniun_ray.models.tune.cores import threads_for

    assert threads_for(2, 0.0) == threads_for(2, 0.1) == 2     # Ray's daemons alone: every thread
    assert threads_for(2, 0.3) == threads_for(2, 1.5) == 1     # never fewer than one
    assert threads_for(16, 0.3) == 15 and threads_for(16, 2.05) == 14


def test_the_loop_changes_its_threads_only_when_two_windows_agree(monkeypatch):
    from uniun_ray.models.tune import cores

    clock = {"wall": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(cores.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(cores.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(cores, "busy_seconds", lambda cpus: clock["busy"])
    threads = {"n": 0}
    monkeypatch.setattr(cores.torch, "set_num_threads", lambda n: threads.update(n=n))

    def window(others: float, own: float = 1.9) -> int:
        clock["wall"] += cores.WINDOW_S
        clock["own"] += own * cores.WINDOW_S
        clock["busy"] += (own + others) * cores.WINDOW_S
        share.after_step()
        share.before_step(streaming=True)
        return threads["n"]

    share = cores.CoreShare(most=2, fixed=False)
    share.enter()                                              # a new thread starts from Ray's 1
    assert threads["n"] == 2
    assert [window(0.05), window(0.4), window(0.05), window(0.4), window(0.4)] == [2, 2, 2, 2, 1]
    assert share.describe() == {"threads": 1, "threads_most": 2, "others_cores": 0.4}
    assert [window(0.0), window(0.0)] == [1, 2]                # quiet again: every thread back
    window(0.4), window(0.4)
    share.before_step(streaming=False)                         # a prompt read at an idle device
    assert threads["n"] == 2
    share.before_step(streaming=True)
    assert threads["n"] == 1
    share = cores.CoreShare(most=2, fixed=True)                # UNIUN_THREADS: left alone
    share.enter()
    assert [window(0.9), window(0.9)] == [2, 2]


def test_torch_work_outside_the_loop_runs_in_a_thread_that_ends():
    """A load's OpenMP workers end with its thread (``cores.in_own_thread``); the caller gets its
    result or its exception, and the thread count the work chose."""
    import threading

    import torch
    from uniun_ray.models.tune.cores import in_own_thread

    before = torch.get_num_threads()

    def work(n):
        torch.set_num_threads(n)
        return threading.current_thread()

    try:
        ran_in = in_own_thread(work, 1)
        assert ran_in is not threading.current_thread() and not ran_in.is_alive()
        assert torch.get_num_threads() == 1
        with pytest.raises(KeyError, match="nope"):
            in_own_thread(lambda: {}["nope"])
    finally:
        torch.set_num_threads(before)


def test_the_loops_own_thread_runs_openmp_kernels_with_the_loops_threads():
    """oneDNN and MKL read OpenMP's per-thread setting: a new thread starts from Ray's
    OMP_NUM_THREADS=1, whatever the loading thread set (``cores.CoreShare.enter``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not gomp.exists():
        pytest.skip("this torch build does not run on GNU OpenMP")
    code = f"""
import ctypes, threading, torch
from uniun_ray.models.tune.cores import CoreShare
gomp = ctypes.CDLL({str(gomp)!r})
torch.set_num_threads(2)
seen = []
def loop(share):
    if share is not None:
        share.enter()
    seen.append(gomp.omp_get_max_threads())
share = CoreShare(2, fixed=False)
for share in (None, share, share):   # a loop's thread per busy period, one share for the model
    thread = threading.Thread(target=loop, args=(share,))
    thread.start()
    thread.join()
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", code], env=os.environ | {"OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[1, 2, 2]"
