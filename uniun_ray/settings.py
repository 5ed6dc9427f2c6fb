"""The settings room: every ``UNIUN_*`` setting, declared once (``SETTINGS``: its name, variable,
default, what it takes, what it does, and whether it is a debug knob users leave alone).

They are read once where the runtime starts (``Settings.load``: the environment, then the flags
of ``uniun-ray up`` or the arguments of ``start`` over it), checked there, with an error that
names the variable, its value and what it takes, before any actor exists, and handed to the
actors as plain data (``EngineSettings`` to a ModelActor, ``Settings.describe`` to the
scheduler's ``status``): an environment variable set in a driver does not reach an actor's
worker process on its own. The few read where they are used (the folders, the vLLM Python, the
HTTP key: ``read``) are read through this module too; no other module reads ``UNIUN_*``.
Parsed without torch.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

#: The most slots a device may be given (R25): a batch's rows, each with its own KV.
MAX_SLOTS = 256
#: What runs a device's forward passes (SPEC §7, ``uniun_ray.engines``): the first is the default.
ENGINES = ("transformers", "vllm")
#: "auto" measures, per host and model, which precision runs fastest on a CPU (see ``tuning``);
#: on a GPU it means bfloat16, or float16 where bf16 is not supported.
DTYPES = ("auto", "bfloat16", "float16", "float32", "int8")
#: How a batch keeps its KV rows (``models.runner.rows``) and how static rows step (``.static``).
ROW_KINDS = ("padded", "static")
STEP_MODES = ("exact", "buckets", "graphs")
DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"
#: Where a setting's value came from, weakest first: a flag of `uniun-ray up`, an argument of `start`.
SOURCES = ("default", "environment", "flag", "argument")

_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass(frozen=True)
class Kind:
    """How a setting is written (``parse``: the variable's text to a value, ValueError where it
    cannot be) and what values it takes (``valid``; ``allowed`` says it in words)."""

    parse: Callable[[str], Any]
    valid: Callable[[Any], bool]
    allowed: str


def _choice(*options: str) -> Kind:
    return Kind(str.lower, lambda value: value in options, "one of " + ", ".join(options))


def _int(text: str) -> int:
    if not text.isdigit():
        raise ValueError
    return int(text)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(minimum: int, what: str) -> Kind:
    return Kind(_int, lambda value: _whole(value) and value >= minimum, f"{what}: an integer >= {minimum}")


def _switch(on: str, off: str) -> Kind:
    return Kind(_bit, lambda value: isinstance(value, bool), f"1 to {on}, 0 {off}")


def _bit(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError
    return text == "1"


def _slots(text: str) -> int | None:
    return None if text.lower() == "auto" else _int(text)


def _budget(text: str) -> float | int:
    """A device's memory budget: a share of it ("0.8", "1") or a size ("12GiB", as bytes)."""
    if "." in text and text.replace(".", "", 1).isdigit() or text in ("0", "1"):
        return float(text)
    match = _SIZE.match(text)
    if not match:
        raise ValueError
    return int(float(text[:match.start(2)].strip()) * _UNITS[match.group(2)])


def _valid_budget(value: object) -> bool:
    return (isinstance(value, float) and 0 < value <= 1) or (_whole(value) and value > 0)


def _max_memory(text: str) -> dict[str, str]:
    pairs = [part.split("=", 1) for part in text.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError
    return {device.strip(): size.strip() for device, size in pairs}


def _valid_max_memory(value: object) -> bool:
    try:
        check_max_memory(value)
    except ValueError:
        return False
    return True


def parse_models(text: str) -> dict[str, str]:
    """``ID=PATH,ID=PATH`` as {id: folder}; ValueError names an entry that is not ID=PATH."""
    models = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        model_id, sep, folder = entry.partition("=")
        if not sep or not model_id.strip() or not folder.strip():
            raise ValueError(f"{entry!r} is not ID=PATH (a model id, then the folder of its weights)")
        models[model_id.strip()] = folder.strip()
    return models


def _text(what: str) -> Kind:
    return Kind(str, lambda value: isinstance(value, str) and bool(value), what)


_MB = _count(0, "megabytes")
_PATH = Kind(lambda text: str(Path(text).expanduser()), lambda value: isinstance(value, (str, os.PathLike)), "a path")


@dataclass(frozen=True)
class Setting:
    """One setting: ``name`` as code reads it, ``env`` the variable, ``default`` when it is not
    set (None: decided where it is used, per device or host, as ``default_doc`` says)."""

    name: str
    env: str
    default: Any
    kind: Kind
    doc: str
    default_doc: str = ""   # the default in words, where it is decided per device or host
    flag: str = ""          # where else it is set: a flag of `uniun-ray up`, an argument of `start`
    debug: bool = False     # for tests and benchmarks: users leave it unset

    def read(self, raw: str) -> Any:
        """The value of the variable's text ``raw`` (empty: the default); ValueError names the
        variable, the value and what it takes."""
        text = raw.strip()
        if not text:
            return self.default
        try:
            value = self.kind.parse(text)
        except (ValueError, KeyError) as error:
            value = error
        if isinstance(value, Exception) or not self.kind.valid(value):
            raise ValueError(f"{self.env}={text!r} is not allowed: use {self.kind.allowed}") from None
        return value

    def check(self, value: Any) -> Any:
        """``value`` as given in code (None where the default is); ValueError says what it takes."""
        if value is self.default:
            return value
        if value is None or not self.kind.valid(value):
            unset = ", or None" if self.default is None else ""
            raise ValueError(f"{self.name} ({self.env}) must be {self.kind.allowed}{unset}; got {value!r}")
        return value


SETTINGS: tuple[Setting, ...] = (
    Setting("chat_model", "UNIUN_CHAT_MODEL", DEFAULT_CHAT_MODEL, _text("a model id or a folder of weights"),
            "the active chat model (what `model_id=None` and HTTP's `\"default\"` mean): the scheduler's "
            "setting, so every process agrees; a folder is served under its name",
            flag="`uniun-ray up --chat-model ID`"),
    Setting("models", "UNIUN_MODELS", {}, Kind(parse_models, lambda value: isinstance(value, Mapping), "ID=PATH,ID=PATH"),
            "the operator's models, served by id beside the embedded ones",
            flag="`uniun-ray up --model ID=PATH` (repeatable), `start(models={\"ID\": \"PATH\"})`"),
    Setting("engine", "UNIUN_ENGINE", ENGINES[0], _choice(*ENGINES),
            "what runs the devices' forward passes ([engines](engines.md)); vllm needs `make install-vllm`",
            flag="`uniun-ray up --engine`, `make demo ENGINE=`"),
    Setting("slots", "UNIUN_SLOTS", None,
            Kind(_slots, lambda value: value is None or (_whole(value) and 1 <= value <= MAX_SLOTS),
                 f"'auto' or a count from 1 to {MAX_SLOTS}"),
            "jobs a device decodes together; auto measures the step profile at each load",
            default_doc="auto", flag="`uniun-ray up --slots N`, `RuntimeConfig(slots=N)`"),
    Setting("warm_start", "UNIUN_WARM_START", True, _switch("load the chat model before start returns", "not to"),
            "`start()` and `uniun-ray up` load the active chat model before they say they are ready"),
    Setting("dtype", "UNIUN_DTYPE", "auto", _choice(*DTYPES),
            "the models' precision; auto: measured per host and model on a CPU, bf16 (else fp16) on a GPU; "
            "int8 (a CPU, never auto's choice): linear layers in int8, faster, a little less accurate "
            "([tuning](tuning.md#dtype-and-threads))"),
    Setting("threads", "UNIUN_THREADS", None, _count(1, "a thread count"),
            "torch's threads", default_doc="every core the actor's process may run on, or half, as measured"),
    Setting("memory", "UNIUN_MEMORY", None, Kind(_budget, _valid_budget, "a share of the device (0.8) or a size (12GiB)"),
            "the memory each device's plan divides between the active weights, idle models, KV rows and the "
            "prefix cache (`status` shows the plan); a setting that asks for more is refused",
            default_doc="a GPU's memory; on a CPU the host's available memory, shared by the node's devices"),
    Setting("kv_cache_mb", "UNIUN_KV_CACHE_MB", None, _MB,
            "the prefix KV cache's budget on the device (0: off)", default_doc="1024 on a CPU, 4096 on a GPU"),
    Setting("kv_offload_mb", "UNIUN_KV_OFFLOAD_MB", None, _MB,
            "the prefix cache's second tier, in CPU memory, on a GPU (0: none; unused on a CPU)",
            default_doc="4096 per GPU"),
    Setting("warm_mb", "UNIUN_WARM_MB", None, _MB,
            "host memory for the idle models kept warm (0: none kept, every swap is cold)",
            default_doc="half the host's available memory at the actor's start, shared by the node's devices"),
    Setting("coresident", "UNIUN_CORESIDENT", True, _switch("let idle models stay on the device where they fit",
                                                            "to keep them in host memory"),
            "idle models may stay on the device beside the active one (a swap back is then a switch)"),
    Setting("max_memory", "UNIUN_MAX_MEMORY", None,
            Kind(_max_memory, _valid_max_memory, "DEVICE=SIZE pairs, e.g. cpu=2GiB or 0=6GiB,cpu=20GiB"),
            "lets accelerate place and offload the weights of a model larger than the device",
            default_doc="the whole model on the device"),
    Setting("kv_rows_mb", "UNIUN_KV_ROWS_MB", None, _MB,
            "the static KV rows' store", default_doc="1024 on a CPU; on a GPU what its memory plan leaves"),
    Setting("deterministic", "UNIUN_DETERMINISTIC", False,
            _switch("get one greedy answer whatever rows are beside it and the prefix cache held", "(the default) not to"),
            "one greedy answer whatever rows are beside it and the prefix cache held, on a CPU; costs throughput "
            "([tuning](tuning.md#one-greedy-answer-determinism))"),
    Setting("hub_kernels", "UNIUN_HUB_KERNELS", False,
            _switch("let transformers fetch and run Hub kernels at load", "(the default) not to"),
            "let transformers fetch and run Hub kernels at load"),
    Setting("embedder_device", "UNIUN_EMBEDDER_DEVICE", "gpu", _choice("cpu", "gpu"),
            "cpu keeps the embedder on the CPU, so that every GPU serves models; gpu: it takes a GPU of its own "
            "where there are two or more"),
    Setting("embed_concurrency", "UNIUN_EMBED_CONCURRENCY", 2, _count(1, "a concurrency"), "embeds in flight"),
    Setting("cache_dir", "UNIUN_CACHE_DIR", None, _PATH,
            "where embedded GGUFs are converted once, and `tuning.json` (vLLM's venv goes beside it)",
            default_doc="~/.cache/uniun-ray/models"),
    Setting("state_dir", "UNIUN_STATE_DIR", None, _PATH,
            "where the event log `events.jsonl` is written, and `up.json` (what `uniun-ray up` started)",
            default_doc="~/.cache/uniun-ray"),
    Setting("api_key", "UNIUN_API_KEY", None, _text("a key"),
            "every HTTP route but the page's files, `/health` and Serve's own then needs it as "
            "`Authorization: Bearer` ([HTTP](http.md#on-a-network))", default_doc="none"),
    Setting("vllm_python", "UNIUN_VLLM_PYTHON", None, _PATH,
            "a Python that has vllm, instead of the venv `make install-vllm` builds", default_doc="that venv's"),
    Setting("kv_rows", "UNIUN_KV_ROWS", None, _choice(*ROW_KINDS),
            "where decoding rows keep their KV "
            "([engines](engines.md#the-kv-rows-padded-on-a-cpu-static-with-cuda-graphs-on-a-gpu))",
            default_doc="padded on a CPU, static on a GPU", debug=True),
    Setting("kv_steps", "UNIUN_KV_STEPS", None, _choice(*STEP_MODES),
            "how static rows step: CUDA graphs, their shapes without a capture, or exact shapes",
            default_doc="graphs on a GPU, exact on a CPU", debug=True),
    Setting("torch_device", "UNIUN_TORCH_DEVICE", None, _choice("cpu", "cuda"),
            "cpu keeps torch on the CPU in actors Ray gave a GPU (how the GPU placement is tested on CPU machines)",
            default_doc="the device Ray gave", debug=True),
)
SETTING: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}
ENV: dict[str, str] = {setting.name: setting.env for setting in SETTINGS}   # name -> its variable
SECRET = frozenset({"api_key"})


def read(name: str, environ: Mapping[str, str] = os.environ) -> Any:
    """One setting as the environment sets it now: for what is read where it is used (a folder,
    the HTTP key), in whichever process uses it."""
    return SETTING[name].read(environ.get(SETTING[name].env, ""))


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``UNIUN_STATE_DIR``, else ~/.cache/uniun-ray (``$XDG_CACHE_HOME`` where set)."""
    configured = read("state_dir", environ)
    return Path(configured) if configured else _cache_home(environ) / "uniun-ray"


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``UNIUN_CACHE_DIR``, else ~/.cache/uniun-ray/models. Read on every call, so a test or a
    deployment can redirect it through the environment."""
    configured = read("cache_dir", environ)
    return Path(configured) if configured else Path.home() / ".cache" / "uniun-ray" / "models"


def _cache_home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


@dataclass(frozen=True)
class Settings:
    """Every setting's effective value and where it came from (``SOURCES``), as read where the
    runtime starts (``load``)."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]

    @classmethod
    def load(cls, environ: Mapping[str, str] = os.environ, flags: Mapping[str, Any] | None = None) -> "Settings":
        """The environment's settings, then ``flags`` over them (a flag's text is read as the
        variable's, any other value checked as code gives it; None: not given). ValueError
        names the first that is not allowed."""
        values, sources = {}, {}
        for setting in SETTINGS:
            flag = (flags or {}).get(setting.name)
            if flag is not None:
                values[setting.name] = setting.read(flag) if isinstance(flag, str) else setting.check(flag)
                sources[setting.name] = "flag"
            else:
                values[setting.name] = setting.read(environ.get(setting.env, ""))
                sources[setting.name] = "environment" if environ.get(setting.env, "").strip() else "default"
        return cls(values, sources)

    def given(self, **values: Any) -> "Settings":
        """These settings with ``values`` as code gave them (a ``start`` argument), checked;
        the ones that change a value are counted as arguments."""
        changed = {name: SETTING[name].check(value) for name, value in values.items() if value != self.values[name]}
        return Settings({**self.values, **changed}, {**self.sources, **{name: "argument" for name in changed}})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("values", "sources"):
            raise AttributeError(name)
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def engine_settings(self) -> "EngineSettings":
        """What a ModelActor's engine is built from."""
        return EngineSettings(**{f.name: self.values[f.name] for f in fields(EngineSettings)})

    def describe(self) -> list[dict]:
        """Each setting's variable, value (a key shown as set, never itself) and source, for
        ``uniun-ray config`` and ``status``."""
        return [{"setting": s.env, "value": _shown(s.name, self.values[s.name]), "source": self.sources[s.name],
                 "debug": s.debug} for s in SETTINGS]


def _shown(name: str, value: Any) -> str:
    if name in SECRET:
        return "(unset)" if value is None else "(set)"
    if value is None:   # decided per device or host; a folder unset is its default one
        return "unset" if SETTING[name].kind is _PATH else "auto"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def _default(name: str) -> Any:
    return field(default=SETTING[name].default, hash=not isinstance(SETTING[name].default, (dict, list)))


@dataclass(frozen=True)
class EngineSettings:
    """The settings a device's engine is built from (``SETTINGS`` says what each does):
    ``dtype``, ``threads`` (None: every core this process may run on, its CPU affinity, never
    Ray's OMP_NUM_THREADS=1), the memory budgets in MB (None: the device's default, the memory
    plan's), ``max_memory`` (device -> size, as accelerate reads it), ``engine``, ``slots``
    (None: auto; an engine that fixes its batch at start, vLLM's ``max_num_seqs``, starts with
    this many), ``coresident``, ``hub_kernels``, ``deterministic``, ``kv_rows``/``kv_steps``
    (None: the device's), ``memory`` (the budget the plan divides)."""

    dtype: str = _default("dtype")
    threads: int | None = _default("threads")
    kv_cache_mb: int | None = _default("kv_cache_mb")
    kv_offload_mb: int | None = _default("kv_offload_mb")
    max_memory: dict[str, str] | None = field(default=None, hash=False)
    engine: str = _default("engine")
    slots: int | None = _default("slots")
    warm_mb: int | None = _default("warm_mb")
    coresident: bool = _default("coresident")
    hub_kernels: bool = _default("hub_kernels")
    deterministic: bool = _default("deterministic")
    kv_rows: str | None = _default("kv_rows")
    kv_steps: str | None = _default("kv_steps")
    kv_rows_mb: int | None = _default("kv_rows_mb")
    memory: float | int | None = _default("memory")

    def __post_init__(self) -> None:
        for each in fields(self):
            SETTING[each.name].check(getattr(self, each.name))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "EngineSettings":
        return Settings.load(environ).engine_settings

    def resolved_threads(self) -> int:
        """The thread count to give torch in this process."""
        return self.threads or len(os.sched_getaffinity(0)) or 1


def check_slot_count(slots: object) -> None:
    """A slot count (SPEC §6, R25) as code gives it: 1..MAX_SLOTS, or None for "auto"."""
    SETTING["slots"].check(slots)


def parse_slots(raw: str) -> int | None:
    """``UNIUN_SLOTS`` / ``--slots``: "auto" (or empty) is None, else a count."""
    return SETTING["slots"].read(str(raw))


def check_max_memory(max_memory: Mapping[str, str]) -> None:
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(f"max_memory must map devices to sizes, got {max_memory!r}")
    for device, size in max_memory.items():
        if not (device == "cpu" or (isinstance(device, str) and device.isdigit())):
            raise ValueError(f"max_memory: device {device!r} is neither 'cpu' nor a GPU index")
        if not isinstance(size, str) or not _SIZE.match(size):
            raise ValueError(f"max_memory: size {size!r} of {device!r} is not a size like '512MB' or '6GiB'")


def markdown_table() -> str:
    """The table of settings in docs/configuration.md, made from ``SETTINGS`` (a test checks
    that the page holds exactly this)."""
    lines = ["| setting | values (default) | what it sets |", "|---|---|---|"]
    for s in SETTINGS:
        where = f"`{s.env}`" + (f", {s.flag}" if s.flag else "")
        default = s.default_doc or _shown(s.name, s.default)
        debug = " *Debug: for tests and benchmarks; leave it unset.*" if s.debug else ""
        lines.append(f"| {where} | {s.kind.allowed} ({default}) | {s.doc}{debug} |")
    return "\n".join(lines)
