"""`make test` from a fresh clone, timed as a new contributor meets it (issue 28's goal: <= 10
minutes, the install included, with an empty model cache and a busy program beside it).

    .venv/bin/python benchmarks/suite_time.py --runs 3 [--shuffled]   # "test suite" in BENCHMARKS.md

Each run clones this repository's HEAD (what is committed; the working tree's changes are not
in it) into a new folder, points UNIUN_CACHE_DIR at an empty one, starts `--burners` CPU-bound
programs at niceness 0, and times `make install` then `make test` there; with `--shuffled`,
`make test-shuffled` with a new seed each run (the seed is in the record: `make test-shuffled
SEED=N` runs that order again). Each run's output is kept in its folder (`test.log`). A second
record, `suite_slowest`, lists the slowest tests (`make test` prints them: `--durations`), each
with the longest time any run gave it and what it buys (its docstring's first sentence). Not part of `make
bench`: three runs take about half an hour and want the machine to themselves.
"""
from __future__ import annotations

import argparse
import ast
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import ROOT, Record

SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?)\b.* in [\d.]+s")

BURN = "while True: pass"
#: How many of the slowest tests the record lists (issue 44).
SLOWEST = 20
#: A line of pytest's `--durations` report: seconds, phase, test id.
DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+::\S+)", re.MULTILINE)


def timed(command: list[str], cwd: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - started, done


def one_run(burners: int, seed: int | None) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="uniun-suite-"))
    clone = folder / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "RAY_ADDRESS"))}
    env |= {"UNIUN_CACHE_DIR": str(folder / "cache"), "RAY_AUTH_MODE": "disabled"}
    running = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(burners)]
    try:
        install_s, install = timed(["make", "install"], clone, env)
        test = ["make", "test"] if seed is None else ["make", "test-shuffled", f"SEED={seed}"]
        test_s, test = timed(test, clone, env) if install.returncode == 0 else (0.0, install)
    finally:
        for burner in running:
            burner.kill()
    log = test.stdout + test.stderr
    (folder / "test.log").write_text(log)   # which test failed, and how
    summary = pytest_summary(test.stdout)
    return {"folder": str(folder), "log": log, "install_s": install_s, "test_s": test_s,
            "ok": install.returncode == 0 and test.returncode == 0, "summary": summary, "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone,
                                                         capture_output=True, text=True).stdout.strip()}


def pytest_summary(out: str) -> str:
    """pytest's last line ("908 passed, 2 skipped ... in 490.11s"), which make's own lines follow
    when a target calls make again; else the output's last line."""
    lines = out.strip().splitlines() or ["no output"]
    return next((line for line in reversed(lines) if SUMMARY.search(line)), lines[-1])


def durations(log: str) -> dict[str, float]:
    """Seconds per test id (its setup, call and teardown together) in a run's `--durations` report."""
    found: dict[str, float] = {}
    for seconds, _, test in DURATION.findall(log):
        found[test] = found.get(test, 0.0) + float(seconds)
    return found


def what_it_buys(test: str) -> str:
    """The first sentence of the test's docstring (parametrized: its function's), else its name."""
    path, _, name = test.partition("::")
    name = name.split("[")[0].split("::")[-1]
    try:
        tree = ast.parse((ROOT / path).read_text())
    except (OSError, SyntaxError):
        return name.replace("_", " ")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            doc = " ".join((ast.get_docstring(node) or "").split())
            said = re.split(r"(?<=\.)\s", doc)[0] if doc else name.replace("_", " ")
            return said if len(said) <= 160 else said[:159] + "…"
    return name.replace("_", " ")


def slowest(logs: list[str]) -> Record:
    """The SLOWEST tests by the longest time any run gave them."""
    longest: dict[str, float] = {}
    for log in logs:
        for test, seconds in durations(log).items():
            longest[test] = max(seconds, longest.get(test, 0.0))
    record = Record("suite", name="suite_slowest", note=f"the {SLOWEST} slowest tests of the runs above "
                                                        "(setup, call and teardown; the longest of the runs)")
    for test, seconds in sorted(longest.items(), key=lambda item: -item[1])[:SLOWEST]:
        record.row(f"`{test}`: {what_it_buys(test)}", f"{seconds:.1f} s")
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--burners", type=int, default=1, help="CPU-bound programs at niceness 0 beside the suite")
    ap.add_argument("--shuffled", action="store_true", help="make test-shuffled, a new seed each run")
    args = ap.parse_args()
    record, logs = Record("suite"), []
    for run in range(1, args.runs + 1):
        seed = random.randrange(1 << 31) if args.shuffled else None
        r = one_run(args.burners, seed)
        total = r["install_s"] + r["test_s"]
        logs.append(r["log"])
        print(f"run {run}: {'ok' if r['ok'] else 'FAILED'} in {total:.0f} s ({r['folder']}/test.log)", flush=True)
        command = "`make test`" if seed is None else f"`make test-shuffled SEED={seed}`"
        record.row(f"`make install` + {command} from a fresh clone at {r['commit']}, empty model cache, "
                   f"{args.burners} CPU burner(s) beside: run {run} of {args.runs}",
                   f"{total / 60:.1f} min ({r['install_s']:.0f} s install + {r['test_s']:.0f} s tests): {r['summary']}",
                   goal="≤ 10 min, green (issue 28)", met=r["ok"] and total <= 600)
    record.save()
    slowest(logs).save()


if __name__ == "__main__":
    main()
