"""A benchmark run's figures, kept as the record BENCHMARKS.md's tables are rendered from.

A script makes one `Record` per table it feeds, adds a row per figure, and saves it:

    record = Record("runtime", quick=args.quick)
    record.runs_on(threads=2, dtype="float32", engine="transformers")   # what the rows ran on
    record.row("swap in `tiny` (p50)", f"{swap:.2f} s")
    record.row("control plane / bare call (p50)", f"{ratio:.1f}×", goal="≤ 3×", met=ratio <= 3)
    record.save()

`save` prints the rows as a markdown table and writes `benchmarks/results/<name>.json` (name:
the script's own; `Record(..., name=...)` where a script feeds several tables); `render.py`
puts each record's rows into the section of BENCHMARKS.md it names. A record also keeps what
a reader needs to trust a row or to rerun it: the command as it ran (with the UNIUN_ settings
it ran under), the date, the host (CPU, torch's capability, cores, memory, GPU, torch) and the
1-min load average when the run started, and a note: the script's (`note=`) and the
environment's `BENCH_NOTE` (e.g. "beside other work"). `BENCH_RESULTS` writes the records
elsewhere.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "benchmarks" / "results"))
#: Settings a figure depends on, repeated in its command (the cache and state folders are not).
SETTINGS = ("UNIUN_DTYPE", "UNIUN_THREADS", "UNIUN_KV_CACHE_MB", "UNIUN_KV_OFFLOAD_MB", "UNIUN_MAX_MEMORY",
            "UNIUN_TORCH_DEVICE", "RAY_worker_niceness")


@dataclass
class Row:
    figure: str
    measured: str
    goal: str = ""
    met: bool | None = None        # None: no goal, or nothing to judge it by
    threads: int | str | None = None
    dtype: str | None = None
    engine: str | None = None


class Record:
    def __init__(self, section: str, quick: bool = False, name: str | None = None, note: str = "") -> None:
        self.section, self.quick = section, quick
        self.note = ", ".join(filter(None, [note, os.environ.get("BENCH_NOTE", "")]))
        self.name = name or Path(sys.argv[0]).stem
        self.started = time.time()
        self.load = os.getloadavg()[0]
        self.rows: list[Row] = []
        self.detail: dict | None = None    # what a script measured beyond its rows, kept with them
        self._on: dict = {}

    def runs_on(self, threads: int | str | None = None, dtype: str | None = None, engine: str | None = None) -> None:
        """What the rows added from now on ran on, unless a row says otherwise."""
        self._on = {"threads": threads, "dtype": dtype, "engine": engine}

    def row(self, figure: str, measured: str, goal: str = "", met: bool | None = None, **on) -> None:
        self.rows.append(Row(figure, measured, goal, None if met is None else bool(met), **(self._on | on)))

    def save(self, results: Path = RESULTS) -> Path:
        """A run on a GPU machine is kept beside the CPU figures (`-gpu`), not over them."""
        described = host()
        name = self.name + ("-gpu" if described.get("gpu") else "")
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"{name}.json"
        data = {"section": self.section, "name": name, "command": command(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started)),
                "quick": self.quick, "note": self.note, "load": round(self.load, 1),
                "host": described, "rows": [asdict(row) for row in self.rows]}
        if self.detail is not None:
            data["detail"] = self.detail
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n")
        print("\n| figure | goal | measured |\n|---|---|---|")
        for row in self.rows:
            verdict = "" if row.met is None else (": met" if row.met else ": MISSED")
            print(f"| {row.figure} | {row.goal}{verdict} | {row.measured} |")
        print(f"\n(recorded in {path})")
        return path


def command() -> str:
    """This process's command line as a reader reruns it from the repository's root."""
    settings = [f"{name}={shlex.quote(os.environ[name])}" for name in SETTINGS if name in os.environ]
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return " ".join([*settings, ".venv/bin/python", str(script), *map(shlex.quote, sys.argv[1:])])


def host() -> dict:
    """The machine, as the figures depend on it. torch is read only if the run imported it."""
    from uniun_ray.models.tune.tuning import cpu_model

    described = {"cpu": cpu_model(), "arch": platform.machine(), "cores": len(os.sched_getaffinity(0)),
                 "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
                 "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return described
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return described | {"capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                        "gpu": gpu}
