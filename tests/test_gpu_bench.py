"""`make gpu-check` and its benchmark (issue 36) must work the first time they run on a lent GPU
machine, which has no Ray and no package registry: so they run here, on a CPU, in processes
that cannot import Ray (the path finder does not see it, as there; a process that imports it
anyway exits 97), the benchmark on a tiny shape for two row counts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_RAY = '''
import atexit, os, sys
from importlib.machinery import PathFinder

class NoRay(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == "ray" else super().find_spec(name, path, target)

sys.meta_path[:] = [NoRay if finder is PathFinder else finder for finder in sys.meta_path]

@atexit.register
def check():
    if "ray" in sys.modules:
        print("ray was imported by", sys.argv, file=sys.stderr)
        os._exit(97)
'''
TINY = ["--device", "cpu", "--shapes", "tiny", "--tokenizer", "tiny", "--prompt-tokens", "16", "--new-tokens", "8",
        "--chat-rows", "2", "--chat-tokens", "4"]


@pytest.fixture
def without_ray(tmp_path):
    """An environment whose Python processes find no Ray (a sitecustomize first on the path)."""
    (tmp_path / "no-ray").mkdir()
    (tmp_path / "no-ray" / "sitecustomize.py").write_text(NO_RAY)
    environ = {k: v for k, v in os.environ.items() if k not in ("BENCH_RESULTS", "PYTHONPATH", "OUT")}
    return environ | {"PYTHONPATH": f"{tmp_path / 'no-ray'}:{ROOT}", "OUT": str(tmp_path / "out"),
                      "PYTHON": sys.executable}


def test_the_processes_here_cannot_import_ray(without_ray):
    """The stand-in for the lent machine holds: what imports Ray fails, and a process that
    imported it anyway fails at exit."""
    found = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('ray'))"],
                           env=without_ray, capture_output=True, text=True)
    assert found.stdout.strip() == "None"
    sneaked = subprocess.run([sys.executable, "-c", "import sys, types; sys.modules['ray'] = types.ModuleType('ray')"],
                             env=without_ray, capture_output=True, text=True)
    assert sneaked.returncode == 97


def test_gpu_check_installs_nothing_imports_no_ray_and_runs_its_plan_on_a_tiny_cpu_shape(without_ray, tmp_path):
    """The script as the lent machine runs it, on a CPU: its engine tests collected (every module
    they import imported), then the benchmark's plan measured, every kind of point once: the
    project at 1 and 2 rows (a chat beside the one left busy), the anchor at 1 row, the roofline;
    the record holds their rows. One run of the script: the benchmark alone took as long again."""
    environ = without_ray | {"GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_PYTEST_ARGS": "--collect-only",
                             "GPU_BENCH_ARGS": " ".join([*TINY, "--rows", "1,2", "--anchor-rows", "1"]),
                             "GPU_CHECK_WHEELS": str(tmp_path / "none")}
    (tmp_path / "out").mkdir()
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=300)
    summary = (tmp_path / "out" / "gpu-check.md").read_text()
    assert done.returncode == 0, summary + done.stderr[-3000:]
    assert "tests collected" in summary
    record = json.loads(next((tmp_path / "out" / "results").glob("gpu_bench*.json")).read_text())
    shape = record["detail"]["shapes"]["tiny"]
    assert [point["rows"] for point in shape["project"]] == [1, 2]
    assert all(point["step_ms"] > 0 and point["timed_steps"] >= 8 for point in shape["project"])
    assert shape["project"][1]["chat_beside"]["busy_rows"] == 1
    assert shape["chat_alone"]["ttft_ms"] > 0 and shape["chat_alone"]["tokens"] == 4
    assert [point["rows"] for point in shape["anchor"]["points"]] == [1]
    assert shape["anchor"]["points"][0]["new_tokens"] == 8 and shape["anchor"]["points"][0]["step_ms"] > 0
    assert shape["roofline_step_ms"] > 0 and not record["detail"]["ray_imported"]
    figures = [row["figure"] for row in record["rows"]]
    assert "tiny shape, 1 row: decode step, `Batch` / static compiled `generate`" in figures
    assert any(row["measured"].endswith("×") and "/" in row["measured"] for row in record["rows"])
    assert record["section"] == "GPU"


def test_the_budget_plans_the_goals_and_trims_the_rest_to_fit():
    """`--budget` never trims a goal's point on an estimate; the other points fit beside them or
    are trimmed; as the run goes, a point is skipped when it would take the time of a better one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bench

    def planned(*argv: str) -> tuple[gpu_bench.Budget, list, list]:
        budget = gpu_bench.Budget(gpu_bench.arguments(list(argv)), vocabulary=49152)
        return budget, *budget.trim(gpu_bench.plan(budget.args))

    _, kept, trimmed = planned("--budget", "100000")
    assert not trimmed and len(kept) == 3 * 2 * 7
    budget, kept, trimmed = planned("--budget", "300")
    goals = [(p.shape, p.kind, p.rows) for p in kept]
    assert sorted(goals) == sorted((s, k, r) for s in ("llama-1b", "llama-8b") for k in ("project", "anchor")
                                   for r in (1, 64))
    assert budget.need(kept) > 300                    # the goals' points stay, though their estimate is over
    budget, kept, trimmed = planned("--budget", "420")
    assert trimmed and not any(p.key for p in trimmed) and budget.need(kept) <= 420
    assert [p.shape for p in kept] == sorted((p.shape for p in kept), key=["llama-1b", "llama-8b"].index)
    spare = next(p for p in kept if not p.key and p.shape == "llama-1b")
    later = [p for p in kept if p.key and p.shape == "llama-8b"]
    enough = budget.need([spare] + later, started={"llama-1b"})
    budget.left = lambda: enough
    assert budget.affords(spare, later)
    budget.left = lambda: enough - 1
    assert not budget.affords(spare, later) and budget.affords(later[0], later[1:])
