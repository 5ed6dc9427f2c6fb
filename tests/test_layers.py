"""Layers run one way (issue 12): policy and the event schema at the bottom, the simulator
on them only; models, runtime, client, then producers/jobs/CLI above. The bottom imports
neither Ray nor torch, which a fresh interpreter shows."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def test_policy_events_and_sim_load_no_ray_no_torch_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", out.stdout


def test_runtime_never_imports_the_client_or_what_sits_above_it():
    """runtime -> client was a cycle (producers lived in runtime/); the runtime's modules
    name neither the client nor the producers, the replay, the CLI or the demo."""
    above = ("client", "producers", "replay", "cli", "demo")
    offenders = []
    for path in sorted((ROOT / "uniun_ray" / "runtime").glob("*.py")):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("from ..", "import uniun_ray", "from uniun_ray")) and \
                    any(f".{name} import" in stripped or f"uniun_ray.{name}" in stripped for name in above):
                offenders.append(f"{path.name}: {stripped}")
    assert offenders == []
