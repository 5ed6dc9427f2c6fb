"""The step profile: seconds per batched decode step, per batch size, and the slot count it implies.

One decode step of B sequences reads the weights once, so B rows cost far less than B steps of
one; how much less depends on the model and the host (SPEC §6). The policy needs the figures for
R23 (which jobs may decode beside a chat) and the device for its slot count (R25, "auto"). They
are measured at load on the loaded model, as ``batch.Batch`` decodes: a ``DynamicCache`` of B rows
of a short context (``PROFILE_CONTEXT``), left-padded to different lengths, an attention mask
and per-row position ids (none for one row), one token per row per step.
``benchmarks/step_profile.py`` times the same steps, longer, for BENCHMARKS.md.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Any, Callable

import torch

#: Batch sizes measured at load: a CPU's tokens per second stop growing well before 16 rows of a
#: small model; a GPU's grow to dozens.
CPU_BATCHES = (1, 2, 4, 8, 16)
CUDA_BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Tokens of context per row (the longest; padding spreads the rows over 3/4 of it to all of it):
#: the prompt length of ``benchmarks/step_profile.py``. Attention grows with it: SmolLM2 on this
#: 2-core host took 53 ms per step of 16 rows at 64 tokens, 74 at 256 and 139 at 1024 (41, 46 and
#: 50 ms for one row), and R23 must not promise a chat more companions than real contexts allow.
#: The probe stays short: 1.6 s there, against 1.3 s at 64 tokens.
PROFILE_CONTEXT = 256
#: Decode steps per batch size per round, after PROFILE_WARMUP untimed ones (the first steps after
#: the dtype probe's last cast and thread change run cold: 52 ms against 43 for SmolLM2 here).
PROFILE_STEPS = 3
PROFILE_WARMUP = 2
#: Rounds over every size repeat until this long (a tiny model's steps take a millisecond),
#: at most PROFILE_ROUNDS of them; each size's figure is the median of its steps.
PROFILE_MIN_S = 0.3
PROFILE_ROUNDS = 5
#: A slot count is worth doubling while tokens per second grow by this much more per doubling:
#: 15% buys a noticeable gain in throughput and stays clear of the few percent of noise in a
#: step time; each slot beyond the knee costs every job its share of the step and its KV memory.
SLOT_GAIN = 0.15

Clock = Callable[[], float]


def batch_sizes(device: torch.device) -> tuple[int, ...]:
    return CUDA_BATCHES if device.type == "cuda" else CPU_BATCHES


def device_clock(device: torch.device) -> Clock:
    """Seconds now, after the device's queued work (CUDA runs asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return synced


def auto_slots(profile: dict[int, float], limit: int | None = None) -> int:
    """The slot count "auto" (R25): the largest measured batch size whose tokens per second
    (B / step(B)) grew by at least ``SLOT_GAIN`` per doubling over the size before it, every
    size before it having grown so too; then at most ``limit``. 1 for an empty profile."""
    sizes = sorted(size for size in profile if profile[size] > 0)
    slots = sizes[0] if sizes else 1
    for previous, size in zip(sizes, sizes[1:]):
        gain = (size / profile[size]) / (previous / profile[previous])
        if gain < (1 + SLOT_GAIN) ** _doublings(previous, size):
            break
        slots = size
    return min(slots, limit) if limit is not None else slots


def _doublings(previous: int, size: int) -> float:
    return math.log2(size / previous)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: counted from each row's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def row_lengths(batch: int, longest: int) -> list[int]:
    """Rows of different lengths, as a batch has: spread over [3/4 of ``longest``, ``longest``]."""
    return [longest - (longest // 4) * row // max(1, batch - 1) for row in range(batch)]


def decode_times(model: Any, cache_arg: str, cache: Any, mask: torch.Tensor, steps: int, warmup: int,
                 clock: Clock, **forward_kwargs: Any) -> list[float]:
    """Time ``steps`` decode forwards (after ``warmup`` untimed ones) of one token per row on
    ``cache``, whose rows ``mask`` [rows, cached tokens] says are padded (0) or real (1). Several
    rows get the mask and their position ids, as ``batch.Batch`` passes them; one gets neither."""
    rows = mask.shape[0]
    token = torch.ones((rows, 1), dtype=torch.long, device=mask.device)
    times = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=mask.device)], dim=1)
            shaping = {"attention_mask": mask, "position_ids": positions(mask)[:, -1:]} if rows > 1 else {}
            started = clock()
            output = model(input_ids=token, use_cache=True, **{cache_arg: cache}, **shaping, **forward_kwargs)
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            if i >= warmup:
                times.append(clock() - started)
            cache = getattr(output, cache_arg)
    return times


def measure_profile(model: Any, cache_arg: str, forward_kwargs: dict, vocab_size: int, device: torch.device,
                    batches: tuple[int, ...]) -> dict[int, float]:
    """Seconds per decode step at each of ``batches`` for ``model`` as loaded: one row of
    ``PROFILE_CONTEXT`` tokens is prefilled once, and each round copies its KV into B rows
    (padded as ``row_lengths`` says) and times ``PROFILE_STEPS`` steps. Rounds go over every
    size in turn, so a load that comes and goes stretches every size alike."""
    ids = torch.tensor([[(7919 * i) % vocab_size for i in range(1, PROFILE_CONTEXT + 1)]], device=device)
    with torch.inference_mode():
        prefilled = getattr(model(input_ids=ids, use_cache=True, **{cache_arg: None},
                                  **forward_kwargs), cache_arg)
    clock, times = device_clock(device), {batch: [] for batch in batches}
    started, rounds = time.perf_counter(), 0
    while rounds < PROFILE_ROUNDS and (rounds == 0 or time.perf_counter() - started < PROFILE_MIN_S):
        for batch in batches:
            cache, mask = _rows(prefilled, batch, device)
            times[batch] += decode_times(model, cache_arg, cache, mask, PROFILE_STEPS, PROFILE_WARMUP, clock,
                                         **forward_kwargs)
        rounds += 1
    return {batch: statistics.median(seconds) for batch, seconds in times.items()}


def _rows(prefilled: Any, batch: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """A copy of a one-row cache as ``batch`` rows, and a mask that pads them to ``row_lengths``:
    the padded positions hold real KV, masked out, which costs a step what padding costs it."""
    cache = copy.deepcopy(prefilled)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.repeat(batch, 1, 1, 1), layer.values.repeat(batch, 1, 1, 1)
    mask = torch.zeros((batch, PROFILE_CONTEXT), dtype=torch.long, device=device)
    for row, length in enumerate(row_lengths(batch, PROFILE_CONTEXT)):
        mask[row, PROFILE_CONTEXT - length:] = 1
    return cache, mask
