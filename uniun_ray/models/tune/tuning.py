"""What runs fastest on this host: the dtype of a model on CPU, and how long a prefill chunk is.

Hosts differ more than a default can cover. On an AVX-512 machine bfloat16 decoded SmolLM2
1.6x faster than float32; on an AVX2-only one bf16 took ~500 ms for a 33-token prompt against
~180 ms in float32. So on CPU the engine measures both once per host and model (a short prefill
and a few decode steps; cached in ``tuning.json`` beside the converted models), each with every
core it may use and with half of them, and keeps the fastest pair. Mixed precision (bf16 decode,
fp32 prefill) would need two copies of the weights and is not offered.

A revoke is honoured before the next forward pass, so a prefill chunk bounds how long it waits.
A fixed token count is wrong on every host but the one it was tuned on (256 tokens: 0.35 s
there, 3.4 s of bf16 here); ``StepClock`` sizes chunks by the time they take, as measured while
the engine runs.

A probe taken while other programs took the CPU is not the host's (``contention``): it is used
for now, kept marked provisional and measured again at the next load that finds the host quiet;
so is one that the decode steps seen afterwards clearly beat (``revised``).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from .contention import Taken

#: Forward over token ids, extending a cache: (logits, cache). What the probe times.
Step = Callable[[list[int], Any], tuple[Any, Any]]

PROBE_PROMPT_TOKENS = 64
PROBE_DECODE_STEPS = 6
#: A chat turn's shape, for weighing prefill against decode when they disagree.
TYPICAL_PROMPT_TOKENS = 256
TYPICAL_NEW_TOKENS = 32

MIN_CHUNK, MAX_CHUNK = 8, 2048
#: A prefill chunk takes about this many decode steps: one decode step's worth of fixed cost
#: (reading the weights) and one of tokens.
CHUNK_DECODE_STEPS = 2.0
#: A model whose forward pass checks the cancel flag before every decoder layer (the engine's
#: layer gate) stops within one layer, not one chunk: its chunks may take this many decode
#: steps. With 16 layers or more a revoke still waits about one decode step, and a CPU spends
#: most of a chunk on its tokens instead of on reading the weights once per short chunk (a
#: 1,100-token background prefill of SmolLM2 took 3-4x one pass in 2-step chunks).
GATED_CHUNK_DECODE_STEPS = 16.0
_SMOOTHING = 0.2            # weight of the newest decode step in the running estimate
_SMOOTHING_EXPONENT = 0.5   # how far one chunk's time moves the next chunk's size
_MAX_STEP = 2.0             # nor more than halved or doubled by one chunk


@dataclass(frozen=True)
class Speed:
    """Measured speed of one model in one dtype with one thread count on this host."""

    dtype: str
    prefill_s_per_token: float
    decode_s: float
    threads: int

    @property
    def score(self) -> float:
        """Seconds for a typical chat turn: TTFT plus a short answer."""
        return TYPICAL_PROMPT_TOKENS * self.prefill_s_per_token + TYPICAL_NEW_TOKENS * self.decode_s


def measure(step: Step, vocab_size: int, dtype: str, threads: int) -> Speed:
    """Time a prefill of ``PROBE_PROMPT_TOKENS`` and ``PROBE_DECODE_STEPS`` decode steps (after one
    warm-up pass), with torch set to ``threads`` by the caller. Token ids are a fixed spread over
    the vocabulary: speed does not depend on them."""
    ids = [(7919 * i) % vocab_size for i in range(1, PROBE_PROMPT_TOKENS + 1)]
    step(ids[:8], None)  # warm-up: first-call allocations and kernel selection
    started = time.perf_counter()
    _, cache = step(ids, None)
    prefill = (time.perf_counter() - started) / len(ids)
    steps = []
    for token in ids[:PROBE_DECODE_STEPS]:
        started = time.perf_counter()
        _, cache = step([token], cache)
        steps.append(time.perf_counter() - started)
    return Speed(dtype, prefill, statistics.median(steps), threads)


def fastest(speeds: list[Speed]) -> Speed:
    """The dtype and thread count whose slowest typical chat turn at that count or fewer is the
    fastest (between equals, the faster at its own count). The loop may serve with fewer threads
    than the probe chose (``cores.CoreShare`` gives a core back where other programs keep one
    busy, as an HTTP front end on a 2-core host does), and one dtype can win at one count and
    lose badly at another: bf16 without native bf16 arithmetic scored 3.32 s against float32's
    3.41 at 2 threads and 5.98 against 3.95 at one, and a ModelActor chosen bf16 at 2 served at 1
    (float32 it is); with native bf16, 3.10 against 1.84 at 2 threads and 1.61 against 2.37 at
    one (bf16 at one thread, which no count below can undo)."""
    def slowest(speed: Speed) -> float:
        return max(other.score for other in speeds
                   if other.dtype == speed.dtype and other.threads <= speed.threads)
    return min(speeds, key=lambda speed: (slowest(speed), speed.score))


def thread_options(budget: int) -> list[int]:
    """The thread counts worth measuring within ``budget`` cores: all of them, and half. Every
    core is not always faster: a small model's forward pass is many short kernels, and where
    anything else runs beside the actor (Ray's own processes do) a thread waiting at each
    kernel's barrier for a core costs more than the second core gains. Measured on a 2-core
    AVX2 host inside a Ray actor: the 1M-parameter model decoded in 2.3 ms/token with one
    thread and 4.0 with two; outside Ray, two threads were the faster."""
    return sorted({budget, max(1, budget // 2)}, reverse=True)


def host_signature() -> str:
    """What the measurements depend on besides the model and the thread counts: CPU model,
    torch's vector ISA, torch version."""
    import torch

    return "|".join([platform.machine(), cpu_model(), torch.backends.cpu.get_cpu_capability(),
                     torch.__version__])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


@dataclass(frozen=True)
class Probe:
    """What a load measured of one model on this host: the speed of every dtype and thread count
    tried, the step profile ({batch: seconds per decode step}, ``steps``, the median of its
    samples) at the fastest (``at``: its dtype and thread count; a profile taken at another pair,
    as ``fastest`` chose before, is measured anew), how far its samples spread (``spread``:
    interquartile range over median, per batch), and when and under what load (``Taken``)."""

    speeds: list[Speed]
    steps: dict[int, float]
    taken: Taken
    spread: dict[int, float] = field(default_factory=dict)
    at: tuple[str, int] | None = None

    @property
    def current(self) -> bool:
        """Its step profile was taken at the pair ``fastest`` keeps."""
        best = fastest(self.speeds)
        return self.at == (best.dtype, best.threads)

    @property
    def provisional(self) -> bool:
        """Taken while the host was busy, or beaten since: measured again at the next load that
        finds the host quiet (``contention.quiet``)."""
        return self.taken.busy

    def to_json(self) -> dict:
        return {"speeds": [asdict(speed) for speed in self.speeds],
                "steps": {str(batch): seconds for batch, seconds in self.steps.items()},
                "spread": {str(batch): share for batch, share in self.spread.items()},
                "taken": asdict(self.taken), "at": self.at}

    @classmethod
    def from_json(cls, entry: dict) -> Probe:
        taken = entry["taken"] | {"load_avg": tuple(entry["taken"]["load_avg"])}
        # an entry without "spread" was taken on the probe's old path (one row unmasked): measured anew
        return cls([Speed(**speed) for speed in entry["speeds"]],
                   dict(sorted((int(batch), float(seconds)) for batch, seconds in entry["steps"].items())),
                   Taken(**taken),
                   dict(sorted((int(batch), float(share)) for batch, share in entry["spread"].items())),
                   tuple(entry["at"]) if entry.get("at") else None)


#: Decode steps this much faster than the probe's, seen over at least BEATEN_AFTER steps since the
#: load, say the probe was taken while the host was busy (its steps were stretched).
BEATEN_RATIO = 0.7
BEATEN_AFTER = 32


def revised(probe: Probe, clock: StepClock) -> Probe | None:
    """``probe`` revised by the decode steps seen since the load, where they clearly beat its
    one-row step: every step time scaled by their ratio (a load beside the probe stretched every
    batch size alike) and marked provisional, so the next quiet load measures again. None otherwise.
    The clock's estimate mixes batch sizes, each no faster than one row: it never beats a true
    probe, and it understates the correction."""
    single = probe.steps.get(1)
    if not single or clock.decode_seen < BEATEN_AFTER or clock.decode_s >= BEATEN_RATIO * single:
        return None
    ratio = clock.decode_s / single
    note = (f"decode steps of {clock.decode_s * 1e3:.1f} ms seen since load beat the probe's "
            f"{single * 1e3:.1f} ms: its step times scaled by {ratio:.2f}; measured again at the next quiet load")
    return replace(probe, steps={batch: seconds * ratio for batch, seconds in probe.steps.items()},
                   taken=replace(probe.taken, busy=True, note=note))


class ProbeCache:
    """Probes per (host signature, model, dtypes and thread counts tried), as JSON; a corrupt
    file, or an entry of an older shape, is measured anew, and so is a provisional one (taken
    while the host was busy) once the host is quiet. Deleting the file measures everything again."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, key: str) -> Probe | None:
        entry = self._read().get(key)
        try:
            return Probe.from_json(entry) if isinstance(entry, dict) else None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def put(self, key: str, probe: Probe) -> None:
        data = self._read() | {key: probe.to_json()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        staging.write_text(json.dumps(data, indent=1, sort_keys=True))
        staging.replace(self.path)  # atomic: a concurrent reader sees the old or the new file

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


class StepClock:
    """Running estimates of one model's step times on this host, and the prefill chunk they imply.

    A chunk is sized to take ``CHUNK_DECODE_STEPS`` decode steps, so a revoke that arrives during
    a prefill waits about one decode step on average, as one during decoding does. The size is a
    feedback loop, not a cost model: each full chunk's measured time scales the next one (a
    forward pass on a CPU costs neither a fixed nor a per-token amount alone), so a busier host,
    or a longer context, gets shorter chunks. Seeded from the probe's 64-token prefill.
    """

    def __init__(self, speed: Speed, decode_steps: float = CHUNK_DECODE_STEPS) -> None:
        self.decode_s = speed.decode_s
        self.decode_steps = decode_steps
        self.decode_seen = 0    # decode steps observed: until a few dozen, decode_s is mostly the seed
        probe_s = speed.prefill_s_per_token * PROBE_PROMPT_TOKENS
        self._chunk = self._clamp(PROBE_PROMPT_TOKENS * self.target_s / probe_s if probe_s > 0 else MAX_CHUNK)

    @property
    def target_s(self) -> float:
        return self.decode_steps * self.decode_s

    @property
    def chunk(self) -> int:
        return int(self._chunk)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens == 1:
            self.decode_s += _SMOOTHING * (seconds - self.decode_s)
            self.decode_seen += 1
        elif tokens >= self.chunk and seconds > 0:  # a full chunk; a short tail says little
            ratio = min(_MAX_STEP, max(1 / _MAX_STEP, self.target_s / seconds))
            self._chunk = self._clamp(self._chunk * ratio ** _SMOOTHING_EXPONENT)

    @staticmethod
    def _clamp(chunk: float) -> float:
        return max(MIN_CHUNK, min(MAX_CHUNK, chunk))

    def describe(self) -> dict:
        return {"decode_ms": round(self.decode_s * 1e3, 2), "prefill_chunk": self.chunk,
                "prefill_chunk_target_ms": round(self.target_s * 1e3, 2)}
