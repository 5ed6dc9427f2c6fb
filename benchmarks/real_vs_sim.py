"""The real runtime beside the simulator (issue 4, part 6), recorded: each short workload
played in real time on a private local Ray, then simulated at the `cpu` profile's speeds and
at the speeds the run showed.

    .venv/bin/python benchmarks/real_vs_sim.py            # section "simulator" of BENCHMARKS.md (~8 min)
    .venv/bin/python benchmarks/real_vs_sim.py --quick    # issue118_short only (~4 min)

`uniun-ray bench --real` plays the same and also writes the event logs and timelines.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from record import Record

from uniun_ray.replay import cell, comparison, play_fresh
from uniun_ray.sim.device import PROFILES
from uniun_ray.sim.workloads import SHORT_WORKLOADS, generate

SEED = 1
#: The comparison's rows left to `uniun-ray bench --real`'s report (counts, and per flow).
LEFT_OUT = ("jobs submitted", "chat turns", "service s:")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="issue118_short only")
    args = ap.parse_args()
    device, out = PROFILES["cpu"], Path(tempfile.mkdtemp(prefix="uniun-real-vs-sim-"))
    record = Record("simulator", quick=args.quick)
    for name in list(SHORT_WORKLOADS)[:1] if args.quick else SHORT_WORKLOADS:
        played = play_fresh(generate(name, SEED), out / f"events-{name}.jsonl")
        rows, _ = comparison(played, device)
        for figure, values in rows:
            if not figure.startswith(LEFT_OUT):
                record.row(f"{name}: {figure}: measured; predicted at the profile's speeds; at the run's",
                           "; ".join(map(cell, values)),
                           **({"engine": "transformers"} if ": " in figure else {}))
        if played.errors:
            record.row(f"{name}: errors in the real run", "; ".join(played.errors))
    record.save()


if __name__ == "__main__":
    main()
