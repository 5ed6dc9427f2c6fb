"""Gana: one interactive run with its form open (T1), then cron-fired runs due every few
seconds (deadline = fire time, no foreground), on the Gana's own model.

    python jobs/gana_cron.py [--runs 3] [--every 3] [--model gemma-3-270m] [--address ADDR]
    ray job submit --working-dir . -- python jobs/gana_cron.py --model tiny

Each cron run is queued one period before its fire time: it waits in the fair pool (T4)
and rises to T3 when it falls due. The default model is not the chat model, so the first
run pays a model swap.

See jobs/README.md for running it under `ray job submit`.
"""
from __future__ import annotations

import time

import ray

from common import job_parser, session
from uniun_ray.producers import spawn_producer


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--runs", type=int, default=3, help="cron ticks (default 3)")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between ticks (default 3)")
    parser.add_argument("--model", default="gemma-3-270m", help="the Gana's desired model (default gemma-3-270m)")
    parser.add_argument("--prompt", default="Daily digest: the three most important notes of today are")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    session(args)
    gana = spawn_producer("gana", "digest", desired_model_id=args.model, max_new_tokens=args.max_new_tokens)
    try:
        ray.get(gana.open_page.remote())
        preview = ray.get(gana.run.remote(args.prompt))
        print(f"interactive (form open, T1): {preview.total_s:.2f}s on {preview.model_id}: "
              f"{' '.join(preview.text.split())[:80]}")
        ray.get(gana.close_page.remote())

        started = time.time()
        for record in ray.get(gana.cron.remote(args.prompt, args.every, args.runs)):
            due = record["deadline"] - started
            late = record.get("late_s")
            outcome = record.get("error") or f"finished {abs(late):.2f}s {'after' if late > 0 else 'before'} its fire time"
            print(f"  cron run due at +{due:.1f}s on {record['model_id']}: {outcome}")
        print(f"gana: {ray.get(gana.state.remote())}")
    finally:
        ray.get(gana.stop.remote())


if __name__ == "__main__":
    main()
