"""A Ray-free text generation engine: one model at a time, cancellable at every token.

The ModelActor is a thin Ray shell around ``Engine``. Everything that decides *how* a model runs
lives here, so it can be tested (and benchmarked) without a cluster:

* ``load`` / ``unload`` swap the single resident model and report how long that took, because
  the scheduler weighs swaps by their measured cost (SPEC R12).
* ``generate`` streams text and stops at the next token once its ``cancel`` event is set: this
  is how a revoke (SPEC R4) takes effect. The decode loop is our own rather than
  ``model.generate``: it checks the flag before every forward pass, including between the chunks
  of a long prompt's prefill, which ``generate`` cannot interrupt; and it yields pieces in the
  caller's thread, with no helper thread or queue as ``TextIteratorStreamer`` needs.
* A revoked job resumes recompute-style (SPEC R6): the new request carries what the job already
  produced, the engine prefills prompt + that, and the result holds only the new part.
* The host decides how it runs (``tuning``): on CPU the dtype is measured per host and model, and
  prefill chunks are sized by the time they take here. During a prefill the flag is also read
  before every decoder layer (``_LayerGate``), so chunks can be long and a revoke still waits
  about one decode step.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

from .decoding import StopText, decoding
from .kvcache import Hit, PrefixCache, crop_layers
from .prompt import prompt_ids
from .registry import ModelSpec, cache_dir, materialize, resolve
from .request import GenerateRequest, _is_int
from .settings import DTYPES, EngineSettings, check_max_memory, check_megabytes
from .tuning import (CHUNK_DECODE_STEPS, GATED_CHUNK_DECODE_STEPS, MAX_CHUNK, ProbeCache, Speed, StepClock,
                     fastest, host_signature, measure, thread_options)


class PromptTooLong(ValueError):
    """The prompt plus the tokens asked for do not fit the model's context window."""


class CancelFlag(Protocol):
    """What ``generate`` polls; a ``threading.Event`` is one."""

    def is_set(self) -> bool: ...


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype a model is loaded in before any measurement: bfloat16 (the converted weights'
    own), or float16 on GPUs without bf16. On CPU, "auto" then measures it against float32."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


@dataclass(frozen=True)
class GenerationResult:
    """How a run ended. Set on ``Generation.result`` once its iterator is exhausted or closed.

    ``text`` is the concatenation of the pieces yielded. ``token_ids`` are the tokens behind that
    text (the end-of-sequence token excluded); pass them as ``resume_tokens`` to continue after a
    revoke. On cancel, a token or two whose text was still incomplete (a multi-byte character
    split across tokens) is left out of both, so the resumed run recomputes it instead of the
    text losing a character. ``finish_reason`` is "eos", "length" (max_new_tokens reached),
    "stop" (a stop string; the text ends before it), "cancel" (the flag was set, or the
    consumer closed the iterator) or "error" (the model raised; the exception reached the
    consumer). ``ttft_s`` is the time from
    the start of the run (its first ``next``) to the first sampled token, None if none was.
    ``cached_tokens`` of the ``prompt_tokens`` came from the prefix cache; the rest were
    prefilled, in ``prefill_s`` (the cache lookup included; None: cancelled before the end).
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float | None
    total_s: float
    cached_tokens: int = 0
    prefill_s: float | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stopped_by_cancel(self) -> bool:
        return self.finish_reason == "cancel"


@dataclass(frozen=True)
class _Vocabulary:
    """What a request is checked against: a model's tokenizer and limits, not its weights."""

    model_id: str
    tokenizer: Any
    context_length: int
    chat: bool


@dataclass
class _Loaded:
    """The resident model and what the decode loop needs to know about it."""

    vocabulary: _Vocabulary
    model: Any
    eos_ids: frozenset[int]
    cache_arg: str
    forward_kwargs: dict = field(default_factory=dict)
    dtype: str = ""
    speeds: list[Speed] = field(default_factory=list)   # what the choice of dtype was made on
    clock: StepClock | None = None
    prefix: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    gate: "_LayerGate | None" = None


class _Interrupted(Exception):
    """The layer gate found the cancel flag set in the middle of a forward pass."""


class _LayerGate:
    """A cancel check before every decoder layer, armed only while a prefill chunk runs: a long
    chunk then stops within one layer of a revoke, so chunks need not be short (each short chunk
    pays for reading all the weights once). The chunk cut short leaves some layers extended and
    some not; `_prefill` crops the cache back to the chunks that completed."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.flag: CancelFlag | None = None
        for layer in layers:
            layer.register_forward_pre_hook(self._check)

    def _check(self, module: Any, args: Any) -> None:
        if self.flag is not None and self.flag.is_set():
            raise _Interrupted

    @contextmanager
    def armed(self, flag: CancelFlag) -> Iterator[None]:
        self.flag = flag
        try:
            yield
        finally:
            self.flag = None


def _layer_gate(model: Any) -> _LayerGate | None:
    """The gate over a decoder-only model's layers (`model.model.layers`, as Llama, Gemma and
    most causal LMs of transformers have them); None for another layout (chunks stay short)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return _LayerGate(layers) if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


class Engine:
    """Holds at most one causal LM on ``device`` and generates with it, one run at a time.

    ``dtype``: one of ``settings.DTYPES`` or a torch dtype; "auto" (the default) measures bf16
    against float32 on CPU, once per host and model (cached), and keeps the faster.
    ``num_threads`` fixes torch's intra-op threads for the whole process. None (the default):
    the probe measures every core of ``thread_budget`` (None: every core this process may run
    on) against half of them on CPU and keeps the faster; on a GPU the budget is used. Never
    Ray's OMP_NUM_THREADS=1, which actors inherit.
    ``prefill_chunk`` fixes the prompt tokens per prefill forward pass; None (the default) sizes
    each chunk by the time it takes on this host (``tuning.StepClock``); the layer gate bounds
    how long a cancel waits within one.
    ``kv_cache_mb`` bounds the prefix cache of the loaded model (``kvcache``; 0: off; None: the
    device's default); ``kv_offload_mb`` the CPU memory its entries move to when a GPU's budget is
    full (None: the default; a CPU device has one tier and ignores it). ``max_memory``
    ({"cpu": "2GiB"} or {"0": "6GiB", "cpu": "20GiB"}) lets accelerate place the weights
    (``device_map="auto"``) and offload what does not fit, to CPU memory or to disk under the
    cache folder: a model larger than the device runs, slower.

    Thread safety: ``generate`` may be iterated in a worker thread. ``load`` and ``unload`` refuse
    (RuntimeError) while a run is in progress: revoke it and let its iterator finish first.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = "auto",
        num_threads: int | None = None,
        thread_budget: int | None = None,
        prefill_chunk: int | None = None,
        kv_cache_mb: int | None = None,
        kv_offload_mb: int | None = None,
        max_memory: dict[str, str] | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested, but CUDA is not available")
        self._dtype = _dtype_choice(dtype)
        for name, value in (("num_threads", num_threads), ("thread_budget", thread_budget)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        self.threads_fixed = num_threads is not None
        self.thread_budget = num_threads or EngineSettings(threads=thread_budget).resolved_threads()
        torch.set_num_threads(self.thread_budget)
        if prefill_chunk is not None and (not _is_int(prefill_chunk) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be an int >= 1 or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        check_megabytes("kv_cache_mb", kv_cache_mb)
        check_megabytes("kv_offload_mb", kv_offload_mb)
        self.kv_cache_mb = default_kv_cache_mb(self.device) if kv_cache_mb is None else kv_cache_mb
        self.kv_offload_mb = (0 if self.device.type == "cpu" else
                              DEFAULT_KV_OFFLOAD_MB if kv_offload_mb is None else kv_offload_mb)
        if max_memory is not None:
            check_max_memory(max_memory)
        self.max_memory = max_memory
        self._probes = ProbeCache(cache_dir() / "tuning.json")
        self._lock = threading.Lock()
        self._loaded: _Loaded | None = None
        self._running = 0

    @property
    def loaded(self) -> str | None:
        """The id of the resident model, or None."""
        loaded = self._loaded
        return loaded.vocabulary.model_id if loaded else None

    @property
    def context_length(self) -> int | None:
        """The resident model's context window in tokens, or None when nothing is loaded."""
        loaded = self._loaded
        return loaded.vocabulary.context_length if loaded else None

    @property
    def dtype(self) -> torch.dtype | None:
        """The resident model's dtype, or None when nothing is loaded."""
        loaded = self._loaded
        return getattr(torch, loaded.dtype) if loaded else None

    def describe(self) -> dict:
        """The host choices, for ``status`` and the benchmarks: dtype (and the measurements it
        was chosen on), threads, the current prefill chunk and step times."""
        loaded = self._loaded
        described = {"device": str(self.device), "threads": torch.get_num_threads(),
                     "threads_setting": self.thread_budget if self.threads_fixed else f"auto, up to {self.thread_budget}",
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "dtype_setting": self._dtype if isinstance(self._dtype, str) else str(self._dtype)}
        if loaded is None:
            return described
        placement = getattr(loaded.model, "hf_device_map", None)
        return described | {"model": loaded.vocabulary.model_id, "dtype": loaded.dtype, "placement": placement,
                            "measured": [dataclasses.asdict(speed) for speed in loaded.speeds]} \
            | loaded.clock.describe() | ({"prefill_chunk": self.prefill_chunk} if self.prefill_chunk else {}) \
            | {"kv_cache": loaded.prefix.describe() | {"tiers": self._kv_tiers()}}

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

    def load(self, model_id: str) -> float:
        """Make ``model_id`` the resident model; return the seconds it took (0.0 if it already was).

        A different resident model is unloaded first, and that time is included: the caller wants
        the cost of the swap. The id is resolved, and a GGUF converted, before the old model is
        dropped, so an unknown id (UnknownModel) leaves the engine as it was.
        """
        with self._lock:
            self._refuse_while_running("load")
            if self.loaded == model_id:
                return 0.0
            started = time.perf_counter()
            folder = materialize(resolve(model_id))
            self._release()
            self._loaded = self._load_folder(model_id, folder)
            return time.perf_counter() - started

    def unload(self) -> float:
        """Drop the resident model and free its memory; return the seconds it took."""
        with self._lock:
            self._refuse_while_running("unload")
            started = time.perf_counter()
            self._release()
            return time.perf_counter() - started

    def check(self, request: GenerateRequest) -> int:
        """Raise what ``generate`` would raise for ``request``, without running the model.

        Returns the number of tokens the run would prefill (prompt, template and resumed
        output). RuntimeError: no model is loaded. Otherwise as ``inspect_request``.
        """
        return len(self._prepare(request)[1])

    def generate(self, request: GenerateRequest, cancel: CancelFlag, revocable: bool = True) -> Generation:
        """Start a run: iterate the result for text pieces, then read its ``.result``.

        The request is checked here, eagerly (see ``check``); the model runs only as the
        iterator is advanced, in the thread that advances it. Setting ``cancel`` stops the run
        before its next forward pass: within one token while decoding, within one prefill chunk
        while reading the prompt. A run that is not ``revocable`` (nothing but its own cancel
        stops it: chat) reads its prompt in chunks of up to MAX_CHUNK tokens instead of chunks
        sized to one decode step.
        """
        if not callable(getattr(cancel, "is_set", None)):
            raise ValueError(f"cancel must have an is_set() method (a threading.Event), got {cancel!r}")
        loaded, context = self._prepare(request)
        return Generation(self, loaded, context, request, cancel, revocable)

    # -- internals ---------------------------------------------------------------------------

    def _refuse_while_running(self, action: str) -> None:
        if self._running:
            raise RuntimeError(f"cannot {action} while a generation is running; cancel it first")

    def _release(self) -> None:
        if self._loaded is None:
            return
        self._loaded = None
        gc.collect()  # the model's tensors are freed here; the cache below can then shrink
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _load_folder(self, model_id: str, folder: Any) -> _Loaded:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        dtype = default_dtype(self.device) if self._dtype == "auto" else getattr(torch, self._dtype)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **self._placement(model_id))
        model.eval()
        loaded = _Loaded(
            vocabulary=_vocabulary(model_id, tokenizer, model.config),
            model=model,
            eos_ids=_eos_ids(model, tokenizer),
            cache_arg=_cache_arg(model),
            # Prefill needs logits for the last position only; Gemma's 262k vocabulary would
            # otherwise cost a quarter GB of logits per 256-token chunk.
            forward_kwargs={"logits_to_keep": 1} if model._supports_logits_to_keep() else {},
            dtype=str(dtype).removeprefix("torch."),
            prefix=PrefixCache(self.kv_cache_mb * 2**20, self.kv_offload_mb * 2**20),
            gate=_layer_gate(model),
        )
        self._tune(loaded, folder)
        return loaded

    def _placement(self, model_id: str) -> dict:
        """Where the weights go: all on the device, or where accelerate fits them in ``max_memory``."""
        if self.max_memory is None:
            return {"device_map": str(self.device)}
        return {"device_map": "auto", "offload_folder": str(cache_dir() / "offload" / model_id),
                "max_memory": {int(k) if k.isdigit() else k: v for k, v in self.max_memory.items()}}

    def _tune(self, loaded: _Loaded, folder: Any) -> None:
        """Measure the loaded model (once per host, model and setting; cached) and keep the
        fastest dtype and thread count: on CPU with "auto", bf16 against float32, each with the
        whole thread budget and with half of it unless threads are fixed; otherwise the dtype
        as loaded, measured only to size prefill chunks."""
        dtypes = [loaded.dtype]
        offloaded = self.max_memory is not None   # offloaded weights are not cast in place
        if self._dtype == "auto" and self.device.type == "cpu" and loaded.dtype != "float32" and not offloaded:
            dtypes.append("float32")
        threads = ([self.thread_budget] if self.threads_fixed or self.device.type != "cpu"
                   else thread_options(self.thread_budget))
        candidates = [(dtype, n) for dtype in dtypes for n in threads]
        key = f"{host_signature()}|{folder}|{'+'.join(dtypes)}|threads {'+'.join(map(str, threads))}"
        speeds = self._probes.get(key)
        if speeds is None or sorted((s.dtype, s.threads) for s in speeds) != sorted(candidates):
            speeds = []
            for dtype, n in candidates:
                self._cast(loaded, dtype)
                torch.set_num_threads(n)
                speeds.append(measure(lambda ids, cache: _synced(_forward(loaded, ids, cache, self.device)),
                                      len(loaded.vocabulary.tokenizer), dtype, n))
            self._probes.put(key, speeds)
        best = fastest(speeds)
        self._cast(loaded, best.dtype)
        torch.set_num_threads(best.threads)
        steps = GATED_CHUNK_DECODE_STEPS if loaded.gate is not None else CHUNK_DECODE_STEPS
        loaded.speeds, loaded.clock = speeds, StepClock(best, steps)

    @staticmethod
    def _cast(loaded: _Loaded, dtype: str) -> None:
        """bf16 -> float32 -> bf16 is exact (every bf16 value is a float32), so trying float32
        and going back costs no accuracy."""
        if loaded.dtype != dtype:
            loaded.model.to(getattr(torch, dtype))
            loaded.dtype = dtype

    def _prepare(self, request: GenerateRequest) -> tuple[_Loaded, list[int]]:
        """The loaded model and the token ids to prefill for ``request``; raises if it cannot run."""
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("no model is loaded; call load(model_id) first")
        return loaded, _context(loaded.vocabulary, request)

    def _begin(self, loaded: _Loaded) -> None:
        with self._lock:
            if self._loaded is not loaded:
                raise RuntimeError(
                    f"model {loaded.vocabulary.model_id!r} was unloaded after this generation was checked"
                )
            self._running += 1

    def _end(self) -> None:
        with self._lock:
            self._running -= 1


#: CPU memory for the KV a GPU's cache pushes out, per GPU: a node with eight takes 32 GiB.
DEFAULT_KV_OFFLOAD_MB = 4096


def default_kv_cache_mb(device: torch.device) -> int:
    """The prefix cache's budget when none is set: 1 GiB of host memory on CPU (about 22k tokens
    of SmolLM2 in float32), 4 GiB on a GPU."""
    return 4096 if device.type == "cuda" else 1024


def _dtype_choice(dtype: str | torch.dtype | None) -> str:
    """"auto", or the name of a dtype the engine runs in."""
    if dtype is None:
        return "auto"
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return name


def inspect_request(spec: ModelSpec, request: GenerateRequest) -> int:
    """Check ``request`` against a model that need not be loaded; return its prefill token count.

    Reads only the model's tokenizer and config (cached per model), so a client's request can be
    refused before it is queued, rather than after the scheduler has swapped the model in for it.
    ValueError: the request does not suit the model (messages without a chat template, token ids
    outside the vocabulary, an empty prompt). PromptTooLong: prompt + resumed output +
    max_new_tokens exceed the context window.
    """
    return len(_context(_vocabulary_of(spec), request))


_VOCABULARY_LOCK = threading.Lock()


def _vocabulary_of(spec: ModelSpec) -> _Vocabulary:
    """Serialised: transformers' lazy imports are not thread-safe on first use (two concurrent
    checks once failed with "cannot import name 'AutoConfig'"), and one conversion is enough."""
    with _VOCABULARY_LOCK:
        return _cached_vocabulary(spec)


@functools.lru_cache(maxsize=8)
def _cached_vocabulary(spec: ModelSpec) -> _Vocabulary:
    from transformers import AutoConfig, AutoTokenizer

    folder = materialize(spec)
    return _vocabulary(spec.id, AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder))


def _vocabulary(model_id: str, tokenizer: Any, config: Any) -> _Vocabulary:
    length = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not _is_int(length) or length < 1:
        raise ValueError(
            f"model {model_id!r} declares no max_position_embeddings; its context length is unknown"
        )
    return _Vocabulary(
        model_id=model_id,
        tokenizer=tokenizer,
        context_length=length,
        chat=bool(getattr(tokenizer, "chat_template", None)),
    )


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


def _context(vocabulary: _Vocabulary, request: GenerateRequest) -> list[int]:
    """The token ids to prefill for ``request``; raises if the model cannot run it."""
    if not isinstance(request, GenerateRequest):
        raise ValueError(f"request must be a GenerateRequest, got {type(request).__name__}")
    context = prompt_ids(vocabulary.tokenizer, vocabulary.chat, vocabulary.model_id, request)
    if not context:
        raise ValueError("the prompt encodes to zero tokens; there is nothing to continue")
    request.check_vocabulary(len(vocabulary.tokenizer), vocabulary.model_id)
    needed = len(context) + request.max_new_tokens
    if needed > vocabulary.context_length:
        resumed = len(request.resume_tokens)
        raise PromptTooLong(
            f"prompt is {len(context) - resumed} tokens"
            + (f" + {resumed} resumed" if resumed else "")
            + f" + max_new_tokens {request.max_new_tokens} = {needed} tokens, more than the "
            f"context length {vocabulary.context_length} of model {vocabulary.model_id!r}"
        )
    return context


class Generation(Iterator[str]):
    """One run of the engine: an iterator of text pieces, with ``result`` set when it ends.

    Advance it from one thread at a time; which thread may change between pieces (the actor
    hands each ``next`` to a thread pool). ``close()``, or dropping it, ends the run early,
    recorded as a cancel. ``result`` stays None if the iterator was never advanced.
    """

    def __init__(
        self,
        engine: Engine,
        loaded: _Loaded,
        context: list[int],
        request: GenerateRequest,
        cancel: CancelFlag,
        revocable: bool = True,
    ) -> None:
        self.result: GenerationResult | None = None
        #: Generated tokens whose text has been handed out so far: what a consumer that loses
        #: the run (and `result`) has of it.
        self.emitted_tokens = 0
        # A run nobody else can revoke (chat: only its own cancel stops it) reads its prompt in
        # as few forward passes as memory allows; chunks sized to one decode step are the price
        # of a quick revoke, and cost a CPU about half its prefill speed.
        chunk = engine.prefill_chunk or (None if revocable else MAX_CHUNK)
        self._steps = self._run(engine, loaded, context, request, cancel, chunk)

    def __next__(self) -> str:
        return next(self._steps)

    def close(self) -> None:
        self._steps.close()

    def _run(
        self,
        engine: Engine,
        loaded: _Loaded,
        context: list[int],
        request: GenerateRequest,
        cancel: CancelFlag,
        chunk: int | None,
    ) -> Iterator[str]:
        engine._begin(loaded)
        started = time.perf_counter()
        detokenizer = _Detokenizer(loaded.vocabulary.tokenizer, context)
        stop_text = StopText(request.stop)
        pieces: list[str] = []
        first_token_at = prefilled_at = None
        reason = "error"  # what an exception from the model leaves
        cache, fed, hit = None, 0, Hit(None, 0)
        try:
            run = decoding(loaded.model, loaded.vocabulary.tokenizer, request, len(context),
                           loaded.eos_ids, cancel, engine.device)
            sequence = torch.empty((1, len(context) + request.max_new_tokens), dtype=torch.long)
            sequence[0, : len(context)] = torch.tensor(context)
            length = len(context)
            hit = loaded.prefix.take(context)
            logits, cache, fed = _prefill(loaded, context, hit, chunk, engine.device, run.cancel)
            if logits is not None:
                prefilled_at = time.perf_counter()
            while logits is not None:
                token = run.next_token(sequence[:, :length], logits)
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                sequence[0, length] = token
                length += 1
                ended = run.finish_reason(sequence[:, :length])
                if token not in loaded.eos_ids:
                    piece = stop_text.push(detokenizer.push(token))
                    if piece:
                        pieces.append(piece)
                        self.emitted_tokens = len(detokenizer.committed)
                        yield piece
                if stop_text.stopped:
                    ended = "stop"  # seen in the text at a token boundary the criterion had not
                if ended is not None:
                    reason = ended
                    break
                logits, cache = _step(loaded, [token], cache, engine.device, run.cancel)
                fed += logits is not None
            else:
                reason = "cancel"  # the flag was seen in prefill or before a decode step
            # A cancelled run leaves out text still held for an incomplete character (its tokens
            # are not committed: the resumed run recomputes them), but not text held back as a
            # possible stop string, whose tokens are.
            tail = stop_text.flush() if reason == "cancel" else stop_text.push(detokenizer.flush())
            if not stop_text.stopped:
                tail += stop_text.flush()
            if tail:
                pieces.append(tail)
                yield tail
        except GeneratorExit:
            reason = "cancel"  # the consumer closed the iterator
            raise
        finally:
            if reason != "error" and fed:  # keep the KV for the next turn, or for the resume
                loaded.prefix.put(sequence[0, :fed].tolist(), cache, preempted=reason == "cancel",
                                  prompt=len(context))
            engine._end()
            self.result = GenerationResult(
                text="".join(pieces),
                token_ids=tuple(detokenizer.committed),
                prompt_tokens=len(context),
                finish_reason=reason,
                ttft_s=None if first_token_at is None else first_token_at - started,
                total_s=time.perf_counter() - started,
                cached_tokens=hit.tokens,
                prefill_s=None if prefilled_at is None else prefilled_at - started,
            )


def _prefill(
    loaded: _Loaded, context: list[int], hit: Hit, fixed_chunk: int | None, device: torch.device,
    cancel: CancelFlag,
) -> tuple[torch.Tensor | None, Any, int]:
    """Read the context after the cached prefix in chunks, checking ``cancel`` before each
    and, where the model has a layer gate, before each of its layers. Returns the last logits
    (None when cancelled), the cache and how many tokens it holds: the chunks that completed
    (a chunk cut short is cropped away; a cache that cannot be cropped back is dropped).
    Unless fixed, each chunk is sized anew from the step times measured so far."""
    logits, cache, start = None, hit.cache, hit.tokens
    while start < len(context):
        chunk = fixed_chunk or loaded.clock.chunk
        try:
            with loaded.gate.armed(cancel) if loaded.gate is not None else nullcontext():
                step_logits, cache = _step(loaded, context[start : start + chunk], cache, device, cancel)
        except _Interrupted:
            if cache is None or not crop_layers(cache, start):
                return None, None, 0
            return None, cache, start
        if step_logits is None:
            return None, cache, start
        logits, start = step_logits, min(start + chunk, len(context))
    return logits, cache, start


def _step(
    loaded: _Loaded, ids: list[int], cache: Any, device: torch.device, cancel: CancelFlag
) -> tuple[torch.Tensor | None, Any]:
    """One forward pass over ``ids`` extending ``cache``, unless ``cancel`` is set (logits None).

    Inference mode is entered per call, not around the generator: a generator suspended inside
    the context manager would leave the consumer's thread in inference mode between pieces.
    """
    if cancel.is_set():
        return None, cache
    started = time.perf_counter()
    logits, cache = _forward(loaded, ids, cache, device)
    loaded.clock.observe(len(ids), time.perf_counter() - started)
    return logits, cache


def _synced(step: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
    """Wait for the device to finish the step: CUDA runs asynchronously, and a probe must time
    the work, not its launch."""
    if step[0].device.type == "cuda":
        torch.cuda.synchronize()
    return step


def _forward(loaded: _Loaded, ids: list[int], cache: Any, device: torch.device) -> tuple[torch.Tensor, Any]:
    with torch.inference_mode():
        output = loaded.model(
            input_ids=torch.tensor([ids], device=device),
            use_cache=True,
            **{loaded.cache_arg: cache},
            **loaded.forward_kwargs,
        )
    return output.logits[0, -1], getattr(output, loaded.cache_arg)


class _Detokenizer:
    """Turns generated tokens into text pieces without splitting a character.

    vLLM's incremental detokenization: decode a short window that starts a few tokens back
    (so a tokenizer that drops or adds a leading space at the start of a decode does it on both
    sides of the difference) and emit the text it gained; hold tokens back while the text ends in
    U+FFFD (an incomplete multi-byte character) or gained nothing (e.g. a skipped special token).
    Decoding a window, not the whole output, keeps each step O(1) in the output length.
    """

    _LOOKBACK = 5

    def __init__(self, tokenizer: Any, context: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context[-self._LOOKBACK :])
        self._first = len(self._ids)
        self._prefix = 0
        self._read = self._first

    @property
    def committed(self) -> list[int]:
        """Generated tokens whose text has been emitted."""
        return self._ids[self._first : self._read]

    def push(self, token: int) -> str:
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held, incomplete character included: the run is over."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)
