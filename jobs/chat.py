"""Chat: Shiv chat turns (T0), streamed, each with its time to first token.

    python jobs/chat.py [--prompt TEXT] [--turns N] [--model ID] [--address ADDR]
    ray job submit --working-dir . -- python jobs/chat.py

Under `ray job submit` the working dir is uploaded (files .gitignore'd are left out, so the
venv is not) and the job runs in the cluster's Python, where uniun-ray must be installed
(`make install`); the upload is first on the import path, so the job uses this checkout's
code. Without --address, `uniun_ray.connect()` joins the Ray cluster it finds (RAY_ADDRESS,
else address="auto") or starts a local one that ends with the script.
"""
from __future__ import annotations

import argparse
import time

import uniun_ray


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Name three rivers in one short sentence.")
    parser.add_argument("--turns", type=int, default=2, help="send the prompt this many times (default 2)")
    parser.add_argument("--model", help="model id (default: the active chat model)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--address", help="Ray address (default: RAY_ADDRESS or auto)")
    args = parser.parse_args(argv)

    uniun_ray.connect(args.address)
    uniun_ray.start()
    ttfts = []
    for turn in range(1, args.turns + 1):
        started, first = time.perf_counter(), None
        print(f"[{turn}] ", end="")
        for piece in uniun_ray.stream("chat", args.prompt, model_id=args.model, max_new_tokens=args.max_new_tokens):
            first = first if first is not None else time.perf_counter() - started
            print(piece, end="", flush=True)
        ttfts.append(first)
        print(f"\n    TTFT {first:.2f}s, total {time.perf_counter() - started:.2f}s" if first is not None
              else "\n    (no tokens)")
    shown = ", ".join("-" if t is None else f"{t:.2f}s" for t in ttfts)
    print(f"chat: {args.turns} turns, TTFT {shown} (the first includes loading the model if it was not resident)")


if __name__ == "__main__":
    main()
