"""How a user sets the engine's host choices: ``UNIUN_ENGINE``, ``UNIUN_DTYPE``, ``UNIUN_THREADS``,
``UNIUN_KV_CACHE_MB``, ``UNIUN_KV_OFFLOAD_MB``, ``UNIUN_MAX_MEMORY``, ``UNIUN_SLOTS``, ``UNIUN_WARM_MB``,
``UNIUN_CORESIDENT``, ``UNIUN_HUB_KERNELS`` and ``UNIUN_DETERMINISTIC``.

Parsed without torch, in the process that starts the ModelActor (so a bad value is refused with
a clear message before any actor exists) and handed to the actor as plain data: an environment
variable set in a driver does not reach an actor's worker process on its own.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping

ENGINE_ENV = "UNIUN_ENGINE"
DTYPE_ENV = "UNIUN_DTYPE"
THREADS_ENV = "UNIUN_THREADS"
KV_CACHE_ENV = "UNIUN_KV_CACHE_MB"
KV_OFFLOAD_ENV = "UNIUN_KV_OFFLOAD_MB"
MAX_MEMORY_ENV = "UNIUN_MAX_MEMORY"
SLOTS_ENV = "UNIUN_SLOTS"
WARM_ENV = "UNIUN_WARM_MB"
CORESIDENT_ENV = "UNIUN_CORESIDENT"
#: "0": `start()` and `uniun-ray up` do not load the active chat model before they are ready.
WARM_START_ENV = "UNIUN_WARM_START"
#: The share of the host's available memory that idle models may keep by default (``default_warm_mb``).
WARM_SHARE = 0.5
HUB_KERNELS_ENV = "UNIUN_HUB_KERNELS"
DETERMINISTIC_ENV = "UNIUN_DETERMINISTIC"
#: The most slots a device may be given (R25): a batch's rows, each with its own KV.
MAX_SLOTS = 256

_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")

#: What runs a device's forward passes (SPEC §7, ``uniun_ray.engines``): the first is the default.
ENGINES = ("transformers", "vllm")

#: "auto" measures, per host and model, which precision runs fastest on a CPU (see ``tuning``);
#: on a GPU it means bfloat16, or float16 where bf16 is not supported.
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EngineSettings:
    """``dtype``: one of ``DTYPES``. ``threads``: torch's intra-op threads, or None for every
    core this process may run on (its CPU affinity), never Ray's OMP_NUM_THREADS=1 default.
    ``kv_cache_mb``: the prefix cache's memory budget on the device (0: off; None: the device's
    default). ``kv_offload_mb``: CPU memory for the cache entries pushed out of a GPU's budget
    (0: they are dropped; None: the default); unused on a CPU device, whose one tier is host memory.
    ``max_memory``: per device ("cpu", or a GPU index as a string) the most memory the weights
    may take, as accelerate reads it ("6GiB"); what does not fit is offloaded (``device_map="auto"``),
    so a model larger than the device still runs, slower. None: the whole model on the device.
    ``engine``: one of ``ENGINES``. ``slots``: ``UNIUN_SLOTS`` as a count, or None for "auto". The
    scheduler decides how many jobs a device runs (``RuntimeConfig.slots``); an engine that must
    fix its batch when it starts (vLLM's ``max_num_seqs``) starts with this many.
    ``warm_mb``: host memory for the idle models this engine keeps warm (``models.load.parked``;
    0: none, every swap is a cold load; None: ``default_warm_mb``). ``coresident``: whether an
    idle model may stay on the device beside the active one where it has room (a swap back is
    then a switch, no copy); False keeps idle models in host memory (a swap back is a copy).
    ``hub_kernels``: let transformers replace layers with kernels it fetches from the Hugging Face
    Hub at load (its ``use_kernels``): off unless the user opts in, since that downloads and runs
    code nobody asked for, and fails offline on a GPU. ``deterministic``: a CPU decode step
    computes each row as it would alone and a prompt is read the same whatever the prefix cache
    held, so a greedy answer depends on neither, in bfloat16 either (``runner.attention``,
    ``load.packing``, ``kv.prefix``; it costs decode throughput and prefill time)."""

    dtype: str = "auto"
    threads: int | None = None
    kv_cache_mb: int | None = None
    kv_offload_mb: int | None = None
    max_memory: dict[str, str] | None = field(default=None, hash=False)
    engine: str = ENGINES[0]
    slots: int | None = None
    warm_mb: int | None = None
    coresident: bool = True
    hub_kernels: bool = False
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {self.engine!r}")
        check_slot_count(self.slots)
        for name in ("hub_kernels", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads must be an int >= 1 or None, got {self.threads!r}")
        for name in ("kv_cache_mb", "kv_offload_mb", "warm_mb"):
            check_megabytes(name, getattr(self, name))
        if not isinstance(self.coresident, bool):
            raise ValueError(f"coresident must be a bool, got {self.coresident!r}")
        if self.max_memory is not None:
            check_max_memory(self.max_memory)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "EngineSettings":
        dtype = environ.get(DTYPE_ENV, "").strip() or "auto"
        if dtype not in DTYPES:
            raise ValueError(f"{DTYPE_ENV}={dtype!r} is not a dtype; use one of {', '.join(DTYPES)}")
        threads = _count(environ, THREADS_ENV, "a thread count; use an integer >= 1", minimum=1)
        kv_cache_mb = _count(environ, KV_CACHE_ENV, "a size in MB; use an integer >= 0 (0 turns the cache off)",
                             minimum=0)
        kv_offload_mb = _count(environ, KV_OFFLOAD_ENV,
                               "a size in MB; use an integer >= 0 (0 drops what the device's cache pushes out)",
                               minimum=0)
        raw = environ.get(MAX_MEMORY_ENV, "").strip()
        max_memory = None
        if raw:
            pairs = [part.split("=", 1) for part in raw.split(",")]
            if any(len(pair) != 2 for pair in pairs):
                raise ValueError(f"{MAX_MEMORY_ENV}={raw!r}: write DEVICE=SIZE pairs, e.g. 'cpu=2GiB' or '0=6GiB,cpu=20GiB'")
            max_memory = {device.strip(): size.strip() for device, size in pairs}
            try:
                check_max_memory(max_memory)
            except ValueError as error:
                raise ValueError(f"{MAX_MEMORY_ENV}={raw!r}: {error}") from None
        engine = environ.get(ENGINE_ENV, "").strip() or ENGINES[0]
        if engine not in ENGINES:
            raise ValueError(f"{ENGINE_ENV}={engine!r} is not an engine; use one of {', '.join(ENGINES)}")
        warm_mb = _count(environ, WARM_ENV, "a size in MB; use an integer >= 0 (0 keeps no model warm)", minimum=0)
        coresident = environ.get(CORESIDENT_ENV, "").strip() or "1"
        if coresident not in ("0", "1"):
            raise ValueError(f"{CORESIDENT_ENV}={coresident!r}: use 1 (idle models may stay on the device) or 0")
        return cls(dtype, threads, kv_cache_mb, kv_offload_mb, max_memory, engine,
                   parse_slots(environ.get(SLOTS_ENV, "")), warm_mb, coresident == "1",
                   _switch(environ, HUB_KERNELS_ENV, "let transformers fetch and run Hub kernels at load"),
                   _switch(environ, DETERMINISTIC_ENV, "get one greedy answer whatever rows are beside it and the prefix cache held"))

    def resolved_threads(self) -> int:
        """The thread count to give torch in this process."""
        return self.threads or len(os.sched_getaffinity(0)) or 1


def warm_start(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `start()` and `uniun-ray up` load the active chat model before they are ready
    (``UNIUN_WARM_START``; on unless "0")."""
    return environ.get(WARM_START_ENV, "1").strip() != "0"


def default_warm_mb(shares: int = 1) -> int:
    """The warm budget when ``UNIUN_WARM_MB`` is not set: WARM_SHARE of the memory the host has
    available now (what Ray's object store already holds is not available), split evenly
    between the ``shares`` ModelActors of the node, which each keep their own idle models."""
    import psutil   # Ray's own dependency

    return int(psutil.virtual_memory().available * WARM_SHARE / max(1, shares) / 2**20)


def _count(environ: Mapping[str, str], name: str, what: str, minimum: int) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < minimum:
        raise ValueError(f"{name}={raw!r} is not {what}")
    return int(raw)


def check_slot_count(slots: object) -> None:
    """A slot count (SPEC §6, R25): 1..MAX_SLOTS, or None for "auto" (measured at each load)."""
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS):
        raise ValueError(f"slots must be an int from 1 to {MAX_SLOTS}, or None for auto; got {slots!r}")


#: The operator's models where no command line names them (`ID=PATH,ID=PATH`): the twin of
#: `uniun-ray up --model ID=PATH`, for scripts submitted to a head that start the runtime.
MODELS_ENV = "UNIUN_MODELS"


def parse_models(text: str) -> dict[str, str]:
    """``ID=PATH,ID=PATH`` as {id: folder}; ValueError names an entry that is not ID=PATH."""
    models = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        model_id, sep, folder = entry.partition("=")
        if not sep or not model_id.strip() or not folder.strip():
            raise ValueError(f"{entry!r} is not ID=PATH (a model id, then the folder of its weights)")
        models[model_id.strip()] = folder.strip()
    return models


def parse_slots(raw: str) -> int | None:
    """``UNIUN_SLOTS`` / ``--slots``: "auto" (or empty) is None, else a count."""
    raw = str(raw).strip().lower()
    if raw in ("", "auto"):
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_SLOTS:
        raise ValueError(f"{SLOTS_ENV}={raw!r}: slots are 'auto' or a count from 1 to {MAX_SLOTS}")
    return int(raw)


def _switch(environ: Mapping[str, str], name: str, what: str) -> bool:
    """A setting that is off unless the user opts in: "1" on, "0" or unset off."""
    raw = environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: use 1 to {what}, 0 (the default) not to")
    return raw == "1"


def check_megabytes(name: str, value: object) -> None:
    """A budget in MB: an int >= 0, or None for the default."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")


def check_max_memory(max_memory: Mapping[str, str]) -> None:
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(f"max_memory must map devices to sizes, got {max_memory!r}")
    for device, size in max_memory.items():
        if not (device == "cpu" or (isinstance(device, str) and device.isdigit())):
            raise ValueError(f"max_memory: device {device!r} is neither 'cpu' nor a GPU index")
        if not isinstance(size, str) or not _SIZE.match(size):
            raise ValueError(f"max_memory: size {size!r} of {device!r} is not a size like '512MB' or '6GiB'")
