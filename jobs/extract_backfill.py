"""Extract: a backfill loop submits one plain extract job per note (T2); meanwhile the user
opens a note, whose extraction is hoisted to T1 and jumps the backlog.

    python jobs/extract_backfill.py [--notes 10] [--rate 4] [--model ID] [--address ADDR]
    ray job submit --working-dir . -- python jobs/extract_backfill.py --model tiny

See jobs/README.md for running it under `ray job submit`.
"""
from __future__ import annotations

import time

import ray

import uniun_ray
from common import job_parser, session
from uniun_ray.producers import spawn_producer


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--notes", type=int, default=10, help="notes to backfill (default 10)")
    parser.add_argument("--rate", type=float, default=4.0, help="backfill jobs per second (default 4)")
    parser.add_argument("--open-after", type=float, default=1.5, help="open a note after this many seconds")
    parser.add_argument("--model", help="model id (default: the active chat model)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    session(args)
    notes = spawn_producer("extract", "notes", model_id=args.model, max_new_tokens=args.max_new_tokens)
    try:
        ray.get(notes.state.remote())  # the actor is up: the clock below is the backfill's own
        started = time.perf_counter()
        backfill = notes.backfill.remote([f"note-{i}" for i in range(args.notes)], per_second=args.rate)
        time.sleep(args.open_after)
        queued = uniun_ray.status()["queued"]
        opened = ray.get(notes.open_note.remote("note-opened", "Lunch with Ada on Friday at the harbour café."))
        print(f"opened a note with {queued} jobs queued: its extraction (T1) took {opened.total_s:.2f}s")
        ray.get(notes.close_note.remote())
        summary = ray.get(backfill)
        t2 = uniun_ray.status()["t2"]
        print(f"backfill: {summary} in {time.perf_counter() - started:.1f}s; "
              f"T2 share of the window {t2['share']:.0%} (limit {t2['limit']:.0%})")
    finally:
        ray.get(notes.stop.remote())


if __name__ == "__main__":
    main()
