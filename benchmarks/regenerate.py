"""`make bench`: run every benchmark this host can run, then write BENCHMARKS.md's tables.

    .venv/bin/python benchmarks/regenerate.py             # make bench: the figures (an hour or more)
    .venv/bin/python benchmarks/regenerate.py --quick     # make bench QUICK=1: proves each runs (~30 min)
    .venv/bin/python benchmarks/regenerate.py --only pick_cost sim_bench

Each step is a script of this folder that saves a record (`record.py`); a step that needs a
GPU, or a peer engine's package, is skipped where there is none, and its section keeps the
figures last recorded. A step that fails is reported and the others still run; the tables
are written from whatever records there are (`render.py`); then the failed steps are named
last, on stderr, and the exit status is 1. To add figures: write a script that saves a `Record`
naming its section, and add its step here.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass

import render
from record import ROOT


@dataclass(frozen=True)
class Step:
    script: str                     # in benchmarks/
    full: tuple[str, ...] = ()      # its arguments for the figures
    quick: tuple[str, ...] = ("--quick",)
    needs: str | None = None        # "gpu", or the module a peer engine brings ("vllm")

    def missing(self) -> str | None:
        """Why this host cannot run the step, or None."""
        if self.needs is None:
            return None
        if self.needs == "gpu":
            import torch
            return None if torch.cuda.is_available() else "no CUDA GPU"
        return None if importlib.util.find_spec(self.needs) else f"no {self.needs} installed"


PLAN = (
    Step("pick_cost.py"),
    Step("sim_bench.py"),
    Step("step_profile.py"),
    Step("int8_quality.py"),
    Step("fusing_bench.py"),
    Step("loader_thread.py"),
    Step("engine_bench.py", ("--trials", "5")),
    Step("runtime_bench.py", ("--repeat", "5")),
    Step("runtime_bench.py", ("--control-only",), ("--control-only", "--quick")),
    Step("runtime_bench.py", ("--stream-only", "--repeat", "3"), ("--stream-only", "--quick")),
    Step("demo_bench.py", ("--turns", "10")),
    Step("overload.py", ("--jobs", "10000", "--producers", "100", "--clients", "4")),
    Step("worker_niceness.py", ("--niceness", "15", "0", "--budget", "200")),
    Step("kv_cache_bench.py"),
    Step("turn_cost.py"),
    Step("batch_bench.py"),
    Step("invariance_bench.py"),
    Step("http_bench.py", ("--requests", "60", "--turns", "10")),
    Step("real_vs_sim.py"),
    Step("node_loss.py"),
    Step("soak.py", ("--minutes", "10")),
    Step("gpu_bench.py", needs="gpu"),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every step in its quick mode")
    ap.add_argument("--only", nargs="+", metavar="SCRIPT", help="only these scripts (names without .py)")
    args = ap.parse_args()
    steps = [s for s in PLAN if not args.only or s.script.removesuffix(".py") in args.only]
    outcome = []
    for step in steps:
        name = " ".join(["benchmarks/" + step.script, *(step.quick if args.quick else step.full)])
        why = step.missing()
        if why:
            outcome.append(f"skipped  {name}: {why}")
            continue
        print(f"\n== {name}", flush=True)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, *name.split()], cwd=ROOT)
        outcome.append(f"{'ok' if done.returncode == 0 else 'FAILED':8} {name} ({time.perf_counter() - started:.0f} s)")
    try:
        render.main()
    except Exception as error:   # the tables of the records there are: a bad one is a failure too
        outcome.append(f"FAILED   benchmarks/render.py: {type(error).__name__}: {error}")
    print("\n" + "\n".join(outcome))
    failed = [line.split(None, 1)[1] for line in outcome if line.startswith("FAILED")]
    if failed:
        print(f"\nmake bench: {len(failed)} of {len(outcome)} steps FAILED (their figures were not "
              f"regenerated):\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
