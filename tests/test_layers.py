"""Layers run one way (issue 12): policy and the event schema at the bottom, the simulator
on them only; models (and the engines beside them), runtime, client, then producers/jobs/
CLI/HTTP above. The bottom imports neither Ray nor torch, which a fresh interpreter shows;
what a package may not import is read from its source, lazy imports inside functions included."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "uniun_ray"


def _load_architecture():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "docs" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: docs/architecture.py: the one reader of a module's imports, for these tests and the picture.
ARCHITECTURE = _load_architecture()

PROBE = """
import importlib, pkgutil, sys
import uniun_ray.policy, uniun_ray.events, uniun_ray.sim
for package in (uniun_ray.policy, uniun_ray.events, uniun_ray.sim):
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "torch", "transformers"))
upper = sorted(m for m in sys.modules if m.startswith(("uniun_ray.runtime", "uniun_ray.models", "uniun_ray.client",
                                                         "uniun_ray.producers", "uniun_ray.replay")))
print(heavy, upper)
"""

#: What the runtime names of the models layer: the engine seam, a request, its result and
#: the refusal of one too long; none may cost torch (the runtime's driver process has none).
SEAM_PROBE = """
import sys
import uniun_ray.engines
from uniun_ray.models import GenerateRequest, GenerationResult, PromptTooLong, inspect_request
print(sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "torch", "transformers")))
"""

#: What sits above the client: nothing below it may name these.
TOP = {"producers", "replay", "cli", "demo", "http"}

#: A package, and the packages of uniun_ray it must not import.
FORBIDDEN = {
    # runtime -> client was a cycle (producers lived in runtime/)
    "runtime": {"client"} | TOP,
    # the engine runs a model for whatever drives it: it knows no lease, queue or client
    "models": {"runtime", "policy", "client"} | TOP,
    # the engines sit at the models layer (SPEC §7): a ModelActor drives one, not the reverse
    "engines": {"runtime", "policy", "client"} | TOP,
}


def test_policy_events_and_sim_load_no_ray_no_torch_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", out.stdout


def test_the_engine_seam_requests_results_and_their_checks_load_no_torch():
    out = subprocess.run([sys.executable, "-c", SEAM_PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_never_imports_what_sits_above_it(package):
    offenders = sorted(f"{path.relative_to(PACKAGE)} imports uniun_ray.{name}"
                       for path in sorted((PACKAGE / package).rglob("*.py"))
                       for name in _imported_packages(path) & FORBIDDEN[package])
    assert offenders == []


#: The rooms of `models`, lowest first: a room imports only the rooms below it. The registry of
#: ids and the record of a swap are modules of their own; the runner runs the forward passes, the
#: load room brings weights to it, and decode decides who joins, steps and leaves.
MODEL_ROOMS = ("registry", "swap", "requests", "kv", "tune", "runner", "load", "decode")


def test_the_rooms_of_models_import_one_way_and_its_modules_form_no_cycle():
    modules = {_module(path): path for path in sorted((PACKAGE / "models").rglob("*.py"))}
    graph = {module: {name for name in _imported_names(path) if name in modules and name != module}
                     for module, path in modules.items()}
    upward = sorted(f"{module} imports {name}" for module, names in graph.items() for name in names
                    if _room(name) > _room(module))
    assert upward == []
    typed = {module: {name for name in _imported_names(path, annotations=True) if name in modules and name != module}
             for module, path in modules.items()}
    assert _cycle(typed) == []   # an import for annotations only ties two modules too


def _room(module: str) -> int:
    """Where a module of models sits: its room's rank; the package itself above them all."""
    parts = module.split(".")
    return MODEL_ROOMS.index(parts[2]) if len(parts) > 2 else len(MODEL_ROOMS)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (as the modules along it), or [] when there is none."""
    done, path = set(), []

    def visit(module: str) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for name in sorted(graph[module]):
            if found := visit(name):
                return found
        path.pop()
        done.add(module)
        return []
    return next((found for module in sorted(graph) if (found := visit(module))), [])


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imported_packages(path: Path) -> set[str]:
    """The packages of uniun_ray (`runtime`, `client`...) that a module imports anywhere in it."""
    return {name.split(".")[1] for name in _imported_names(path) if name.startswith("uniun_ray.")}


def _imported_names(path: Path, annotations: bool = False) -> set[str]:
    """Every dotted name a module imports anywhere in it (docs/architecture.py reads them so)."""
    return ARCHITECTURE.imports(path, annotations)


def test_the_architecture_picture_is_drawn_from_the_code_as_it_is():
    """docs/architecture.dot is what docs/architecture.py writes from today's imports: after a
    change of rooms or arrows, `docs/render_architecture.sh` draws it again."""
    assert (ROOT / "docs" / "architecture.dot").read_text() == ARCHITECTURE.dot()
