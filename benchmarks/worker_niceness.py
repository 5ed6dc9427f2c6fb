"""Chat TTFT against the niceness of Ray's workers, with busy programs beside (issue 9).

    .venv/bin/python benchmarks/worker_niceness.py [--turns 8] [--burners 2] [--niceness 15 0]
    .venv/bin/python benchmarks/worker_niceness.py --quick    # niceness 0 only, one burner, two chats

Ray starts its workers, so every actor, at niceness 15 unless `RAY_worker_niceness` says
otherwise; uniun-ray's clusters set 0 (`runtime/head.py`). For each niceness asked, a private
local Ray with that setting (in a child process of its own), the default chat model in its
ModelActor, a warm-up chat, then `--turns` chats with the device idle, while `--burners`
CPU-bound programs at niceness 0 run beside it (a compile, a browser tab: the user's other
work). Records, per setting (section "runtime" of BENCHMARKS.md), the time from the start to
the first chat's end (the model's load included) and the chats' TTFT; a setting gets
`--budget` seconds, and what it finished by then is its figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys

BURN = "while True: pass"


def child(turns: int, budget_s: float) -> None:
    import time

    import ray

    from uniun_ray.client import agenerate
    from uniun_ray.demo import prompts
    from uniun_ray.runtime.launch import local_cluster, start

    done, began = [], time.perf_counter()

    async def chats():
        await agenerate("chat", "warm up", max_new_tokens=2)      # the model's load, in the ModelActor
        done.append(time.perf_counter() - began)
        for prompt in prompts(turns):
            done.append(await agenerate("chat", prompt, max_new_tokens=12))

    with local_cluster():
        handles = start()
        try:
            asyncio.run(asyncio.wait_for(chats(), budget_s))
        except asyncio.TimeoutError:
            pass                                                    # what finished in time is the figure
        engine = ray.get(handles.model.state.remote(), timeout=budget_s)["engine"]
    print(json.dumps({"warm_up_s": done[0] if done else None, "ttft": [d.ttft_s for d in done[1:]],
                      "prefill": [d.prefills[0]["prefill_s"] for d in done[1:]], "niceness": engine["niceness"],
                      "dtype": engine.get("dtype"), "threads": engine["threads"],
                      "cpu_capability": engine["cpu_capability"]}))


def main(argv: list[str] | None = None) -> None:
    from uniun_ray.runtime.head import WORKER_NICENESS_ENV

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound programs at niceness 0 beside Ray")
    parser.add_argument("--niceness", type=int, nargs="+", default=[15, 0], help="RAY_worker_niceness values")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds each setting may take; what is "
                        "done by then is reported")
    parser.add_argument("--quick", action="store_true", help="niceness 0 only, one burner, two chats in 90 s")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.turns, args.budget)
    from record import Record

    if args.quick:   # proves it runs, and takes one core from the host's other work, not two
        args.turns, args.budget, args.burners, args.niceness = 2, 90.0, 1, [0]
    record = Record("runtime", quick=args.quick)
    for niceness in args.niceness:
        burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
        try:
            env = os.environ | {WORKER_NICENESS_ENV: str(niceness), "RAY_AUTH_MODE": "disabled"}
            env.pop("RAY_ADDRESS", None)
            out = subprocess.run([sys.executable, __file__, "--child", "--turns", str(args.turns), "--budget",
                                  str(args.budget)], env=env, capture_output=True, text=True, check=True).stdout
        finally:
            for burner in burners:
                burner.kill()
        r = json.loads(out.strip().splitlines()[-1])
        ttft = r["ttft"]
        record.row(f"RAY_worker_niceness={niceness} (actors at {r['niceness']}), {args.burners} CPU burners at 0 "
                   f"beside: start to the warm-up chat's end; chats done; TTFT p50 / max",
                   (f"{r['warm_up_s']:.1f} s" if r["warm_up_s"] is not None else f"over {args.budget:.0f} s")
                   + f"; {len(ttft)} of {args.turns}; "
                   + (f"{statistics.median(ttft):.2f} / {max(ttft):.2f} s" if ttft else "–"),
                   threads=r["threads"], dtype=r["dtype"], engine="transformers")
    record.save()


if __name__ == "__main__":
    main()
