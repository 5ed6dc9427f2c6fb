"""Weights and tuning: how this host reads a model and runs its forward passes.

* The dtype: bfloat16 as converted (float16 on GPUs without bf16); on CPU, "auto" measures it
  against float32, once per host and model (cached), and keeps the faster.
* torch's threads: on CPU, every core of the budget against half of them, unless fixed.
* On CPU, a Llama layer's sibling projections fused (``fusing``) and linear weights packed once
  for oneDNN's kernels (``packing``).
* Placement: all on the device, or where accelerate fits the weights in ``max_memory``.
* The step clock that sizes prefill chunks by the time they take here (``tuning.StepClock``).
* The step profile per batch size (``steps``), measured with the dtype and threads kept.
* Whether the host was busy meanwhile (``contention``): such a probe is measured again when it is not.
"""
from __future__ import annotations

import dataclasses
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from . import fusing, int8, packing
from ..tune.contention import Watch, quiet
from ..runner.gate import LayerGate, layer_gate
from ..runner.profile import ServedSteps, auto_slots, batch_sizes, measure_profile
from ..tune.tuning import (CHUNK_DECODE_STEPS, GATED_CHUNK_DECODE_STEPS, Probe, ProbeCache, StepClock, fastest,
                     host_signature, measure, revised, thread_options)
from ..runner import rows as kv_rows
from ..runner.forward import Runner
from ..runner.static import gpu_spare
from ..kv.prefix import PrefixCache
from ..registry import cache_dir
from ..requests.request import _is_int
from ...settings import EngineSettings
from ..swap import SwapAbandoned
from ..requests.vocabulary import Vocabulary, read_vocabulary

def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype a model is loaded in before any measurement: bfloat16 (the converted weights'
    own), or float16 on GPUs without bf16. On CPU, "auto" then measures it against float32."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


@dataclass
class Loaded:
    """The resident model and what the decode loop needs to know about it."""

    vocabulary: Vocabulary
    model: Any
    eos_ids: frozenset[int]
    cache_arg: str
    forward_kwargs: dict = field(default_factory=dict)
    dtype: str = ""
    probe: Probe | None = None          # what the choice of dtype was made on, and the step profile
    clock: StepClock | None = None
    probe_key: str = ""                 # where the probe is cached
    served: ServedSteps = field(default_factory=ServedSteps)   # the decode steps served since
    prefix: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    gate: LayerGate | None = None
    packed: int = 0                     # linear layers packed for oneDNN (``packing``)
    int8: int = 0                       # linear layers in int8 (``int8``, UNIUN_DTYPE=int8)
    rows: kv_rows.RowStore | None = None   # the static KV rows its batches decode in (None: padded rows)

    @property
    def runner(self) -> Runner:
        """The model and how its forward pass is called, as the KV rows run it."""
        return Runner(self.model, self.cache_arg, self.forward_kwargs)

    @property
    def context_length(self) -> int:
        """The longest run (prompt + new tokens) it takes: its context, or a static row's."""
        context = self.vocabulary.context_length
        return min(context, self.rows.context) if self.rows is not None else context


class Weights:
    """How an engine reads a model's weights and runs them on this host, as ``settings`` say.

    ``dtype``: "auto" measures bf16 against float32 on CPU. ``threads`` fixes torch's intra-op
    threads for the whole process; None: the probe measures every core of ``thread_budget``
    (None: every core this process may run on) against half of them on CPU and keeps the
    faster; on a GPU the budget is used. Never Ray's OMP_NUM_THREADS=1, which actors inherit.
    ``max_memory`` lets accelerate place the weights (``device_map="auto"``) and offload what
    does not fit. ``hub_kernels``: whether transformers may kernelize the model at load,
    fetching kernel code from the Hub; off, a load reads only the model's folder.
    ``deterministic``: on CPU a decode step computes each row as alone (``attention``'s row-invariant
    SDPA, ``packing``'s one row as two), so greedy tokens do not depend on the rows beside.
    ``kv_rows``, ``kv_steps`` and ``kv_rows_mb``: how its batches keep their KV rows (``runner.rows``).
    """

    def __init__(self, device: str | torch.device, settings: EngineSettings, thread_budget: int | None = None) -> None:
        self.device = torch.device(device)
        self.hub_kernels, self.deterministic = settings.hub_kernels, settings.deterministic
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested, but CUDA is not available")
        self.dtype = settings.dtype
        if self.dtype == "int8" and not int8.available(self.device):
            raise ValueError(f"UNIUN_DTYPE=int8 runs on a CPU (torch._int_mm): not on {self.device}")
        if thread_budget is not None and (not _is_int(thread_budget) or thread_budget < 1):
            raise ValueError(f"thread_budget must be an int >= 1 or None, got {thread_budget!r}")
        self.threads_fixed = settings.threads is not None
        self.thread_budget = settings.threads or EngineSettings(threads=thread_budget).resolved_threads()
        torch.set_num_threads(self.thread_budget)
        self.max_memory = settings.max_memory
        self.rows = kv_rows.RowChoice.of(self.device, settings.kv_rows, settings.kv_steps)
        self.rows_mb = settings.kv_rows_mb
        self._probes = ProbeCache(cache_dir() / "tuning.json")

    def describe(self, loaded: Loaded | None) -> dict:
        """The host choices, and for a loaded model its dtype (and the measurements it was
        chosen on) and where its weights went."""
        described = {"device": str(self.device), "threads": torch.get_num_threads(),
                     "threads_setting": self.thread_budget if self.threads_fixed else f"auto, up to {self.thread_budget}",
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "dtype_setting": self.dtype, "hub_kernels": self.hub_kernels,
                     "deterministic": self.deterministic}
        if loaded is None:
            return described
        placement = getattr(loaded.model, "hf_device_map", None)
        probe = loaded.probe
        return described | {"model": loaded.vocabulary.model_id, "dtype": "int8" if loaded.int8 else loaded.dtype,
                            "placement": placement,
                            "packed_linears": loaded.packed, "int8_linears": loaded.int8,
                            "kv_rows": loaded.rows.describe() if loaded.rows is not None else {"kind": "padded"},
                            "measured": [dataclasses.asdict(speed) for speed in probe.speeds],
                            "probe": probe.taken.describe() | {"step_profile": probe.steps,
                                                               "step_spread": probe.spread,
                                                               "tokens_per_s": _rates(probe.steps),
                                                               "slots_auto": auto_slots(probe.steps)}}

    def load(self, model_id: str, folder: Any, prefix: PrefixCache, abandon: Any = None) -> Loaded:
        """Read the model in ``folder``, then measure it and keep the fastest dtype and threads.
        ``abandon`` (an Event): once set, the load stops before its next step (SwapAbandoned)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _check(abandon, model_id)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        dtype = default_dtype(self.device) if self.dtype == "auto" else getattr(torch, self._activations())
        from ..runner.attention import prefer_grouped

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_kernels=self.hub_kernels,
                                                     **self._placement(model_id))
        _check(abandon, model_id)
        model.eval()
        prefer_grouped(model, row_invariant=self.deterministic)
        if self._fuses():
            fusing.fuse(model)
        loaded = Loaded(
            vocabulary=read_vocabulary(model_id, tokenizer, model.config),
            model=model,
            eos_ids=_eos_ids(model, tokenizer),
            cache_arg=_cache_arg(model),
            # Prefill needs logits for the last position only; Gemma's 262k vocabulary would
            # otherwise cost a quarter GB of logits per 256-token chunk.
            forward_kwargs={"logits_to_keep": 1} if model._supports_logits_to_keep() else {},
            dtype=str(dtype).removeprefix("torch."),
            prefix=prefix,
            gate=layer_gate(model),
        )
        self._tune(loaded, folder, abandon)
        return loaded

    def make_rows(self, loaded: Loaded, planned_bytes: int) -> None:
        """The static KV rows of a model now active (its dtype final), sized to the memory plan's
        ``planned_bytes``, on a GPU at most what is free now (``runner.rows.store_for``; None:
        its batches use padded rows)."""
        if self.rows.static(loaded.runner):
            if self.device.type == "cuda" and self.rows_mb is None:   # what other programs left of the plan's
                planned_bytes = min(planned_bytes, gpu_spare(self.device, loaded.prefix.budget_bytes))
            loaded.rows = kv_rows.store_for(loaded.runner, self.device, loaded.vocabulary.context_length, self.rows,
                                            planned_bytes)

    def _placement(self, model_id: str) -> dict:
        """Where the weights go: all on the device, or where accelerate fits them in ``max_memory``."""
        if self.max_memory is None:
            return {"device_map": str(self.device)}
        return {"device_map": "auto", "offload_folder": str(cache_dir() / "offload" / model_id),
                "max_memory": {int(k) if k.isdigit() else k: v for k, v in self.max_memory.items()}}

    def _tune(self, loaded: Loaded, folder: Any, abandon: Any = None) -> None:
        """Measure the loaded model (once per host, model and setting; cached) and keep the
        fastest dtype and thread count: on CPU with "auto", bf16 against float32, each with the
        whole thread budget and with half of it unless threads are fixed; otherwise the dtype
        as loaded, measured only to size prefill chunks. A cached probe taken while the host was
        busy (provisional) is measured again once the host is quiet; until then it is used."""
        dtypes = [loaded.dtype]
        offloaded = self.max_memory is not None   # offloaded weights are not cast in place
        if self.dtype == "auto" and self.device.type == "cpu" and loaded.dtype != "float32" and not offloaded:
            dtypes.append("float32")
        threads = ([self.thread_budget] if self.threads_fixed or self.device.type != "cpu"
                   else thread_options(self.thread_budget))
        candidates = [(dtype, n) for dtype in dtypes for n in threads]
        key = f"{host_signature()}|{folder}|{'+'.join(dtypes)}|threads {'+'.join(map(str, threads))}"
        if self.dtype == "int8":   # measured on int8 linears
            key += "|int8"
        elif self._packs():   # the step profile was measured on packed weights: not a plain model's
            key += "|packed"
        if fusing.fused(loaded.model):   # and on fused layers
            key += "|fused"
        if self.deterministic:   # and with each row decoded as alone
            key += "|row-invariant"
        probe = self._probes.get(key)
        if (probe is None or sorted((s.dtype, s.threads) for s in probe.speeds) != sorted(candidates)
                or probe.provisional and quiet(max(threads)) or not probe.current):
            probe = self._probe(loaded, candidates, abandon)
            self._probes.put(key, probe)
        best = fastest(probe.speeds)
        _cast(loaded, best.dtype)
        torch.set_num_threads(best.threads)
        self._pack(loaded)
        steps = GATED_CHUNK_DECODE_STEPS if loaded.gate is not None else CHUNK_DECODE_STEPS
        loaded.probe, loaded.clock, loaded.probe_key = probe, StepClock(best, steps), key

    def _probe(self, loaded: Loaded, candidates: list[tuple[str, int]], abandon: Any = None) -> Probe:
        """Time every (dtype, threads) candidate, then the step profile at the fastest, watching
        what else ran on the cores meanwhile. A model that cannot be batched (a sliding-window
        cache, ``runner.rows.batchable``) is profiled at one row only."""
        watch = Watch(max(n for _, n in candidates))
        vocab_size = len(loaded.vocabulary.tokenizer)
        speeds = []
        for dtype in dict.fromkeys(dtype for dtype, _ in candidates):
            _cast(loaded, dtype)
            with self._packed_for_now(loaded):
                for n in (n for candidate, n in candidates if candidate == dtype):
                    _check(abandon, loaded.vocabulary.model_id)   # a probe takes seconds: a chat may not wait
                    torch.set_num_threads(n)
                    speeds.append(measure(lambda ids, cache: _synced(loaded.runner.prefill(ids, cache, self.device)),
                                          vocab_size, dtype, n))
        best = fastest(speeds)
        _cast(loaded, best.dtype)
        torch.set_num_threads(best.threads)
        self._pack(loaded)
        _check(abandon, loaded.vocabulary.model_id)
        sizes = batch_sizes(self.device) if kv_rows.batchable(loaded.model) else (1,)
        steps, spread = measure_profile(loaded.runner, vocab_size, self.device, sizes, self.rows)
        return Probe(speeds, steps, watch.stop(), spread, (best.dtype, best.threads))

    @contextmanager
    def _packed_for_now(self, loaded: Loaded) -> Iterator[None]:
        """A dtype is timed as it would run, packed (``packing``: it changes which dtype is faster:
        float32 was on one row here plain, bf16 packed), with the plain layers kept to try the next.
        int8 linears are made once, for good: float32 is the one dtype they run with."""
        if self.dtype == "int8":
            self._pack(loaded)
            yield
            return
        if not self._packs():
            yield
            return
        packing.pack(loaded.model, keep_plain=True, one_row_as_two=self.deterministic)
        try:
            yield
        finally:
            packing.unpack(loaded.model)

    def _pack(self, loaded: Loaded) -> None:
        """Pack the linear layers in the dtype kept, for good (the plain weights are freed); with
        UNIUN_DTYPE=int8, make them int8 linears."""
        if self.dtype == "int8":
            loaded.int8 = loaded.int8 or int8.quantize(loaded.model)
        elif not loaded.packed and self._packs():
            loaded.packed = packing.pack(loaded.model, one_row_as_two=self.deterministic)

    def _activations(self) -> str:
        """The torch dtype a model is read in, as the setting names it (int8 linears take float32)."""
        return "float32" if self.dtype == "int8" else self.dtype

    def _packs(self) -> bool:
        return self.max_memory is None and packing.available(self.device)

    def _fuses(self) -> bool:
        """A CPU's Llama layers are fused (``fusing``) unless hub kernels replace their modules."""
        return self.max_memory is None and self.device.type == "cpu" and not self.hub_kernels

    def revise(self, loaded: Loaded) -> None:
        """Where the decode steps seen since the load clearly beat the probe's (it was taken while
        the host was busy and the watch missed it), scale its step profile and keep it marked
        provisional, so the next quiet load measures again (``tuning.revised``)."""
        probe = revised(loaded.probe, loaded.clock) if loaded.probe is not None else None
        if probe is not None:
            loaded.probe = probe
            self._probes.put(loaded.probe_key, probe)


def _check(abandon: Any, model_id: str) -> None:
    if abandon is not None and abandon.is_set():
        raise SwapAbandoned(f"the load of {model_id} was abandoned")


def _rates(steps: dict[int, float]) -> dict[int, float]:
    """The step profile as decode tokens per second by batch size: the curve "auto" reads."""
    return {batch: round(batch / seconds, 1) for batch, seconds in steps.items() if seconds > 0}


def _synced(step: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
    """Wait for the device to finish the step: CUDA runs asynchronously, and a probe must time
    the work, not its launch."""
    if step[0].device.type == "cuda":
        torch.cuda.synchronize()
    return step


def _cast(loaded: Loaded, dtype: str) -> None:
    """bf16 -> float32 -> bf16 is exact (every bf16 value is a float32), so trying float32
    and going back costs no accuracy. Packed weights (``packing``) keep their dtype for good."""
    if loaded.dtype != dtype:
        assert not loaded.packed, "a packed model keeps its dtype"
        loaded.model.to(getattr(torch, dtype))
        loaded.dtype = dtype


def _cache_arg(model: Any) -> str:
    """The forward() keyword (and output field) of the KV cache: transformers 5.x renamed
    ``past_key_values`` to ``cache`` along the way, and the old name now warns."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every token that ends a turn: the generation config may list several (chat models do)."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    return frozenset(ids)
