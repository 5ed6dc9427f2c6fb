"""A Ray-free text generation engine: one model at a time, cancellable at every token.

The ModelActor is a thin Ray shell around ``Engine``. Everything that decides *how* a model runs
lives here, so it can be tested (and benchmarked) without a cluster:

* ``load`` / ``unload`` swap the single resident model and report how (a ``Swap``: cold load,
  warm copy or switch) and how long that took, because the scheduler weighs swaps by their
  measured cost (SPEC R12); the model a swap replaces stays warm (``load.parked``).
* ``generation.generate`` streams text and stops at the next token once its ``cancel`` event is set: this
  is how a revoke (SPEC R4) takes effect. The decode loop is our own rather than
  ``model.generate``: it checks the flag before every forward pass, including between the chunks
  of a long prompt's prefill, which ``generate`` cannot interrupt; and it yields pieces in the
  caller's thread, with no helper thread or queue as ``TextIteratorStreamer`` needs.
* A revoked job resumes recompute-style (SPEC R6): the new request carries what the job already
  produced, the engine prefills prompt + that, and the result holds only the new part.
* The host decides how it runs (``weights``, ``tuning``): on CPU the dtype is measured per host
  and model, and prefill chunks are sized by the time they take here. During a prefill the flag
  is also read before every decoder layer (``gate``), so chunks can be long and a revoke still
  waits about one decode step.

This module is the resident model and the admission of its runs; the decode loop is ``batch``
(a lone run is a one-row batch, ``generation``), the weights and their tuning live in ``host``,
the request checks in ``requests``.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import torch

from .sequence import Sequence
from ..kv import heap
from ..runner.gate import CancelFlag
from ..tune.cores import in_own_thread
from ..load.parked import ParkedStore, park, unpark, weight_bytes
from ..load.weights import Loaded, Weights
from ..kv.prefix import PrefixCache
from ..registry import materialize, resolve
from ..requests.request import GenerateRequest, _is_int
from ... import memory
from ...settings import EngineSettings
from ..swap import COLD, NONE, RESIDENT, Swap
from ..requests.vocabulary import PromptTooLong, context_of


def device_memory(device: torch.device, shares: int = 1) -> memory.Device:
    """What the memory plan divides: a GPU's total memory, or a CPU device's share of the host's
    available memory (``shares``: the devices of the host); and its share of host memory."""
    import psutil   # Ray's own dependency

    host = psutil.virtual_memory().available // max(1, shares)
    if device.type == "cuda":
        return memory.Device("cuda", torch.cuda.mem_get_info(device)[1], host)
    return memory.Device("cpu", host, host)


class Engine:
    """Holds at most one causal LM on ``device`` and generates with it, one run at a time.

    ``settings`` (``settings.EngineSettings``; ``settings.SETTINGS`` says what each does): the
    dtype ("auto" measures bf16 against float32 on CPU, once per host and model, cached) and
    threads (None: the probe measures every core of ``thread_budget``, None: every core this
    process may run on, against half of them on CPU; never Ray's OMP_NUM_THREADS=1, which
    actors inherit), the prefix cache's budgets (``kv.prefix``; None: the device's default),
    ``max_memory`` (accelerate places the weights and offloads what does not fit: a model
    larger than the device runs, slower), the warm budget for idle models (``load.parked``)
    and whether they may stay ``coresident``, whether transformers may fetch ``hub_kernels``
    at load, ``deterministic`` decoding (on CPU a greedy
    answer depends neither on the rows beside nor on what the prefix cache held; it costs
    decode throughput and prefill time: docs/tuning.md), and the KV rows (``runner.rows``).
    The device's memory is divided by one plan (``uniun_ray.memory``; ``shares``: the devices of
    this host, which share its memory): settings that ask for more than it has are refused here
    (``memory.MemoryShort``), and each load plans again with its weights measured.
    ``prefill_chunk`` fixes the prompt tokens per prefill forward pass; None (the default) sizes
    each chunk by the time it takes on this host (``tuning.StepClock``); the layer gate bounds
    how long a cancel waits within one.

    Thread safety: a ``generation.generate`` run may be iterated in a worker thread. ``load`` and ``unload`` refuse
    (RuntimeError) while a run is in progress: revoke it and let its iterator finish first.
    """

    def __init__(self, device: str | torch.device = "cpu", settings: EngineSettings | None = None, *,
                 thread_budget: int | None = None, prefill_chunk: int | None = None, shares: int = 1) -> None:
        settings = settings or EngineSettings()
        self._weights = Weights(device, settings, thread_budget)
        self.device = self._weights.device
        if prefill_chunk is not None and (not _is_int(prefill_chunk) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be an int >= 1 or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self._settings, self._memory = settings, device_memory(self.device, shares)
        self._plan = memory.plan(self._memory, settings, static_rows=self._weights.rows.kind == "static")
        self.kv_cache_mb, self.kv_offload_mb = self._plan.prefix_cache // memory.MB, self._plan.offload // memory.MB
        self._parked = ParkedStore(self._plan.warm)
        self.coresident = settings.coresident
        self._lock = threading.Lock()
        self._loaded: Loaded | None = None
        self._running = 0

    @property
    def loaded(self) -> str | None:
        """The id of the resident model, or None."""
        loaded = self._loaded
        return loaded.vocabulary.model_id if loaded else None

    @property
    def resident(self) -> Loaded | None:
        """The resident model as the decode loop runs it, or None."""
        return self._loaded

    @property
    def context_length(self) -> int | None:
        """The longest run (prompt + new tokens) the resident model takes, or None when nothing
        is loaded: its context window, or a static KV row's where that is shorter."""
        loaded = self._loaded
        return loaded.context_length if loaded else None

    @property
    def dtype(self) -> torch.dtype | None:
        """The resident model's dtype, or None when nothing is loaded."""
        loaded = self._loaded
        return getattr(torch, loaded.dtype) if loaded else None

    def describe(self) -> dict:
        """The host choices, for ``status`` and the benchmarks: dtype (and the measurements it
        was chosen on), threads, the current prefill chunk and step times, and under "probe"
        when and under what load the kept figures were taken: {"taken_at": ISO time,
        "window_s", "others_cpu": the share of the probe's cores other programs took,
        "load_avg": [before, after], "busy": whether they are provisional (measured again at
        the next load that finds the host quiet), "note" (why, when later steps beat them),
        "step_profile": {batch: seconds}, "step_spread": {batch: interquartile range / median of its
        samples}, "tokens_per_s": {batch: decode tokens per second}, "slots_auto": the slot count
        they imply}."""
        loaded = self._loaded
        if loaded is not None:
            self._weights.revise(loaded)
        described = self._weights.describe(loaded)
        if loaded is None:
            return described | {"memory": self.memory_plan()}
        return described | loaded.clock.describe() | ({"prefill_chunk": self.prefill_chunk} if self.prefill_chunk else {}) \
            | {"kv_cache": loaded.prefix.describe() | {"tiers": self._kv_tiers()}, "memory": self.memory_plan()}

    def step_profile(self) -> dict[int, float]:
        """Seconds per batched decode step of the loaded model on this host, per batch size
        ({1: s} only for a model that cannot be batched); {} when nothing is loaded. Measured at
        load and cached per host, model, dtype and threads; scaled down where the decode steps
        seen since beat it; and per batch size the device has served a few steps at, what it
        served (``runner.profile.ServedSteps``: R23 bounds a chat's step with what it gets, R25's
        ``runner.profile.auto_slots`` turns it into a slot count)."""
        loaded = self._loaded
        if loaded is None:
            return {}
        self._weights.revise(loaded)
        return loaded.served.profile(loaded.probe.steps)

    @property
    def threads_fixed(self) -> bool:
        """Whether the user fixed torch's threads (``UNIUN_THREADS``): nothing changes them then."""
        return self._weights.threads_fixed

    @property
    def thread_budget(self) -> int:
        """The most intra-op threads torch may use here (see ``weights.Weights``)."""
        return self._weights.thread_budget

    def _kv_tiers(self) -> str:
        """Where the prefix cache keeps KV, in words for ``status``: the same settings mean one
        tier or two depending on the device."""
        if self.kv_cache_mb == 0:
            return "none: UNIUN_KV_CACHE_MB=0 turns the cache off"
        if self.device.type == "cpu":
            return "one: the device is the CPU (UNIUN_KV_OFFLOAD_MB unused)"
        if self.kv_offload_mb == 0:
            return "one: device memory (UNIUN_KV_OFFLOAD_MB=0, what it pushes out is dropped)"
        return "two: device memory, then CPU memory"

    @property
    def chat(self) -> bool | None:
        """Whether the resident model has a chat template, or None when nothing is loaded."""
        loaded = self._loaded
        return loaded.vocabulary.chat if loaded else None

    def load(self, model_id: str, abandon: CancelFlag | None = None) -> Swap:
        """Make ``model_id`` the resident model; return what the swap was (``Swap``: its kind and
        seconds; kind NONE and 0.0 s if it already was).

        The resident model is set aside first, and that time is included: the caller wants
        the cost of the swap. It is kept warm (``load.parked``) within the budget, and a warm
        model comes back as it left (a switch, or a copy from host memory) without its files
        being read; any other is read cold. A warm model that fails to come back, or a cold
        load short of memory while models are kept warm, falls back to a cold load (with the
        warm models dropped): the swap's ``note`` says why. A cold model's id is resolved, and
        a GGUF converted, before the old model is set aside, so an unknown id (UnknownModel)
        leaves the engine as it was. Once ``abandon`` is set, a cold load stops at its next step
        (SwapAbandoned): nothing is then active, and the model it replaced stays warm.
        """
        with self._lock:
            self._refuse_while_running("load")
            previous = self.loaded
            if previous == model_id:
                return Swap(model_id, NONE, 0.0, previous, self._parked.kept(), kept_bytes=self._parked.sizes())
            started = time.perf_counter()
            folder = None if model_id in self._parked else materialize(resolve(model_id))
            self._release(keep=True)
            if self.device.type == "cpu":   # its OpenMP workers end with it (``cores.in_own_thread``)
                kind, note = in_own_thread(self._bring, model_id, folder, abandon)
            else:
                kind, note = self._bring(model_id, folder, abandon)
            return Swap(model_id, kind, time.perf_counter() - started, previous, self._parked.kept(), note,
                        self._parked.sizes())

    def unload(self) -> float:
        """Drop the resident model and every warm one, and free their memory; return the
        seconds it took."""
        with self._lock:
            self._refuse_while_running("unload")
            started = time.perf_counter()
            self._release()
            return time.perf_counter() - started

    @property
    def warm(self) -> dict:
        """The idle models kept warm and their budget, for ``status``."""
        return self._parked.describe() | {"coresident": self.coresident}

    def check(self, request: GenerateRequest) -> int:
        """Raise what ``generate`` would raise for ``request``, without running the model.

        Returns the number of tokens the run would prefill (prompt, template and resumed
        output). RuntimeError: no model is loaded. Otherwise as ``inspect_request``.
        """
        return len(self._prepare(request)[1])

    def admit(self, request: GenerateRequest, cancel: CancelFlag) -> Sequence:
        """Check ``request`` against the resident model (as ``check``) and make its run's
        ``Sequence``; a batch then ``begin``s it and, when it ends, ``retire``s it."""
        if not callable(getattr(cancel, "is_set", None)):
            raise ValueError(f"cancel must have an is_set() method (a threading.Event), got {cancel!r}")
        loaded, context = self._prepare(request)
        return Sequence(loaded, context, request, cancel)

    def begin(self, sequence: Sequence) -> None:
        """Count the admitted run as running: ``load`` and ``unload`` refuse until it is retired."""
        with self._lock:
            if self._loaded is not sequence.loaded:
                raise RuntimeError(
                    f"model {sequence.loaded.vocabulary.model_id!r} was unloaded after this generation was checked")
            self._running += 1

    def retire(self, sequence: Sequence, cache: Any) -> None:
        """The run ended: keep the KV of its tokens (``cache``) for the next turn or its resume.
        Where that evicted KV from the prefix cache, or no run is left, the heap's free pages go
        back to the system (``kv.heap``): freed KV would otherwise stay resident."""
        prefix = sequence.loaded.prefix
        evictions = prefix.evictions
        sequence.keep(prefix, cache)
        with self._lock:
            self._running -= 1
            idle, loaded = not self._running, self._loaded
        if idle or prefix.evictions != evictions:
            heap.trim()
        if idle and loaded is not None:
            self._weights.revise(loaded)   # the runs since the load may have beaten its probe

    # -- internals ---------------------------------------------------------------------------

    def _refuse_while_running(self, action: str) -> None:
        if self._running:
            raise RuntimeError(f"cannot {action} while a generation is running; cancel it first")

    def _release(self, keep: bool = False) -> None:
        """Set the resident model aside: kept warm (``keep``: a swap) within the budget, or
        dropped with every warm one (``unload``). Its static KV rows go now either way (a batch
        made for it may outlive it; a warm model gets rows again, sized then, when it is back)."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None and loaded.rows is not None:
            loaded.rows.free()
            loaded.rows = None
        if not keep:
            self._parked.clear()
            dropped = True
        else:   # nothing to free when it is kept and evicts nothing (a switch costs no collection)
            dropped = loaded is not None and bool(
                self._parked.keep(loaded.vocabulary.model_id, park(loaded, self.device, self.coresident)))
        del loaded
        if dropped:
            self._free()

    def _free(self) -> None:
        gc.collect()  # the model's tensors are freed here; the cache below can then shrink
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _bring(self, model_id: str, folder: Any, abandon: CancelFlag | None = None) -> tuple[str, str]:
        """Make ``model_id`` active: back from the warm store, else cold (``folder``: its files,
        None when it was warm). Returns the swap's kind and why it fell back to a cold load."""
        parked, note = self._parked.pop(model_id), ""
        if parked is not None:
            try:
                self._loaded = unpark(parked, self.device)
                self._plan_rows(self._loaded)
                return parked.kind_back, ""
            except (RuntimeError, MemoryError) as error:   # torch.OutOfMemoryError is a RuntimeError
                note = f"the warm copy did not come back ({error}); loaded cold"
                del parked
                self._free()
        folder = folder or materialize(resolve(model_id))
        prefix = PrefixCache(self.kv_cache_mb * 2**20, self.kv_offload_mb * 2**20, self._weights.deterministic)
        try:
            self._loaded = self._weights.load(model_id, folder, prefix, abandon)
        except (torch.OutOfMemoryError, MemoryError) as error:
            if not self._parked:
                raise
            self._parked.clear()   # the memory they hold is what the load lacked
            self._free()
            note = f"memory short ({error}); the warm models were dropped and it loaded cold"
            self._loaded = self._weights.load(model_id, folder, prefix, abandon)
        self._plan_rows(self._loaded)
        return COLD, note

    def _plan_rows(self, loaded: Loaded) -> None:
        """Plan the device's memory again with the active model's weights and the idle models
        beside it, then give the model its static rows and the idle models their budget."""
        beside = self._beside() if self.device.type != "cpu" else 0   # a CPU's idle models are all warm copies
        self._plan = memory.plan(self._memory, self._settings, weight_bytes(loaded), beside,
                                 self._weights.rows.static(loaded.runner), check=False)
        self._parked.budget_bytes = self._plan.warm
        self._weights.make_rows(loaded, self._plan.kv_rows)

    def _beside(self) -> int:
        """Bytes of the idle models kept on the device beside the active one."""
        kept = self._parked.kept()
        return sum(size for model_id, size in self._parked.sizes().items() if kept[model_id] == RESIDENT)

    def memory_plan(self) -> dict:
        """The device's memory plan (``uniun_ray.memory``), each part planned and used, for ``status``."""
        loaded = self._loaded
        used = {"warm": self._parked.held_bytes, "coresident": self._beside()}
        if loaded is not None:
            used |= {"weights": weight_bytes(loaded), "prefix_cache": loaded.prefix.held_bytes,
                     "offload": loaded.prefix.offloaded_bytes, "kv_rows": loaded.rows.bytes if loaded.rows else None}
        return self._plan.describe(used)

    def _prepare(self, request: GenerateRequest) -> tuple[Loaded, list[int]]:
        """The loaded model and the token ids to prefill for ``request``; raises if it cannot run."""
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("no model is loaded; call load(model_id) first")
        context = context_of(loaded.vocabulary, request)
        if len(context) + request.max_new_tokens > loaded.context_length:
            raise PromptTooLong(
                f"prompt is {len(context)} tokens + max_new_tokens {request.max_new_tokens}, more than the "
                f"{loaded.context_length} tokens of a KV row (UNIUN_KV_ROWS_MB sizes the rows)")
        return loaded, context
