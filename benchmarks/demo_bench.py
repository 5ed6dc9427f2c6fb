"""`make demo`'s chat TTFT goals (issue 9), recorded: a chat against the bare engine, idle and
while a Nataraj fills its deck on the same model.

    .venv/bin/python benchmarks/demo_bench.py --turns 10     # section "runtime" of BENCHMARKS.md
    .venv/bin/python benchmarks/demo_bench.py --quick        # three turns, a smaller deck

The demo itself (`uniun_ray/demo.py`) prints what it measures; this records it.
"""
from __future__ import annotations

import argparse
import statistics

from record import Record

from uniun_ray import demo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="three turns, a deck of two short cards")
    args = ap.parse_args()
    figures = demo.main(["--turns", "3", "--deck", "2", "--card-tokens", "48"] if args.quick
                        else ["--turns", str(args.turns)])
    bare, r = figures["bare"], figures["runtime"]
    engine = bare["engine"]
    record = Record("runtime", quick=args.quick)
    record.runs_on(threads=engine["threads"], dtype=engine["dtype"], engine="transformers")
    best, idle = min(bare["ttft"]), statistics.median(r["idle"])
    record.row(f"chat TTFT, the bare engine in a plain process, p50 (best), n={len(bare['ttft'])}",
               f"{statistics.median(bare['ttft']):.3f} s ({best:.3f})")
    record.row("chat TTFT through the runtime, device idle, p50 against the bare best", f"{idle:.3f} s, {idle / best:.2f}×",
               goal="≤ 1.3× (issue 9)", met=idle <= 1.3 * best)
    prefill = statistics.median(r["idle_prefill"])
    record.row("of which the model's prefill: in the ModelActor / bare, p50",
               f"{prefill * 1e3:.0f} / {statistics.median(bare['prefill']) * 1e3:.0f} ms")
    record.row("of which the rest (check, queue, lease, stream), p50",
               f"{statistics.median(t - m for t, m in zip(r['idle'], r['idle_prefill'])) * 1e3:.0f} ms")
    if r["busy"]:
        extra, step = statistics.median(r["busy"]) - idle, engine["decode_ms"] / 1e3
        record.row(f"chat TTFT while a Nataraj fills its deck, p50 (n={len(r['busy'])}), over idle",
                   f"{statistics.median(r['busy']):.3f} s, {extra * 1e3:+.0f} ms",
                   goal=f"≤ one decode step ({step * 1e3:.0f} ms) + 50 ms (issue 9)", met=extra <= step + 0.05)
    if r["http"] is not None:
        record.row("chat TTFT over HTTP while a Nataraj fills (one turn)", f"{r['http']:.3f} s")
    record.save()


if __name__ == "__main__":
    main()
