"""The step profile: seconds per batched decode step, per batch size, and the slot count it implies.

One decode step of B sequences reads the weights once, so B rows cost far less than B steps of
one; how much less depends on the model and the host (SPEC §6). The policy needs the figures for
R23 (which jobs may decode beside a chat) and the device for its slot count (R25, "auto"). They
are measured at load on the loaded model, on the path ``batch.Batch`` decodes: B rows of a short
context (``PROFILE_CONTEXT``) of different lengths join the ``runner.rows`` a batch on this device
keeps (``rows_for``), and each step passes what those rows give it (mask and position ids or
none, as the batch does), one token per row. ``benchmarks/step_profile.py`` times the same steps,
longer, for BENCHMARKS.md.

The probe is one moment, on short contexts; the steps a device then serves are longer as contexts
grow, and slower while other programs share its cores. So the figures it reports are those it
serves (``ServedSteps``), the probe's standing in for a batch size until it has served a few.
"""
from __future__ import annotations

import copy
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable

import torch

from ..kv.prefix import crop_layers
from .forward import Inputs, Runner
from .rows import RowChoice, Rows, rows_for

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
#: "auto" takes the fewest slots whose tokens per second come within this share of the most the
#: curve reaches (read off a line fitted to all of it): each slot beyond the knee costs every job
#: its share of the step and its KV memory for a few percent more throughput.
SLOT_MARGIN = 0.2
#: A batch size's served figure is the median of its latest SERVED_WINDOW decode steps, once it
#: has SERVED_MIN of them (until then the probe's): a median of three or more is no one step's,
#: so one step stretched by a noisy neighbour moves nothing.
SERVED_WINDOW = 15
SERVED_MIN = 3

Clock = Callable[[], float]


class ServedSteps:
    """The decode steps a device serves, per batch size: the median of the latest of each size,
    over the probe's figures (the policy reads what the device serves, R23). The decode loop's
    thread observes every step; any thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, deque[float]] = {}

    def observe(self, batch: int, seconds: float) -> None:
        with self._lock:
            self._seen.setdefault(batch, deque(maxlen=SERVED_WINDOW)).append(seconds)

    def profile(self, probed: Mapping[int, float]) -> dict[int, float]:
        """Seconds per step by batch size: each size served SERVED_MIN times or more at the
        median of its latest steps (sizes the probe did not measure too), the others as probed
        but never faster than a smaller size served (the probe's short contexts on a quiet host
        would otherwise promise a chat more rows than the device, serving fewer, shows it has)."""
        with self._lock:
            seen = {batch: list(steps) for batch, steps in self._seen.items() if len(steps) >= SERVED_MIN}
        served = {batch: statistics.median(steps) for batch, steps in seen.items()}
        figures, slowest = dict(sorted((dict(probed) | served).items())), 0.0
        for batch, seconds in figures.items():
            if batch in served:
                slowest = max(slowest, seconds)
            else:
                figures[batch] = max(seconds, slowest)
        return figures


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
    """The slot count "auto" (R25): the smallest measured batch size whose tokens per second
    (B / step(B)) reach ``1 - SLOT_MARGIN`` of the most the curve reaches, read at its largest
    size off the line ``step(B) = a + b B`` fitted to every measured size (least squares), so
    that no one noisy size sets the bar (an H200's 8B steps took 65 ms at 1 row and 111-120 ms
    at 2 to 64 in one probe: a rule that stopped at the first doubling that gained under 15%
    chose 1 slot there); then at most ``limit``. 1 for an empty profile."""
    sizes = sorted(size for size in profile if profile[size] > 0)
    if not sizes:
        return 1
    fixed, per_row = _line(sizes, [profile[size] for size in sizes])
    best = sizes[-1] / max(fixed + per_row * sizes[-1], 1e-12)
    slots = next((size for size in sizes if size / profile[size] >= (1 - SLOT_MARGIN) * best), sizes[-1])
    return min(slots, limit) if limit is not None else slots


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ``ys`` over ``xs`` (flat for a single point)."""
    if len(xs) == 1:
        return ys[0], 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope


def row_lengths(batch: int, longest: int) -> list[int]:
    """Rows of different lengths, as a batch has: spread over [3/4 of ``longest``, ``longest``]."""
    return [longest - (longest // 4) * row // max(1, batch - 1) for row in range(batch)]


def decode_times(rows: Rows, lengths: list[int], steps: int, warmup: int, clock: Clock) -> list[float]:
    """Time ``steps`` decode steps (after ``warmup`` untimed ones) of one token per row of
    ``rows`` (holding ``lengths`` tokens each), each the step a batch's rows take: the tokens
    chosen on the device and fed back there, one read of them to the host."""
    device = rows.device
    tokens, positions = torch.ones(len(lengths), dtype=torch.long, device=device), torch.tensor(lengths, device=device)
    times = []
    for i in range(warmup + steps):
        started = clock()
        tokens = rows.decode(Inputs(tokens, positions + i, max(lengths) + i + 1)).argmax(-1)
        tokens.tolist()
        if i >= warmup:
            times.append(clock() - started)
    rows.clear()
    return times


def measure_profile(runner: Runner, vocab_size: int, device: torch.device, batches: tuple[int, ...],
                    choice: RowChoice = RowChoice()) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds per decode step at each of ``batches`` for the model as loaded, and their spread
    (interquartile range over median, 0 for fewer than 4 samples): one row of
    ``PROFILE_CONTEXT`` tokens is prefilled once, and each round joins B copies of it, cut to
    ``row_lengths``, to the rows a batch keeps (``rows_for``, as ``choice`` says) and times
    ``PROFILE_STEPS`` steps.
    Rounds go over every size in turn, so a load that comes and goes stretches every size alike."""
    ids = torch.tensor([[(7919 * i) % vocab_size for i in range(1, PROFILE_CONTEXT + 1)]], device=device)
    with torch.inference_mode():
        prefilled = getattr(runner.model(input_ids=ids, use_cache=True, **{runner.cache_arg: None},
                                         **runner.kwargs), runner.cache_arg)
    clock, times = device_clock(device), {batch: [] for batch in batches}
    started, rounds = time.perf_counter(), 0
    while rounds < PROFILE_ROUNDS and (rounds == 0 or time.perf_counter() - started < PROFILE_MIN_S):
        for batch in batches:
            rows, lengths = joined_rows(runner, prefilled, batch, PROFILE_CONTEXT, device,
                                        PROFILE_WARMUP + PROFILE_STEPS, choice)
            times[batch] += decode_times(rows, lengths, PROFILE_STEPS, PROFILE_WARMUP, clock)
        rounds += 1
    return ({batch: statistics.median(seconds) for batch, seconds in times.items()},
            {batch: _spread(seconds) for batch, seconds in times.items()})


def joined_rows(runner: Runner, prefilled: Any, batch: int, context: int, device: torch.device,
                steps: int, choice: RowChoice = RowChoice()) -> tuple[Rows, list[int]]:
    """``batch`` copies of a one-row cache of ``context`` tokens, cut to ``row_lengths``, joined to
    the rows a batch on ``device`` keeps (with room for ``steps`` more tokens), as its jobs join
    them; and their lengths."""
    rows, lengths = rows_for(runner, device, batch, context=context + steps, choice=choice), row_lengths(batch, context)
    for length in lengths:
        cache = copy.deepcopy(prefilled)
        crop_layers(cache, length)
        rows.join(cache, length)
    return rows, lengths


def _spread(seconds: list[float]) -> float:
    if len(seconds) < 4:
        return 0.0
    low, _, high = statistics.quantiles(seconds, n=4)
    return (high - low) / statistics.median(seconds)
