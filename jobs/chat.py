"""Chat: Shiv chat turns (T0), streamed, each with its time to first token.

    python jobs/chat.py [--prompt TEXT] [--turns N] [--model ID] [--address ADDR]
    ray job submit --working-dir . -- python jobs/chat.py

See jobs/README.md for running it under `ray job submit`.
"""
from __future__ import annotations

import time

import uniun_ray
from common import job_parser, session


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--prompt", default="Name three rivers in one short sentence.")
    parser.add_argument("--turns", type=int, default=2, help="send the prompt this many times (default 2)")
    parser.add_argument("--model", help="model id (default: the active chat model)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    session(args)
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
